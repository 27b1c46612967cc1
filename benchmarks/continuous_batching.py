"""Continuous batching against static batches in one rollout worker's generation, the same prompts, in one run.

Static: chunks of ``slots`` rows, one ``generate`` call each (what the transformers workers do without continuous
batching): every row of a chunk waits for the chunk's longest row. Two continuous engines with ``slots`` rows decoding
at once, a finished row's slot taken by the next row at once: ``SlotRows`` (the slot loop on one plain KV cache, what a
CPU worker runs) and ``ContinuousRows`` (transformers' paged continuous batching, what a GPU worker runs).
Completion lengths come from the model (each side samples its own), so the comparison is completion tokens per second
(tokens kept, through each row's first EOS), plus the share of slot time spent on kept tokens.

Slots are a dial, so each mode also reports what they cost: wall time per forward pass (a decode step, a prefill or
both at once), when
rows come back (seconds from the start until a row is returned: mean and 90th percentile, all rows submitted at once),
and the KV cache at its largest (static: rows x (widest prompt + longest completion) of each chunk, what ``generate``'s
cache holds at its end; slot loop: its buffers, read after every step; paged: the cache transformers allocates up
front). On a GPU, also the peak memory allocated beyond the weights.

    python benchmarks/continuous_batching.py                       # CPU: the real SmolLM2-135M-Instruct, ~15 min
    python benchmarks/continuous_batching.py --device cuda --slots 64 256 --prompts 512   # a GPU

Writes results/continuous_batching{,_<device>}.{json,png} (the png: rows decoding over time in each mode) and its table
in RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import report  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402

from trl_async.demo.arithmetic import make_split  # noqa: E402
from trl_async.demo.pretrained import smollm2_135m_instruct  # noqa: E402
from trl_async.engines.transformers.continuous import ContinuousRows  # noqa: E402
from trl_async.engines.transformers.slots import SlotRows  # noqa: E402
from trl_async.engines.transformers.worker import generate_groups  # noqa: E402
from trl_async.records import RolloutTask  # noqa: E402


def prompts(tokenizer, n: int) -> list[tuple[int, ...]]:
    rows = make_split("train", n, seed=0)
    return [
        tuple(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False))
        for r in rows
    ]


def kv_bytes_per_token(model) -> int:
    """Keys and values of one token over every layer."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * next(model.parameters()).element_size()


def run_static(model, config, eos, pad, rows, slots) -> dict:
    start, spans, kept, steps, returned, cache = time.time(), [], 0, 0, [], 0
    for i in range(0, len(rows), slots):
        chunk = [RolloutTask(j, j, p, 0) for j, p in enumerate(rows[i : i + slots])]
        begun = time.time()
        groups = generate_groups(model, chunk, config, 1, eos, pad, lambda: 0)
        ended = time.time()
        lengths = [len(c) for g in groups for c in g.completion_ids]
        kept += sum(lengths)
        longest = max(lengths)
        steps += longest  # generate's forward passes: the prefill and a step per token of the chunk's longest row
        returned += [ended - start] * len(lengths)
        width = max(len(t.prompt_ids) for t in chunk)
        cache = max(cache, len(chunk) * (width + longest) * kv_bytes_per_token(model))
        for n in lengths:  # a row is useful until its own last token, idle (padding) after it
            spans.append((begun, begun + (ended - begun) * n / longest))
    wall = time.time() - start
    return {"wall_s": wall, "tokens": kept, "tokens_per_s": kept / wall, "timeline": occupancy(spans, start),
            "steps": steps, "returned_s": returned, "kv_cache_bytes": cache}  # fmt: skip


ENGINES = {"slots": SlotRows, "paged": ContinuousRows}


def counted(obj, name: str) -> list[int]:
    """Count the calls of ``obj.name`` (a decode step of either engine): the count is the returned list's one item."""
    calls, method = [0], getattr(obj, name)

    def wrapper(*args, **kwargs):
        calls[0] += 1
        return method(*args, **kwargs)

    setattr(obj, name, wrapper)
    return calls


def held_bytes(engine) -> int:
    """The KV cache the engine holds now."""
    if isinstance(engine, SlotRows):
        layers = engine.past.layers if engine.past is not None else []
        return sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
    processor = engine.manager.batch_processor  # made by the engine's thread once it starts
    return processor.cache.cache_tensor.numel() if processor is not None else 0  # one uint8 buffer


