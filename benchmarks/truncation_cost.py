"""What an exact importance ratio under a truncating sampler costs the trainer, on SmolLM2-135M-Instruct.

With top-p/top-k/min-p or a repetition penalty, the proximal policy is rebuilt the way the engine processed its
logits (``trl_async.correction.sampling.proximal_logps``): one forward pass without gradient, then the penalty and truncations
on each completion position's logits. Without them the loss's own forward serves, at no cost. This times, interleaved
and repeated, on one batch of the demo's shape (random token ids):

  forward_backward   one training forward+backward (gradient checkpointing off), the unit a step is made of
  forward            a plain no-grad forward with log-softmax: the proximal pass's floor
  processed_*        proximal_logps with the named sampler (its forward included)

and works out what the alternative (the engine returning each token's kept set, as a vocabulary bitmask) would move
per batch. Writes results/truncation_cost.{json,png} and its table in RESULTS.md.

    python benchmarks/truncation_cost.py            # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import report  # noqa: E402

SAMPLERS = {
    "processed_top_p": dict(top_p=0.9),
    "processed_top_p_top_k": dict(top_p=0.9, top_k=20),
    "processed_all": dict(top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    cli = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from trl_async.correction.sampling import SamplingSettings, proximal_logps
    from trl_async.demo.pretrained import smollm2_135m_instruct

    torch.set_num_threads(cli.threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(smollm2_135m_instruct(), dtype=torch.float32)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (cli.rows, cli.prompt + cli.completion))
    mask = torch.ones_like(ids)

    def forward_backward():
        model.train()
        logits = model(input_ids=ids, attention_mask=mask).logits[:, cli.prompt - 1 : -1]
        logps = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, cli.prompt :, None])
        logps.mean().backward()
        model.zero_grad(set_to_none=True)

    def forward():
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits[:, cli.prompt - 1 : -1]
            torch.log_softmax(logits.float(), -1).gather(-1, ids[:, cli.prompt :, None])

    def processed(fields):
        settings = SamplingSettings(engine="transformers", **fields)

        def run():
            model.eval()
            with torch.no_grad():
                steps = ids.size(1) - cli.prompt
                logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=steps + 1, use_cache=False).logits
                proximal_logps(ids, mask, logits, cli.prompt, settings, 1.0)

        return run

    cases = {"forward_backward": forward_backward, "forward": forward}
    cases.update({name: processed(fields) for name, fields in SAMPLERS.items()})
    for run in cases.values():  # warm-up
        run()
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(cli.repeats):
        for name, run in cases.items():  # interleaved: a slow moment of the machine hits every case
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    for name, value in median.items():
        print(f"{name}: {value:.2f} s (runs {', '.join(f'{v:.2f}' for v in seconds[name])})", flush=True)

    tokens = cli.rows * cli.completion
    bitmask_mb = tokens * vocab / 8 / 2**20
    rows = [[name, median[name], median[name] / median["forward_backward"],
             (median[name] - median["forward"]) / median["forward"] if name.startswith("processed") else 0.0]
            for name in cases]  # fmt: skip
    table = report.markdown_table(["case", "seconds (median)", "× forward+backward", "extra over a plain forward"],
                                  rows)  # fmt: skip
    report.write_json("truncation_cost", {
        "settings": vars(cli) | {"vocab": vocab, "samplers": SAMPLERS},
        "seconds": seconds, "median_s": median, "kept_set_bitmask_mb_per_batch": bitmask_mb,
    })  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.barh(list(median), [median[n] for n in median])
    ax.set(xlabel="seconds per batch (median)", title=f"{cli.rows} rows x {cli.prompt}+{cli.completion} tokens")
    fig.tight_layout()
    fig.savefig(report.png_path("truncation_cost"), dpi=110)
    report.update_readme(
        "truncation_cost",
        f"### What the exact ratio under truncation costs (`python benchmarks/truncation_cost.py`)\n\n"
        f"SmolLM2-135M-Instruct, float32, {cli.threads} threads, one batch of {cli.rows} rows × {cli.prompt} prompt + "
        f"{cli.completion} completion tokens, median of {cli.repeats} interleaved runs. Samplers: "
        + "; ".join(f"`{name}` {fields}" for name, fields in SAMPLERS.items())
        + f".\n\n{table}\n\nThe alternative, each token's kept set returned by the engine as a vocabulary bitmask "
        f"({vocab} tokens), would move {bitmask_mb:.1f} MB per such batch ({vocab / 8 / 1024:.1f} KB per token) from "
        "the engines to the trainer, and the trainer would still need the logits (a forward pass) to renormalise "
        "over it.\n\n![](results/truncation_cost.png)",
    )
    print(table)


if __name__ == "__main__":
    main()
