"""LoRA weight sync, merged full weights vs adapter-only (``rollout_lora_sync``): bytes and seconds per sync.

Per model size, in one process, both ways side by side on the same peft model (rank 16 on the attention and MLP
projections, float32):
- trainer side: one publish into the workers' shared memory (``iter_policy_buckets`` + ``SharedMemoryWeights``), as
  ``_publish_weights`` does every sync: the merged full model, or the adapter factors and their scales;
- worker side: adopting the version, as a worker does between generate calls: copying the full set into its model,
  or copying the factors and merging them (``merge_adapters``) into its model.
Then on the real model (SmolLM2-135M-Instruct, the arithmetic task), a short ``AsyncGRPOTrainer`` run per way: the
logged weight-sync seconds against the step time.

    python benchmarks/lora_sync.py            # SmolLM2-135M and a 0.5B synthetic Qwen2, then the real-model runs
    python benchmarks/lora_sync.py --quick    # SmolLM2-135M only, no real-model runs

Writes benchmarks/results/lora_sync.{json,png} and the table in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SYNTHETIC = dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True)  # fmt: skip
REPEATS = 5


def _nbytes(specs) -> int:
    import torch

    return sum(torch.Size(s).numel() * torch.empty(0, dtype=d).element_size() for s, d in specs.values())


def transport(name: str, base_model) -> dict:
    """Trainer-side publish and worker-side adoption, merged vs adapters, median of ``REPEATS``."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    from trl_async.weights.lora import adapter_tensors
    from trl_async.weights.lora_merge import merge_adapters
    from trl_async.weights.policy import iter_policy_buckets, policy_specs
    from trl_async.weights.shared_memory import SharedMemoryWeights

    worker_model = copy.deepcopy(base_model).eval()  # a worker's plain copy
    model = get_peft_model(base_model, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS,
                                                  init_lora_weights=False))  # fmt: skip
    ctx = torch.multiprocessing.get_context("spawn")
    named = dict(worker_model.named_parameters())
    named.update(worker_model.named_buffers())
    row = {"model": name, "params": sum(p.numel() for p in base_model.parameters())}
    for part in ("full", "adapters"):
        specs = policy_specs(model, part=part)
        shared = SharedMemoryWeights(specs, ctx)
        publish, adopt = [], []
        if part == "adapters":
            _, _, merges = adapter_tensors(model)
            frozen = {m.weight: named[m.weight].detach().clone() for m in merges}  # a worker reads the shared base
            factors = {n: torch.empty_like(t) for n, t in shared.buffers[0].items()}
            targets = {m.weight: named[m.weight] for m in merges}
        for i in range(REPEATS):
            start = time.perf_counter()
            shared.publish(iter_policy_buckets(model, lambda params: contextlib.nullcontext(), 8 * 2**20, out=shared.spare_tensors, part=part), i)
            publish.append(time.perf_counter() - start)
            start = time.perf_counter()
            if part == "full":
                shared.pull_into({n: named[n] for n in shared.tensors}, i - 1)
            else:
                shared.pull_into(factors, i - 1)
                merge_adapters(merges, frozen, factors, targets)
            adopt.append(time.perf_counter() - start)
        row[part] = {"bytes": _nbytes(specs), "publish_s": statistics.median(publish),
                     "adopt_s": statistics.median(adopt)}  # fmt: skip
        del shared
    row["bytes_ratio"] = row["full"]["bytes"] / row["adapters"]["bytes"]
    return row


