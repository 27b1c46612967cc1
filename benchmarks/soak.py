"""Soak: the CPU demo for 600+ optimizer steps with resources sampled every 10 steps. Memory of the trainer and the
workers should stay flat, the queue within its bound, open files and threads constant.

    python benchmarks/soak.py              # 600 steps (~1-2 min)
    python benchmarks/soak.py --steps 2000

Reports each series' slope (least squares over the steps after a 100-step warm-up): RSS in MB per 100 steps, open
file descriptors and threads per 100 steps. Writes benchmarks/results/soak.{json,png} and its section in
benchmarks/RESULTS.md. Reads /proc (Linux).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "recipes"))

from transformers import TrainerCallback  # noqa: E402

WARMUP_STEPS = 100


def _status(pid: int) -> dict[str, int]:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "Threads"):
                fields[key] = int(value.split()[0])
    fields["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return fields


class Sampler(TrainerCallback):
    def __init__(self, trainer, every: int = 10) -> None:
        self.trainer, self.every, self.samples = trainer, every, []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every:
            return
        pool = self.trainer.rollout_pool
        me = _status(os.getpid())
        workers = [_status(p.pid) for p in (lane.process for lane in pool.current_lanes) if p.is_alive()]
        self.samples.append(
            {
                "step": state.global_step,
                "time": time.time(),
                "trainer_rss_mb": me["VmRSS"] / 1024,
                "workers_rss_mb": sum(w["VmRSS"] for w in workers) / 1024,
                "trainer_fds": me["fds"],
                "workers_fds": sum(w["fds"] for w in workers),
                "trainer_threads": me["Threads"],
                "queue": pool.ready_count,
                "in_flight": pool.in_flight,
                "queue_bound": pool.settings.queue_size,
            }
        )


def slope_per_100(samples: list[dict], key: str) -> float:
    points = [(s["step"], s[key]) for s in samples if s["step"] > WARMUP_STEPS]
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return 100 * sum((x - mx) * (y - my) for x, y in points) / sxx


def main() -> None:
    import matplotlib
    import report
    import tiny_demo

    from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl_async.demo.tiny import save_tiny_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)
    cli = parser.parse_args()
    work = tempfile.mkdtemp(prefix="soak_")
    model_dir = str(save_tiny_model(os.path.join(work, "m"), hidden_size=64, num_layers=2, chars=tiny_demo.VOCAB))
    settings = {**tiny_demo.DEMO_DEFAULTS, "output_dir": os.path.join(work, "o"), "max_steps": cli.steps,
                "logging_steps": 50, "disable_tqdm": True}  # fmt: skip
    trainer = AsyncGRPOTrainer(model=model_dir, reward_funcs=tiny_demo.spelling_reward,
                               args=AsyncGRPOConfig(**settings), train_dataset=tiny_demo.make_dataset())  # fmt: skip
    sampler = Sampler(trainer)
    trainer.add_callback(sampler)
    start = time.time()
    trainer.train()
    samples = sampler.samples
    keys = ["trainer_rss_mb", "workers_rss_mb", "trainer_fds", "workers_fds", "trainer_threads"]
    slopes = {k: slope_per_100(samples, k) for k in keys}
    max_in_flight = max(s["in_flight"] for s in samples)
    bound = samples[0]["queue_bound"]
    report.write_json("soak", {"steps": cli.steps, "seconds": time.time() - start, "slopes_per_100_steps": slopes,
                               "max_in_flight": max_in_flight, "queue_bound": bound, "samples": samples})  # fmt: skip

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    steps = [s["step"] for s in samples]
    a1.plot(steps, [s["trainer_rss_mb"] for s in samples], label="trainer RSS")
    a1.plot(steps, [s["workers_rss_mb"] for s in samples], label="worker RSS")
    a1.set(xlabel="optimizer step", ylabel="MB", title="memory")
    a1.legend(fontsize=8)
    a2.plot(steps, [s["in_flight"] for s in samples], label="admitted, not consumed")
    a2.plot(steps, [s["trainer_fds"] for s in samples], label="trainer open files")
    a2.plot(steps, [s["trainer_threads"] for s in samples], label="trainer threads")
    a2.axhline(bound, color="k", ls="--", lw=1, label="queue bound")
    a2.set(xlabel="optimizer step", title="queue, files, threads")
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(report.png_path("soak"), dpi=110)
    first, last = samples[0], samples[-1]
    table = report.markdown_table(
        ["series", f"at step {first['step']}", f"at step {last['step']}", "slope per 100 steps (after warm-up)"],
        [[k, first[k], last[k], slopes[k]] for k in keys],
    )
    report.update_readme(
        "soak",
        f"### Soak (`python benchmarks/soak.py --steps {cli.steps}`)\n\nThe CPU demo for {cli.steps} steps, "
        f"sampled every 10 steps. Groups admitted but not consumed peaked at {max_in_flight} (bound "
        f"{bound}).\n\n{table}\n\n![](results/soak.png)",
    )
    print(table)
    print(f"max in flight {max_in_flight} / bound {bound}")


if __name__ == "__main__":
    main()