def run_continuous(engine_class, model, config, eos, pad, rows, slots) -> dict:
    engine = engine_class(model, config, 1, eos, slots=slots, max_context=max(map(len, rows)) + config.max_new_tokens,
                          current_version=lambda: 0, pad_token_id=pad)  # fmt: skip
    try:
        # forward passes, prefills included (generate's too: the static count is each chunk's longest row)
        steps = (
            counted(engine, "_forward")
            if isinstance(engine, SlotRows)
            else counted(engine.manager, "_generation_step")
        )
        start = time.time()
        engine.submit([RolloutTask(j, j, p, 0) for j, p in enumerate(rows)])
        kept, returned, cache = 0, [], 0
        while engine.busy:
            lengths = [len(c) for g in engine.finished(0.5) for c in g.completion_ids]
            kept += sum(lengths)
            returned += [time.time() - start] * len(lengths)
            cache = max(cache, held_bytes(engine))
        wall = time.time() - start
        timeline = [(t - start, n) for t, n in engine.occupancy]
    finally:
        engine.close()
    return {"wall_s": wall, "tokens": kept, "tokens_per_s": kept / wall, "timeline": timeline, "steps": steps[0],
            "returned_s": returned, "kv_cache_bytes": cache}  # fmt: skip


def occupancy(spans, start) -> list[tuple[float, int]]:
    events = sorted([(s - start, 1) for s, _ in spans] + [(e - start, -1) for _, e in spans])
    out, n = [], 0
    for t, d in events:
        n += d
        out.append((t, n))
    return out


def value(r: dict, key: str):
    return r.get(key, "failed")


def ratio(r: dict, baseline: dict):
    return r["tokens_per_s"] / baseline["tokens_per_s"] if "error" not in r and "error" not in baseline else "failed"


def returned_stats(returned: list[float]) -> dict:
    """When rows came back: the mean and the 90th percentile of their seconds from the start."""
    ordered = sorted(returned)
    return {"returned_mean_s": sum(ordered) / len(ordered), "returned_p90_s": ordered[int(0.9 * (len(ordered) - 1))]}


