"""LoRA weight sync to a vLLM server, merged full weights vs each version as a named adapter: bytes and seconds per
sync, on the real model.

SmolLM2-135M-Instruct with LoRA rank 16 on the attention and MLP projections, the CPU demo's task and settings,
``AsyncGRPOTrainer`` with ``rollout_backend="vllm"`` against one CPU vLLM server (float32, eager, ``--enable-lora
--max-lora-rank 16 --max-loras 3``, niceness 19 on the same 2 cores, started once for both runs, outside the clock).
One run per way, same steps: ``rollout_lora_sync="merged"`` (every sync pauses the server and pushes the merged
model over gloo) and ``"adapters"`` (the base pushed once, then every version written as an adapter and loaded with
``/v1/load_lora_adapter``). Reported: the bytes each sync moves, the logged ``async/weight_sync_s`` and the step
time (first step left out: start-up, and for adapters the one-off base push).

    python benchmarks/vllm_lora_sync.py             # ~5 min on 2 cores

Writes benchmarks/results/vllm_lora_sync.{json,png} and its table in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run(mode: str, url: str, steps: int) -> dict:
    import torch
    from peft import LoraConfig

    from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl_async.demo.arithmetic import TRAINING_SETTINGS, correctness_reward, format_reward, make_split
    from trl_async.demo.pretrained import smollm2_135m_instruct
    from trl_async.weights.policy import policy_specs

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    work = tempfile.mkdtemp(prefix=f"vllm_lora_sync_{mode}_")
    args = AsyncGRPOConfig(**{**TRAINING_SETTINGS, "learning_rate": 1e-4}, output_dir=work, max_steps=steps,
                           logging_steps=1, bf16=False, use_cpu=True, report_to=[], save_strategy="no",
                           disable_tqdm=True, rollout_lora_sync=mode, rollout_backend="vllm", rollout_vllm_urls=[url],
                           vllm_server_timeout=120, rollout_heartbeat_timeout_s=600.0)  # fmt: skip
    trainer = AsyncGRPOTrainer(model=smollm2_135m_instruct(), reward_funcs=[correctness_reward, format_reward],
                               args=args, train_dataset=make_split("train", 128, seed=0),
                               peft_config=LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS))  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "step_time" in h][1:]  # first step: start-up (and the base)
    sync = [h["async/weight_sync_s"] for h in logs if "async/weight_sync_s" in h]
    backend = trainer.last_rollout_pool.backend
    model = trainer.accelerator.unwrap_model(trainer.model)
    size = lambda specs: sum(torch.Size(s).numel() * torch.empty(0, dtype=d).element_size() for s, d in specs.values())  # noqa: E731
    per_sync = size(policy_specs(model, persistent_only=True)) if mode == "merged" else None
    if mode == "adapters":  # what each version's adapter file holds: A and B of every adapted layer, float32
        adapters = policy_specs(model, part="adapters")
        per_sync = sum(size({n: s}) for n, s in adapters.items() if ".lora_" in n)
    result = {"adapter_sync": backend.adapter_sync, "pushes": backend.pusher.pushes, "bytes": per_sync,
              "weight_sync_s": statistics.fmean(sync), "step_s": statistics.fmean(h["step_time"] for h in logs),
              "steps": len(logs), "reward_last": logs[-1]["reward"]}  # fmt: skip
    result["fraction"] = result["weight_sync_s"] / result["step_s"]
    print(mode, result, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    cli = parser.parse_args()
    import report

    from tests.vllm_server import start_server
    from trl_async.demo.pretrained import smollm2_135m_instruct

    model_dir = str(smollm2_135m_instruct())
    log = Path(tempfile.gettempdir()) / "vllm_lora_sync_server.log"
    server = start_server(model_dir, log, niceness=19,
                          extra_flags=["--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "3",
                                       "--max-num-batched-tokens", "16384"],
                          extra_env={"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"})  # fmt: skip
    try:
        runs = {mode: run(mode, server.url, cli.steps) for mode in ("merged", "adapters")}
    finally:
        server.stop()
    assert runs["adapters"]["adapter_sync"] and runs["adapters"]["pushes"] == 1, runs["adapters"]
    ratio = runs["merged"]["bytes"] / runs["adapters"]["bytes"]
    report.write_json("vllm_lora_sync", {"rank": RANK, "targets": TARGETS, "runs": runs, "bytes_ratio": ratio})
    table = report.markdown_table(
        ["rollout_lora_sync", "steps", "MB per sync", "full pushes", "weight sync ms", "step s", "sync / step"],
        [[m, r["steps"], r["bytes"] / 2**20, r["pushes"], r["weight_sync_s"] * 1e3, r["step_s"],
          f"{100 * r['fraction']:.2f}%"] for m, r in runs.items()],
    )  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    modes = list(runs)
    axes[0].bar(modes, [runs[m]["bytes"] / 2**20 for m in modes])
    axes[1].bar(modes, [runs[m]["weight_sync_s"] * 1e3 for m in modes])
    for ax, ylabel in zip(axes, ("MB per sync", "ms per sync (logged async/weight_sync_s)"), strict=True):
        ax.set(ylabel=ylabel, yscale="log")
    fig.suptitle(f"SmolLM2-135M, LoRA r={RANK}, to a CPU vLLM server")
    fig.tight_layout()
    fig.savefig(report.png_path("vllm_lora_sync"), dpi=110)
    report.update_readme(
        "vllm_lora_sync",
        f"### LoRA weight sync to a vLLM server (`python benchmarks/vllm_lora_sync.py`)\n\nSmolLM2-135M-Instruct, "
        f"LoRA rank {RANK} on {', '.join(TARGETS)}, float32; one CPU vLLM server (`--enable-lora`) at niceness 19 on "
        f"the trainer's 2 cores; {cli.steps} steps each way, first step left out. Merged: every sync pauses the "
        "server and pushes the merged model over gloo. Adapters: the base pushed once, then each version written as "
        f"a peft adapter and loaded by name ({ratio:.1f}× fewer bytes per sync).\n\n{table}\n\n"
        "![](results/vllm_lora_sync.png)",
    )
    print(table)


if __name__ == "__main__":
    main()
