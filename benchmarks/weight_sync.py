"""Weight-sync cost: time and MB/s to move the full policy from a 2-process trainer (DDP, ZeRO-2, ZeRO-3) into the
rollout workers' shared memory, vs model size and bucket size, beside a raw ``torch.distributed.broadcast`` of the
same bytes between the same two processes (gloo, loopback), measured in the same run.

    python benchmarks/weight_sync.py            # 3 backends x {1M, 10M, 100M} params x 3 bucket sizes (~5 min)
    python benchmarks/weight_sync.py --quick    # 1M and 10M only

Also reports sync time as a fraction of a training step at the CPU demo's settings (from a short demo run).
Writes benchmarks/results/weight_sync.{json,png} and the table in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "recipes"))

SIZES = {"1M": (128, 4, 512), "10M": (384, 4, 1536), "100M": (1024, 6, 4096)}  # hidden, layers, intermediate
BUCKETS_MB = [2, 8, 64]
REPEATS = 3


def measure(out_path: str, sizes: list[str]) -> None:
    """Runs inside `accelerate launch` (2 processes)."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl.distributed import DistributedBackend

    from trl_async.weights.policy import iter_policy_buckets, policy_specs
    from trl_async.weights.shared_memory import SharedMemoryWeights

    torch.set_num_threads(1)
    ds_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if ds_file:  # no Trainer here to resolve DeepSpeed's "auto" batch sizes: pin them for 2 processes
        ds = json.loads(Path(ds_file).read_text())
        ds.update(train_micro_batch_size_per_gpu=1, train_batch_size=2, gradient_accumulation_steps=1)
        ds.update(gradient_clipping=1.0, bf16={"enabled": False}, fp16={"enabled": False})
        pinned = Path(tempfile.mkdtemp()) / "ds.json"
        pinned.write_text(json.dumps(ds))
        os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(pinned)
    accelerator = Accelerator(cpu=os.environ.get("WS_USE_CPU") == "1")
    backend = DistributedBackend(accelerator)
    rows = []
    for size in sizes:
        hidden, layers, inter = SIZES[size]
        config = Qwen2Config(vocab_size=512, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                             num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True)  # fmt: skip
        model = Qwen2ForCausalLM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = accelerator.prepare(model, optimizer)
        module = accelerator.unwrap_model(model)
        specs = policy_specs(module)
        nbytes = sum(
            torch.Size(shape).numel() * torch.empty(0, dtype=dt).element_size() for shape, dt in specs.values()
        )
        shared = (
            SharedMemoryWeights(specs, torch.multiprocessing.get_context("spawn"))
            if dist.get_rank() == 0  # the rank weight_sync streams full tensors to
            else None
        )
        for bucket_mb in BUCKETS_MB:
            times = []
            for i in range(REPEATS):
                dist.barrier()
                start = time.perf_counter()
                out = shared.spare_tensors if shared is not None else None
                buckets = iter_policy_buckets(module, backend.gather_params, bucket_mb * 2**20, backend.is_zero3, out)
                if shared is not None:
                    shared.publish(buckets, version=i)
                else:
                    for _ in buckets:
                        pass
                dist.barrier()
                times.append(time.perf_counter() - start)
            rows.append({"size": size, "bytes": nbytes, "bucket_mb": bucket_mb, "sync_s": statistics.median(times)})
        flat = torch.zeros(nbytes // 4, dtype=torch.float32)
        times = []
        for _ in range(REPEATS):
            dist.barrier()
            start = time.perf_counter()
            dist.broadcast(flat, src=0)
            dist.barrier()
            times.append(time.perf_counter() - start)
        for row in rows:
            if row["size"] == size:
                row["broadcast_s"] = statistics.median(times)
        del model, optimizer, module, shared
        accelerator.free_memory()
    if accelerator.is_main_process:
        Path(out_path).write_text(json.dumps({"zero_stage": backend.zero_stage, "rows": rows}))


def demo_step_fraction() -> dict:
    """Mean weight-sync time over mean step time in a short CPU demo run (single process, 1 worker)."""
    import tiny_demo

    from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl_async.demo.tiny import save_tiny_model

    work = tempfile.mkdtemp(prefix="ws_demo_")
    model_dir = str(save_tiny_model(os.path.join(work, "m"), chars=tiny_demo.VOCAB))
    settings = {**tiny_demo.DEMO_DEFAULTS, "output_dir": os.path.join(work, "o"), "max_steps": 60, "logging_steps": 1}
    trainer = AsyncGRPOTrainer(model=model_dir, reward_funcs=tiny_demo.spelling_reward,
                               args=AsyncGRPOConfig(**settings), train_dataset=tiny_demo.make_dataset())  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "step_time" in h][5:]  # skip start-up
    sync = statistics.fmean(h.get("async/weight_sync_s", 0.0) for h in logs)
    step = statistics.fmean(h["step_time"] for h in logs)
    return {"weight_sync_s": sync, "step_s": step, "fraction": sync / step}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true")
    cli = parser.parse_args()
    if cli.measure:
        measure(cli.measure, cli.sizes.split(","))
        return

    import report

    sizes = ["1M", "10M"] if cli.quick else list(SIZES)
    results = {}
    for name in ("ddp", "zero2", "zero3"):
        out = Path(tempfile.mkdtemp()) / f"{name}.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WS_USE_CPU": "1" if name == "ddp" else "0"}
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / f"recipes/accelerate/{name}.yaml"), str(Path(__file__).resolve()),
               "--measure", str(out), "--sizes", ",".join(sizes)]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, check=True, env=env, capture_output=True, text=True)
        results[name] = json.loads(out.read_text())["rows"]
        print(name, "done", flush=True)
    demo = demo_step_fraction()

    rows = []
    for name, measured in results.items():
        for r in measured:
            mb = r["bytes"] / 2**20
            rows.append([name, r["size"], round(mb, 1), r["bucket_mb"], r["sync_s"] * 1e3, mb / r["sync_s"],
                         mb / r["broadcast_s"], r["broadcast_s"] / r["sync_s"]])  # fmt: skip
    table = report.markdown_table(
        [
            "backend",
            "params",
            "MB",
            "bucket MB",
            "sync ms",
            "sync MB/s",
            "raw broadcast MB/s",
            "sync / broadcast speed",
        ],
        rows,
    )
    report.write_json("weight_sync", {"results": results, "demo": demo, "buckets_mb": BUCKETS_MB})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, measured in results.items():
        best = {}
        for r in measured:
            best[r["size"]] = max(best.get(r["size"], 0), r["bytes"] / 2**20 / r["sync_s"])
        ax.plot(list(best), list(best.values()), marker="o", label=f"{name} sync (best bucket)")
    raw = {r["size"]: r["bytes"] / 2**20 / r["broadcast_s"] for r in results["ddp"]}
    ax.plot(list(raw), list(raw.values()), "k--", marker="x", label="raw gloo broadcast")
    ax.set(xlabel="model size (params)", ylabel="MB/s", yscale="log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(report.png_path("weight_sync"), dpi=110)
    command = "python benchmarks/weight_sync.py" + (" --quick" if cli.quick else "")
    report.update_readme(
        "weight_sync",
        f"### Weight sync (`{command}`)\n\n2 processes on this CPU machine (gloo). 'sync' = all ranks stream the "
        "policy bucket by bucket (ZeRO-3: each rank sends rank 0 its shards of a bucket, which land directly in shared memory) and rank 0 copies it into the workers' shared "
        "memory; 'raw broadcast' = `torch.distributed.broadcast` of the same bytes from rank 0 to rank 1; last column "
        f"> 1 means the sync is faster than the raw broadcast. Median of {REPEATS}.\n\n{table}\n\n"
        f"At the CPU demo's settings a weight sync takes {demo['weight_sync_s'] * 1e3:.2f} ms, "
        f"{100 * demo['fraction']:.1f}% of a {demo['step_s'] * 1e3:.0f} ms training step.\n\n"
        "![](results/weight_sync.png)",
    )
    print(table)


if __name__ == "__main__":
    main()
