"""Where a transformers rollout worker's start and its first steps spend their time, on one GPU: a profile.

AsyncGRPOTrainer with one transformers worker on the trainer's device (SmolLM2-135M-Instruct on the arithmetic
problems, bf16 on a GPU, 16 completions of up to 64 tokens per step, 6 steps, max_staleness 1). Every process of the
run (the trainer and the worker it spawns) profiles its main thread with cProfile for its first ``--profile_s``
seconds, through a ``sitecustomize`` placed on the path of this run only: nothing in the library changes. Reported:
each step's time and the trainer's wait for rollouts (``async/trainer_wait_s``), and per process the functions with
the most cumulative time, the library's own (``trl_async``) apart, so that what is ours can be told from what is
torch's, CUDA's or transformers'.

    python benchmarks/worker_start.py --device cuda        # results/worker_start.json ($BENCH_RESULTS_DIR instead)
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

HOOK = """
import atexit, cProfile, os, threading
_dir = os.environ.get("WORKER_START_PROFILE")
if _dir:
    _profile = cProfile.Profile()
    _profile.enable()
    def _dump():
        _profile.disable()
        _profile.dump_stats(os.path.join(_dir, f"{os.getpid()}.prof"))
    _timer = threading.Timer(float(os.environ.get("WORKER_START_PROFILE_S", "60")), _dump)
    _timer.daemon = True
    _timer.start()
    atexit.register(lambda: _timer.cancel() or _dump())
"""


def train(cli) -> None:
    """The run itself (in a process of its own, profiled)."""
    import torch
    from transformers import TrainerCallback

    from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl_async.demo.arithmetic import correctness_reward, format_reward, make_split

    steps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append(time.time())

    cuda = cli.device == "cuda"
    args = AsyncGRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=16, num_generations=8,
                           max_completion_length=64 if cuda else 8, learning_rate=1e-6, logging_steps=1, report_to=[],
                           save_strategy="no", max_steps=cli.steps, beta=0.0, max_staleness=1, bf16=cuda,
                           use_cpu=not cuda, rollout_backend="transformers",
                           rollout_device="cuda:0" if cuda else "cpu", disable_tqdm=True)  # fmt: skip
    began = time.time()
    trainer = AsyncGRPOTrainer(model=cli.model, reward_funcs=[correctness_reward, format_reward], args=args,
                               train_dataset=make_split("train", 256, seed=0), callbacks=[Clock()])  # fmt: skip
    built = time.time()
    trainer.train()
    waits = [h.get("async/trainer_wait_s") for h in trainer.state.log_history if "loss" in h]
    marks = [built, *steps]
    Path(cli.out).write_text(json.dumps({
        "build_s": round(built - began, 2),
        "step_s": [round(b - a, 3) for a, b in zip(marks, marks[1:], strict=False)],
        "trainer_wait_s": waits,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }))  # fmt: skip


def top(path: Path, n: int = 25) -> dict:
    """The ``n`` functions of a profile with the most cumulative time, and the library's own apart."""
    stats = pstats.Stats(str(path))
    rows = []
    for (file, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        rows.append({"function": f"{Path(file).name}:{line}({name})", "file": file, "calls": calls,
                     "own_s": round(own, 3), "cumulative_s": round(cumulative, 3)})  # fmt: skip
    rows.sort(key=lambda r: -r["cumulative_s"])
    ours = [r for r in rows if "trl_async" in r["file"]]
    return {"total_s": round(stats.total_tt, 2), "top": rows[:n], "trl_async_top": ours[:n]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (trl_async.demo.pretrained)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--profile_s", type=float, default=60)
    parser.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.train:
        train(cli)
        return
    if cli.model is None:
        from trl_async.demo.pretrained import smollm2_135m_instruct

        cli.model = smollm2_135m_instruct()
    work = Path(tempfile.mkdtemp(prefix="worker_start_"))
    (work / "hook").mkdir()
    (work / "hook" / "sitecustomize.py").write_text(HOOK)
    (work / "prof").mkdir()
    path = os.pathsep.join([str(work / "hook"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "WORKER_START_PROFILE": str(work / "prof"),
           "WORKER_START_PROFILE_S": str(cli.profile_s)}  # fmt: skip
    out = work / "run.json"
    command = [sys.executable, __file__, "--train", "--out", str(out), "--model", cli.model, "--device", cli.device,
               "--steps", str(cli.steps)]  # fmt: skip
    done = subprocess.run(command, env=env, check=False)
    result = json.loads(out.read_text()) if out.exists() else {"error": f"exit status {done.returncode}"}
    result["profiles"] = {p.stem: top(p) for p in sorted((work / "prof").glob("*.prof"))}
    results = Path(os.environ.get("BENCH_RESULTS_DIR") or HERE / "results")
    results.mkdir(parents=True, exist_ok=True)
    (results / "worker_start.json").write_text(json.dumps({"steps": cli.steps, **result}, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "profiles"}, indent=1))
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
