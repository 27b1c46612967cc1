"""Staleness sweep: how learning on the CPU demo task degrades with staleness, per off-policy correction.

max_staleness in {0, 1, 2, 4, 8} x off_policy_correction in {none, tis, decoupled} x seeds. Staleness is forced by
publishing weights only every ``max_staleness + 1`` steps (``weight_sync_steps``), so consumed samples really are
0..max_staleness steps old whatever the machine's speed; the measured mean staleness is reported. Learning rate is
higher than the demo's so that staleness matters within a short run.

    python benchmarks/staleness_sweep.py              # full sweep (~15 min on 2 cores)
    python benchmarks/staleness_sweep.py --quick      # 2 staleness values, 1 seed

Writes benchmarks/results/staleness_sweep.{json,png} and the table in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402
import tiny_demo  # noqa: E402
import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from trl_async.demo.tiny import save_tiny_model  # noqa: E402


class WallClock(TrainerCallback):
    def __init__(self):
        self.start = time.perf_counter()
        self.times = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.times.append(time.perf_counter() - self.start)


def run(model_dir: str, staleness: int, mode: str, seed: int, steps: int, lr: float, out: str) -> dict:
    settings = {**tiny_demo.DEMO_DEFAULTS, "output_dir": out, "max_steps": steps, "learning_rate": lr, "seed": seed}
    settings.update(logging_steps=5, max_staleness=staleness, weight_sync_steps=staleness + 1)
    args = AsyncGRPOConfig(**settings, off_policy_correction=mode)
    clock = WallClock()
    trainer = AsyncGRPOTrainer(
        model=model_dir,
        reward_funcs=tiny_demo.spelling_reward,
        args=args,
        train_dataset=tiny_demo.make_dataset(),
        callbacks=[clock],
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    tail = logs[-max(1, len(logs) // 4) :]
    mean = lambda key: statistics.fmean(h.get(key, float("nan")) for h in logs)  # noqa: E731
    return {
        "max_staleness": staleness,
        "mode": mode,
        "seed": seed,
        "final_reward": statistics.fmean(h["reward"] for h in tail),
        "mean_staleness": mean("async/staleness_mean"),
        "ess": mean("is/ess") if mode != "none" else None,
        "truncated_frac": mean("is/truncated_frac") if mode != "none" else None,
        "masked_frac": mean("is/masked_frac") if mode != "none" else None,
        "curve_steps": [h["step"] for h in logs],
        "curve_reward": [h["reward"] for h in logs],
        "curve_seconds": clock.times,
    }


def plot(results: list[dict], modes: list[str], staleness_values: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in modes:
        finals = [
            statistics.fmean(r["final_reward"] for r in results if r["mode"] == mode and r["max_staleness"] == s)
            for s in staleness_values
        ]
        ax1.plot(staleness_values, finals, marker="o", label=mode)
    ax1.set(xlabel="max_staleness (weights synced every max_staleness+1 steps)", ylabel="final reward (last 25%)")
    ax1.legend()
    worst = max(staleness_values)
    for mode in modes:
        for r in results:
            if r["mode"] == mode and r["max_staleness"] == worst and r["seed"] == results[0]["seed"]:
                ax2.plot(r["curve_seconds"], r["curve_reward"], label=f"{mode}, staleness<={worst}")
    for r in results:
        if r["max_staleness"] == 0 and r["mode"] == modes[-1] and r["seed"] == results[0]["seed"]:
            ax2.plot(r["curve_seconds"], r["curve_reward"], "k--", label="staleness 0")
    ax2.set(xlabel="wall-clock seconds", ylabel="reward (sampled)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (the published table: 3)")
    cli = parser.parse_args()
    torch.set_num_threads(1)
    staleness_values = [0, 4] if cli.quick else [0, 1, 2, 4, 8]
    modes = ["none", "tis", "decoupled"]
    seeds = range(1 if cli.quick else cli.seeds)
    work = tempfile.mkdtemp(prefix="staleness_sweep_")
    model_dir = str(save_tiny_model(os.path.join(work, "model"), chars=tiny_demo.VOCAB))
    results = []
    for seed in seeds:
        for staleness in staleness_values:
            for mode in modes:  # interleaved, so machine drift hits every mode alike
                r = run(model_dir, staleness, mode, seed, cli.steps, cli.lr, os.path.join(work, "out"))
                print(
                    f"staleness<={staleness} {mode:>9} seed {seed}: final reward {r['final_reward']:.3f}", flush=True
                )
                results.append(r)

    rows = []
    for staleness in staleness_values:
        for mode in modes:
            rs = [r for r in results if r["mode"] == mode and r["max_staleness"] == staleness]
            avg = lambda key, rs=rs: statistics.fmean(r[key] for r in rs) if rs[0][key] is not None else "-"  # noqa: E731
            finals = [r["final_reward"] for r in rs]
            spread = f"{min(finals):.3f}-{max(finals):.3f}"
            rows.append([staleness, mode, avg("mean_staleness"), avg("final_reward"), spread, avg("ess"),
                         avg("truncated_frac"), avg("masked_frac")])  # fmt: skip
    table = report.markdown_table(
        ["max_staleness", "correction", "mean staleness", "final reward", "range over seeds", "ESS", "truncated",
         "masked"], rows)  # fmt: skip
    meta = {"steps": cli.steps, "lr": cli.lr, "seeds": list(seeds), "task": "tiny_demo spelling"}
    report.write_json("staleness_sweep", {"settings": meta, "results": results})
    plot(results, modes, staleness_values, report.png_path("staleness_sweep"))
    options = [("--quick", cli.quick), (f"--seeds {cli.seeds}", cli.seeds != 3 and not cli.quick),
               (f"--steps {cli.steps}", cli.steps != 150), (f"--lr {cli.lr}", cli.lr != 3e-3)]  # fmt: skip
    command = " ".join(["python benchmarks/staleness_sweep.py", *(flag for flag, used in options if used)])
    report.update_readme(
        "staleness_sweep",
        f"### Staleness sweep (`{command}`)\n\n{cli.steps} steps, lr {cli.lr}, seeds {list(seeds)}; final reward = "
        f"mean sampled reward over the last quarter of training.\n\n{table}\n\n![](results/staleness_sweep.png)",
    )
    print(table)


if __name__ == "__main__":
    main()
