"""Sandboxed code rewards: what a sandbox costs per call, and whether async keeps its lead when the reward runs code.

Part 1, per-call cost of a trivial program (``pass``), interleaved, ``--calls`` each: a bare ``subprocess.run`` of
the same interpreter (no isolation: what a reward that shells out does today), the sandbox at ``rlimits``, and at
``namespaces``.

Part 2, the slow-verifier regime of ``throughput.py`` (its model: hidden 256, 4 layers; 32 completions of up to 32
tokens per step, groups of 8), with a code-execution reward as the slow part: every completion runs a program whose
tests take ``--test_ms`` (sleeping, as tests waiting on I/O do; 20 and 200 ms by default), through ``CodeExecutionReward``, 2 at once. Runs,
interleaved, equal steps: GRPOTrainer (1 and 2 torch threads) and AsyncGRPOTrainer (max_staleness 1 and 2), each
with the reward sandboxed (namespaces) and unsandboxed (the same harness in a bare subprocess). The tiny model writes
no code, so each completion stands for the same program; its reward is that program's pass rate times the vowel
share of the completion, so that groups still differ.

    python benchmarks/sandbox_reward.py            # ~12 min on 2 cores
Writes results/sandbox_reward.{json,png} and its table in RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import report  # noqa: E402
from throughput import REGIMES, dataset, make_model, run_one  # noqa: E402

from trl_async.sandbox import Limits, Sandbox, SandboxResult  # noqa: E402
from trl_async.sandbox.rewards import CodeExecutionReward  # noqa: E402


class Unsandboxed:
    """The sandbox's ``run_python`` without any isolation: ``python main.py`` in a temporary folder."""

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self.python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))

    def run_python(self, source, *, files=None, stdin="", limits=None) -> SandboxResult:
        folder = tempfile.mkdtemp(prefix="unsandboxed_")
        try:
            for name, text in {**(files or {}), "main.py": source}.items():
                Path(folder, name).write_bytes(text if isinstance(text, bytes) else text.encode())
            start = time.monotonic()
            done = subprocess.run([self.python, "-I", "-S", "main.py"], cwd=folder, input=stdin, text=True,
                                  capture_output=True, timeout=limits.wall_s if limits else 10)  # fmt: skip
            return SandboxResult(exit_code=done.returncode, signal=None, stdout=done.stdout, stderr=done.stderr,
                                 limits=(), seconds=time.monotonic() - start, isolation="none")  # fmt: skip
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def per_call_ms(calls: int) -> dict[str, list[float]]:
    python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    sandboxes = {isolation: Sandbox(isolation=isolation) for isolation in ("rlimits", "namespaces")}
    runners = {
        "bare subprocess": lambda: subprocess.run([python, "-I", "-S", "-c", "pass"], check=True),
        "sandbox, rlimits": lambda: sandboxes["rlimits"].run_python("pass"),
        "sandbox, namespaces": lambda: sandboxes["namespaces"].run_python("pass"),
    }
    for run in runners.values():  # warm: page cache, the namespace probe, each sandbox's zygote
        run()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(calls):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1000)
    return times