def busy_share(timeline, slots, wall) -> float:
    """Slot time spent decoding kept tokens, over slots x wall time."""
    area = sum(n * (t1 - t0) for (t0, n), (t1, _) in zip(timeline, timeline[1:], strict=False))
    return area / (slots * wall)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--slots", type=int, nargs="*", default=[8, 16, 32])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", help="the model's dtype (default: float32 on a CPU, bfloat16 on a GPU)")
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (trl_async.demo.pretrained)")
    cli = parser.parse_args()
    dtype = getattr(torch, cli.dtype or ("float32" if cli.device == "cpu" else "bfloat16"))
    torch.set_num_threads(cli.threads)
    path = cli.model or smollm2_135m_instruct()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(cli.device).eval()
    model.generation_config.use_cache = True
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=cli.max_new_tokens,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=[tokenizer.eos_token_id])  # fmt: skip
    eos, rows = [tokenizer.eos_token_id], prompts(tokenizer, cli.prompts)
    results, cuda = [], cli.device.startswith("cuda")
    for slots in cli.slots:
        for mode in ("static", "slots", "paged"):  # paged last: it switches the model to paged attention
            torch.manual_seed(0)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                weights = torch.cuda.memory_allocated()
            try:
                if mode == "static":
                    r = run_static(model, config, eos, tokenizer.pad_token_id, rows, slots)
                else:
                    r = run_continuous(ENGINES[mode], model, config, eos, tokenizer.pad_token_id, rows, slots)
            except Exception as exc:  # noqa: BLE001 - one engine failing on a device still leaves the others' numbers
                traceback.print_exc()
                results.append({"mode": mode, "slots": slots, "error": f"{type(exc).__name__}: {exc}"})
                continue
            r.update(mode=mode, slots=slots, busy_share=busy_share(r["timeline"], slots, r["wall_s"]),
                     forward_ms=1000 * r["wall_s"] / r["steps"], **returned_stats(r.pop("returned_s")))  # fmt: skip
            if cuda:
                r["peak_memory_bytes"] = torch.cuda.max_memory_allocated() - weights
            print(f"{mode:10s} slots {slots:3d}: {r['tokens_per_s']:7.1f} tok/s, {r['wall_s']:6.1f} s, "
                  f"slots busy {r['busy_share']:.2f}, {r['forward_ms']:.1f} ms/forward, rows back at "
                  f"{r['returned_mean_s']:.1f} s (p90 {r['returned_p90_s']:.1f}), KV cache "
                  f"{r['kv_cache_bytes'] / 2**20:.1f} MiB", flush=True)  # fmt: skip
            results.append(r)
        # the paged engine switched the model to paged attention: reload for the next static run
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(cli.device).eval()
        model.generation_config.use_cache = True
    name = "continuous_batching" + ("" if cli.device == "cpu" else f"_{cli.device.split(':')[0]}")
    device = torch.cuda.get_device_name() if cli.device.startswith("cuda") else "cpu"
    report.write_json(name, {"device": device, "prompts": cli.prompts, "max_new_tokens": cli.max_new_tokens,
                             "threads": cli.threads, "dtype": str(dtype), "transformers": __import__("transformers").__version__,
                             "results": results})  # fmt: skip
    plot(results, report.png_path(name))
    rows_out = []
    for slots in cli.slots:
        static, loop, paged = (
            next(r for r in results if r["slots"] == slots and r["mode"] == m) for m in ("static", "slots", "paged")
        )
        rows_out.append([slots, *(value(r, "tokens_per_s") for r in (static, loop, paged)),
                         ratio(loop, static), ratio(paged, static),
                         *(value(r, "busy_share") for r in (static, loop, paged))])  # fmt: skip
    table = report.markdown_table(
        ["slots (rows)", "static tok/s", "slot loop tok/s", "paged tok/s", "slot loop / static", "paged / static",
         "static busy", "slot loop busy", "paged busy"],
        rows_out,
    )  # fmt: skip
    keys = ["tokens_per_s", "forward_ms", "returned_mean_s", "returned_p90_s", "kv_cache_mib"]
    keys += ["peak_memory_mib"] if cuda else []
    for r in results:
        for key in ("kv_cache", "peak_memory"):
            if f"{key}_bytes" in r:
                r[f"{key}_mib"] = r[f"{key}_bytes"] / 2**20
    costs = report.markdown_table(
        ["slots (rows)", "mode", "tok/s", "ms per forward", "rows back, mean s", "rows back, p90 s",
         "KV cache MiB"] + (["peak beyond weights MiB"] if cuda else []),
        [[r["slots"], r["mode"], *(value(r, key) for key in keys)] for r in results],
    )  # fmt: skip
    failed = "".join(f"\n\n{r['mode']} at {r['slots']} slots failed: `{r['error']}`" for r in results if "error" in r)
    command = "python benchmarks/continuous_batching.py" + ("" if cli.device == "cpu" else f" --device {cli.device}")
    report.update_readme(name, f"`{command}` (SmolLM2-135M-Instruct, {cli.prompts} arithmetic prompts, sampled "
                         f"at temperature 1, up to {cli.max_new_tokens} tokens, {device}, {str(dtype)[6:]}, {cli.threads} threads)\n\n"
                         f"{table}\n\nWhat the slots cost: wall time per forward pass (a decode step or a prefill), when rows come back (all "
                         "submitted at once), and the KV cache at its largest.\n\n"
                         f"{costs}{failed}\n\n![rows decoding over time](results/{name}.png)")  # fmt: skip


def plot(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slots = sorted({r["slots"] for r in results})
    fig, axes = plt.subplots(len(slots), 1, figsize=(8, 2.6 * len(slots)), squeeze=False)
    for ax, n in zip(axes[:, 0], slots, strict=True):
        for r in (r for r in results if r["slots"] == n and "error" not in r):
            t, k = zip(*r["timeline"], strict=True) if r["timeline"] else ((), ())
            ax.step(t, k, where="post", label=f"{r['mode']} ({r['tokens_per_s']:.0f} tok/s)")
        ax.set_title(f"{n} slots")
        ax.set_xlabel("seconds")
        ax.set_ylabel("rows decoding")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