def real_model_runs(steps: int) -> dict:
    """AsyncGRPOTrainer with LoRA on SmolLM2-135M-Instruct, each way: logged sync seconds against step seconds."""
    from peft import LoraConfig

    from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl_async.demo.arithmetic import TRAINING_SETTINGS, correctness_reward, format_reward, make_split
    from trl_async.demo.pretrained import smollm2_135m_instruct
    from trl_async.hardware.precision import recipe_precision

    results = {}
    for mode in ("merged", "adapters"):
        work = tempfile.mkdtemp(prefix=f"lora_sync_{mode}_")
        args = AsyncGRPOConfig(**{**TRAINING_SETTINGS, "learning_rate": 1e-4}, output_dir=work, max_steps=steps, logging_steps=1,
                               bf16=recipe_precision("cpu")[0], use_cpu=True, report_to=[], save_strategy="no",
                               disable_tqdm=True, rollout_lora_sync=mode)  # fmt: skip
        trainer = AsyncGRPOTrainer(model=smollm2_135m_instruct(), reward_funcs=[correctness_reward, format_reward],
                                   args=args, train_dataset=make_split("train", 128, seed=0),
                                   peft_config=LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS))  # fmt: skip
        trainer.train()
        logs = [h for h in trainer.state.log_history if "step_time" in h][1:]  # first step: start-up
        sync = [h["async/weight_sync_s"] for h in logs if "async/weight_sync_s" in h]
        results[mode] = {"weight_sync_s": statistics.fmean(sync), "step_s": statistics.fmean(h["step_time"] for h in logs),
                         "steps": len(logs)}  # fmt: skip
        results[mode]["fraction"] = results[mode]["weight_sync_s"] / results[mode]["step_s"]
        print(mode, results[mode], flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    cli = parser.parse_args()
    import report
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from trl_async.demo.pretrained import smollm2_135m_instruct

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    rows = [transport("SmolLM2-135M", AutoModelForCausalLM.from_pretrained(smollm2_135m_instruct()))]
    print(rows[-1], flush=True)
    if not cli.quick:
        torch.manual_seed(0)
        rows.append(transport("Qwen2 0.5B (synthetic)", Qwen2ForCausalLM(Qwen2Config(**SYNTHETIC))))
        print(rows[-1], flush=True)
    runs = {} if cli.quick else real_model_runs(cli.steps)
    table = report.markdown_table(
        ["model", "params", "merged MB", "adapters MB", "× fewer bytes", "publish ms merged", "publish ms adapters",
         "worker adopt ms merged", "worker adopt ms adapters (copy + merge)"],
        [[r["model"], f"{r['params'] / 1e6:.0f}M", r["full"]["bytes"] / 2**20, r["adapters"]["bytes"] / 2**20,
          r["bytes_ratio"], r["full"]["publish_s"] * 1e3, r["adapters"]["publish_s"] * 1e3,
          r["full"]["adopt_s"] * 1e3, r["adapters"]["adopt_s"] * 1e3] for r in rows],
    )  # fmt: skip
    run_table = report.markdown_table(
        ["rollout_lora_sync", "steps", "weight sync ms", "step s", "sync / step"],
        [[m, r["steps"], r["weight_sync_s"] * 1e3, r["step_s"], f"{100 * r['fraction']:.2f}%"] for m, r in runs.items()],
    )  # fmt: skip
    report.write_json("lora_sync", {"rank": RANK, "targets": TARGETS, "rows": rows, "runs": runs})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(rows))
    for offset, part, label in ((-0.2, "full", "merged"), (0.2, "adapters", "adapters")):
        axes[0].bar([i + offset for i in x], [r[part]["bytes"] / 2**20 for r in rows], width=0.4, label=label)
        axes[1].bar([i + offset for i in x], [(r[part]["publish_s"] + r[part]["adopt_s"]) * 1e3 for r in rows],
                    width=0.4, label=label)  # fmt: skip
    for ax, ylabel in zip(axes, ("MB per sync", "ms per sync (publish + worker adopt)"), strict=True):
        ax.set_xticks(list(x), [r["model"] for r in rows])
        ax.set(ylabel=ylabel, yscale="log")
        ax.legend()
    fig.suptitle(f"LoRA r={RANK} on attention + MLP projections, float32")
    fig.tight_layout()
    fig.savefig(report.png_path("lora_sync"), dpi=110)
    command = "python benchmarks/lora_sync.py" + (" --quick" if cli.quick else "")
    runs_text = (f"\n\nOn the real model, {cli.steps} steps of `AsyncGRPOTrainer` each way (the CPU demo's task and "
                 f"settings, LoRA r={RANK}, first step left out):\n\n{run_table}" if runs else "")  # fmt: skip
    report.update_readme(
        "lora_sync",
        f"### LoRA weight sync (`{command}`)\n\nOne process, LoRA rank {RANK} on {', '.join(TARGETS)}, float32; "
        "'publish' = the trainer streaming one version into the workers' shared memory, 'worker adopt' = a worker "
        "taking it into its model (merged: copying the full set; adapters: copying the factors and merging them "
        f"into the adapted weights). Median of {REPEATS}.\n\n{table}{runs_text}\n\n![](results/lora_sync.png)",
    )
    print(table)
    print(run_table)


if __name__ == "__main__":
    main()