def code_reward(runner, test_ms: int):
    reward = CodeExecutionReward(sandbox=runner, limits=Limits(wall_s=10))
    program = "```python\ndef check(x):\n    import time\n    time.sleep(x)\n    return True\n```"
    tests = [f"assert check({test_ms / 1000 / 2})"] * 2

    def code_execution(completions, **kwargs):
        passed = reward([program] * len(completions), tests=[tests] * len(completions))
        return [p * sum(ch in "aeiou" for ch in c) / max(len(c), 1) for p, c in zip(passed, completions, strict=True)]

    return code_execution


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--test_ms", type=int, nargs="+", default=[20, 200])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    cli = parser.parse_args()
    overhead = per_call_ms(cli.calls)
    median = {name: statistics.median(v) for name, v in overhead.items()}
    print({k: round(v, 1) for k, v in median.items()}, flush=True)

    regime = next(r for r in REGIMES if r.name == "slow_reward")
    model_dir = make_model(regime, tempfile.mkdtemp(prefix="sandbox_bench_"))
    task_settings = dict(per_device_train_batch_size=32, num_generations=8, max_completion_length=regime.completion,
                         temperature=1.0, learning_rate=1e-5, beta=0.0, bf16=False, use_cpu=True, report_to=[],
                         save_strategy="no", gradient_checkpointing=False)  # fmt: skip
    runners = {"sandboxed": Sandbox(isolation="namespaces", concurrency=2), "unsandboxed": Unsandboxed(2)}
    configs = [("sync", 1, 0), ("sync", 2, 0), ("async", 1, 1), ("async", 1, 2)]
    rows = []
    for test_ms in cli.test_ms:
        for kind, threads, staleness in configs:
            for name, runner in runners.items():
                task = {"reward": code_reward(runner, test_ms), "dataset": dataset(), "settings": task_settings}
                row = run_one(regime, model_dir, kind, cli.steps, cli.warmup, threads=threads, staleness=staleness,
                              task=task)  # fmt: skip
                keep = ("kind", "threads", "staleness", "wall_s", "tokens_per_s", "samples_per_s",
                        "trained_mean_length")  # fmt: skip
                rows.append({"test_ms": test_ms, "reward": name, **{k: row[k] for k in keep}})
                print(rows[-1], flush=True)
    best_sync = {(r["test_ms"], r["reward"]): max(x["tokens_per_s"] for x in rows if x["kind"] == "sync" and
                 x["reward"] == r["reward"] and x["test_ms"] == r["test_ms"]) for r in rows}  # fmt: skip
    table_rows = []
    for r in rows:
        config = (
            f"GRPOTrainer, {r['threads']} thread(s)" if r["kind"] == "sync" else f"async, staleness {r['staleness']}"
        )
        table_rows.append([r["test_ms"], config, r["reward"], r["tokens_per_s"],
                           r["tokens_per_s"] / best_sync[(r["test_ms"], r["reward"])],
                           r["tokens_per_s"] / best_sync[(r["test_ms"], "sandboxed")]])  # fmt: skip
    table = report.markdown_table(["tests (ms)", "run", "reward", "tokens/s", "× best GRPOTrainer (same reward)",
                                   "× best GRPOTrainer (sandboxed)"], table_rows)  # fmt: skip
    overhead_table = report.markdown_table(
        ["trivial program (`pass`)", "ms per call (median)", "over a bare subprocess (ms)"],
        [[name, m, m - median["bare subprocess"]] for name, m in median.items()],
    )
    report.write_json("sandbox_reward", {"settings": vars(cli), "per_call_ms": overhead, "median_ms": median,
                                         "runs": rows})  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 6))
    a.boxplot(list(overhead.values()), tick_labels=list(overhead), vert=False)
    a.set(xlabel="ms per trivial program", title="per-call cost")
    labels = [f"{r['test_ms']} ms: {r['kind']} t{r['threads']} s{r['staleness']} {r['reward']}" for r in rows]
    b.barh(
        labels, [r["tokens_per_s"] for r in rows], color=["C0" if r["reward"] == "sandboxed" else "C1" for r in rows]
    )
    b.set(xlabel="completion tokens/s", title="slow verifier: tests of N ms per completion")
    fig.tight_layout()
    fig.savefig(report.png_path("sandbox_reward"), dpi=110)
    report.update_readme(
        "sandbox_reward",
        "### Sandboxed code rewards (`python benchmarks/sandbox_reward.py`)\n\n"
        f"Per-call cost of a trivial program, median of {cli.calls} interleaved calls each:\n\n{overhead_table}\n\n"
        "The slow-verifier regime of `throughput.py` with a code-execution reward: each completion runs a program "
        f"whose tests take {' or '.join(map(str, cli.test_ms))} ms (sleeping), 2 programs at once, sandboxed or in a "
        f"bare subprocess; {cli.steps} measured steps after {cli.warmup} of warm-up, 32 completions per step.\n\n"
        f"{table}\n\n"
        "Where the time goes: a sandbox keeps one zygote process, which forks each run's launcher into fresh "
        "namespaces and mounts its root; `run_python` then runs the program in a fork of that already-started "
        "interpreter, so a sandboxed program skips the Python start that the bare subprocess pays, and costs about "
        "what the namespaces and mounts cost more. A root trainer's `rlimits` runs execute the system Python as a "
        "uid of their own (the base installation is private here), so they pay the start. With 2 programs at once "
        "on both sides, the reward's throughput caps sync and async alike once the tests are long; async gains only "
        "what it overlaps.\n\n"
        "![](results/sandbox_reward.png)",
    )
    print(overhead_table)
    print(table)


if __name__ == "__main__":
    main()
