"""Time to accuracy on a real model: held-out greedy accuracy against wall-clock seconds, sync vs async.

SmolLM2-135M-Instruct (``trl_async.demo.pretrained``) on the arithmetic word problems (``trl_async.demo.arithmetic``): every
configuration trains the same number of steps on the same prompts (train split seeded by the run's seed) and is
measured on the same held-out problems (other templates), greedy, every ``--eval_every`` steps and before training.
Each run is its own process, launched fresh (start-up included in the clock: model load, worker start), and runs are
interleaved (seed 0: A B C ..., seed 1: A B C ...) so that machine drift hits every configuration alike.

The clock excludes the held-out evaluations themselves (identical work on both sides), and the async workers are
paused (SIGSTOP) while the trainer evaluates, so they cannot use those seconds to generate ahead.

    python benchmarks/time_to_accuracy.py                              # every configuration, 3 seeds
    python benchmarks/time_to_accuracy.py --configs sync async --seeds 0 --steps 6 --eval_every 0   # step times only

Writes benchmarks/results/<name>.{json,png} and the table in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trl_async.demo.arithmetic import TRAINING_SETTINGS
from trl_async.hardware.precision import described_precision, recipe_precision

HERE = Path(__file__).resolve().parent

# name -> (environment of the run's process, trainer threads, trainer kind, config overrides)
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}
CONFIGS: dict[str, dict] = {
    # TRL's GRPOTrainer with its defaults (gradient checkpointing), in the precision this CPU computes fast (TASK's
    # bf16: autocast where bf16 is native, float32 where it is emulated): its best configuration on 2 cores
    # (measured, benchmarks/RESULTS.md: 1 thread and 2-process DDP are slower).
    # OpenMP threads: sync alone on the cores is fastest with spinning threads (OMP_WAIT_POLICY unset, i.e. ACTIVE:
    # 1.13x PASSIVE over 3 seeds on the AMX Xeon, table omp_settle); async with PASSIVE (its workers need the idle
    # moments)
    "sync": dict(kind="sync", threads=2, env={}),
    "sync_passive": dict(kind="sync", threads=2, env=PASSIVE),
    "sync_fp32": dict(kind="sync", threads=2, env={}, train=dict(bf16=False, gradient_checkpointing=False)),
    "sync_fp32_gc": dict(kind="sync", threads=2, env={}, train=dict(bf16=False)),
    "sync_bf16": dict(kind="sync", threads=2, env={}, train=dict(bf16=True)),  # forced, even where emulated
    "sync_nogc": dict(kind="sync", threads=2, env={}, train=dict(gradient_checkpointing=False)),
    "sync_1thread": dict(kind="sync", threads=1, env=PASSIVE),
    # 2-process DDP under `accelerate launch` (gloo, 1 thread each): each rank generates and trains on half the batch
    "sync_ddp": dict(kind="sync", threads=1, processes=2, env=PASSIVE, train=dict(ddp_backend="gloo")),
    # AsyncGRPOTrainer with its defaults (trainer all cores, workers at nice 19 with all cores, workers in the
    # trainer's compute dtype where it is native)
    "async": dict(kind="async", threads=2, env=PASSIVE),
    # how the cores are split
    "async_active": dict(kind="async", threads=2, env={}),
    "async_1+1": dict(kind="async", threads=1, env={}, overrides=dict(rollout_torch_threads=1, rollout_nice=0)),
    "async_2+1": dict(kind="async", threads=2, env=PASSIVE, overrides=dict(rollout_torch_threads=1)),
    "async_nice0": dict(kind="async", threads=2, env=PASSIVE, overrides=dict(rollout_nice=0)),
    "async_nice0_active": dict(kind="async", threads=2, env={}, overrides=dict(rollout_nice=0)),
    "async_fp32_workers": dict(kind="async", threads=2, env=PASSIVE, overrides=dict(rollout_dtype="float32")),
    # staleness and workers
    "async_s2": dict(kind="async", threads=2, env=PASSIVE, overrides=dict(max_staleness=2)),
    "async_s4": dict(kind="async", threads=2, env=PASSIVE, overrides=dict(max_staleness=4)),
    "async_2w": dict(kind="async", threads=2, env=PASSIVE, overrides=dict(num_rollout_workers=2)),
    # a vLLM CPU server (float32, eager) on the same 2 cores at niceness 19, started once before its runs (its ~40 s
    # start-up is not in the clock: a server outlives training runs), weights pushed over gloo after every step
    "async_vllm": dict(kind="async", threads=2, env=PASSIVE, overrides=dict(rollout_backend="vllm"), vllm="shared"),
    # which ready group trains next: a vLLM lane sends one request per group, so groups come back in the
    # order their completions end (short first); arrival order (the default) against strict admission order
    "async_vllm_s2": dict(kind="async", threads=2, env=PASSIVE, vllm="shared",
                          overrides=dict(rollout_backend="vllm", max_staleness=2)),  # fmt: skip
    "async_vllm_s2_w1": dict(kind="async", threads=2, env=PASSIVE, vllm="shared",
                             overrides=dict(rollout_backend="vllm", max_staleness=2, rollout_consumption_window=1)),  # fmt: skip
    # A dedicated generation device, emulated with a core each: generation on core 1, training on core 0
    # (rollout_cpu_affinity pins the workers to core 1 and the trainer process to the rest). ded_sync is the same
    # pipeline at max_staleness=0: generate, then train, then sync, i.e. GRPOTrainer's server-mode schedule
    # (`trl vllm-serve` on its own GPU), each side waiting for the other. Its generation wait and training time are
    # the G and T of the bound (G+T)/max(G,T).
    "ded_sync": dict(kind="async", threads=1, env={}, overrides=dict(rollout_cpu_affinity="1", max_staleness=0)),
    "ded_async_s1": dict(kind="async", threads=1, env={}, overrides=dict(rollout_cpu_affinity="1", max_staleness=1)),
    "ded_async_s2": dict(kind="async", threads=1, env={}, overrides=dict(rollout_cpu_affinity="1", max_staleness=2)),
    # the vLLM CPU server pinned to core 1 (taskset and VLLM_CPU_OMP_THREADS_BIND, 1 OpenMP thread, niceness 0),
    # started once before its runs; the trainer keeps core 0
    "ded_vllm_s1": dict(kind="async", threads=1, env={}, vllm="dedicated",
                        overrides=dict(rollout_backend="vllm", rollout_cpu_affinity="1", max_staleness=1)),  # fmt: skip
    # what a user without a generation device has: TRL's GRPOTrainer alone on the training core
    "ded_grpo_1core": dict(kind="sync", threads=1, env={}, cores=[0]),
    # dynamic sampling: groups whose rewards are all equal are dropped before they take a batch slot and
    # new prompts are generated in their place; GRPOTrainer has no such option
    "async_ds": dict(kind="async", threads=2, env=PASSIVE, overrides=dict(dynamic_sampling=True)),
    "ded_async_s1_ds": dict(kind="async", threads=1, env={},
                            overrides=dict(rollout_cpu_affinity="1", max_staleness=1, dynamic_sampling=True)),  # fmt: skip
}
# how each kind of vLLM server runs: (cores, niceness, OpenMP threads)
VLLM_SERVERS = {"shared": (None, 19, 2), "dedicated": ([1], 0, 1)}
TASK = dict(  # the CPU demo's settings
    **TRAINING_SETTINGS,
    bf16=recipe_precision("cpu")[0],  # as the demo: bf16 autocast only where this CPU computes bf16 natively
    # (None: TRL's default, bf16), float32 where it would be emulated
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    use_cpu=True,
    disable_tqdm=True,
)
# --task: the demo, or a sparse reward where most groups carry no signal (the correct answer only, no
# format reward, temperature 1.0, lr 5e-6; on GRPOTrainer frac_reward_zero_std was 1 on 10 of 16 steps)
TASKS = {"demo": dict(rewards=("correctness", "format"), train={}),
         "sparse": dict(rewards=("correctness",), train=dict(temperature=1.0, learning_rate=5e-6))}  # fmt: skip
# the same evaluation problems for every run: held-out templates (generalisation, the headline) and new problems of
# the train templates (in distribution)
HELDOUT = dict(n=64, seed=1000)
IN_DISTRIBUTION = dict(n=32, seed=2000)


def run_one(spec: dict) -> dict:
    """One training run in this process (the driver sets its environment). Returns its curve and metrics."""
    import torch

    torch.set_num_threads(spec["threads"])
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl_async.demo.arithmetic import correctness_reward, format_reward, make_split
    from trl_async.demo.evaluation import greedy_accuracy
    from trl_async.demo.pretrained import smollm2_135m_instruct

    launched, eval_seconds = spec["launched_at"], [0.0]
    curve: list[dict] = []
    heldout = make_split("heldout", HELDOUT["n"], seed=HELDOUT["seed"])
    in_distribution = make_split("train", IN_DISTRIBUTION["n"], seed=IN_DISTRIBUTION["seed"])

    def evaluate(trainer, step: int) -> None:
        start = time.time()
        pool = getattr(trainer, "rollout_pool", None)
        paused = []  # the clock skips evaluations: workers (or the vLLM server) must not generate ahead for free
        if spec.get("server_pgid") and pool is not None:
            os.killpg(spec["server_pgid"], signal.SIGSTOP)
        elif pool is not None:
            paused = [p.pid for p in (lane.process for lane in pool.current_lanes) if p.is_alive()]
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        try:
            accuracy = greedy_accuracy(trainer, heldout, correctness_reward)
            seen_templates = greedy_accuracy(trainer, in_distribution, correctness_reward)
        finally:
            for pid in paused:
                os.kill(pid, signal.SIGCONT)
            if spec.get("server_pgid") and pool is not None:
                os.killpg(spec["server_pgid"], signal.SIGCONT)
        curve.append({"step": step, "seconds": start - launched - eval_seconds[0], "accuracy": accuracy,
                      "accuracy_train_templates": seen_templates})  # fmt: skip
        eval_seconds[0] += time.time() - start

    class EvalEvery(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if spec["eval_every"] and state.global_step % spec["eval_every"] == 0:
                evaluate(trainer, state.global_step)

    world = int(os.environ.get("WORLD_SIZE", "1"))  # the same global batch (prompts per step) on every configuration
    settings = {**TASK, **TASKS[spec["task"]]["train"], **spec.get("train", {}), "output_dir": spec["output_dir"], "max_steps": spec["steps"],
                "seed": spec["seed"], "per_device_train_batch_size": TASK["per_device_train_batch_size"] // world}  # fmt: skip
    if spec["kind"] == "sync":
        args, cls = GRPOConfig(**settings), GRPOTrainer
    else:
        # workers are stopped (SIGSTOP) during evaluations: a heartbeat timeout longer than an evaluation
        overrides = {"rollout_heartbeat_timeout_s": 600.0, **spec.get("overrides", {})}
        args, cls = AsyncGRPOConfig(**settings, **overrides), AsyncGRPOTrainer
    trainer = cls(
        model=smollm2_135m_instruct(),
        reward_funcs=[{"correctness": correctness_reward, "format": format_reward}[r]
                      for r in TASKS[spec["task"]]["rewards"]],
        args=args,
        train_dataset=make_split("train", 512, seed=spec["seed"]),
        callbacks=[EvalEvery()],
    )
    generate_s: list[float] = []  # GRPOTrainer's generation per step (one generate call a step here): its G
    if spec["kind"] == "sync":
        generate = trainer._generate

        def timed_generate(*a, **k):
            start = time.time()
            try:
                return generate(*a, **k)
            finally:
                generate_s.append(time.time() - start)

        trainer._generate = timed_generate
    if spec["eval_every"]:
        evaluate(trainer, 0)
    before_train = eval_seconds[0]
    train_start = time.time()
    trainer.train()
    end = time.time()
    train_evals = eval_seconds[0] - before_train
    if spec["eval_every"] and spec["steps"] % spec["eval_every"]:
        evaluate(trainer, spec["steps"])
    logs = [h for h in trainer.state.log_history if "reward" in h]
    pool = getattr(trainer, "last_rollout_pool", None)  # the workers' generate calls, in the order they started
    calls = sorted((start, end - start) for kind, _, start, end in (pool.activity if pool else ()) if kind == "generate")
    # TRL's completion metrics are gathered over ranks: mean length times the global batch
    completion_tokens = sum(h["completions/mean_length"] * TASK["per_device_train_batch_size"] for h in logs)
    mean = lambda key: statistics.fmean(h[key] for h in logs) if logs and key in logs[0] else None  # noqa: E731
    return {
        "curve": curve,
        "startup_s": train_start - launched - before_train,
        "train_s": end - train_start - train_evals,
        "end_to_end_s": end - launched - before_train - train_evals,
        "eval_s": eval_seconds[0],
        "completion_tokens": completion_tokens,
        "tokens": logs[-1]["num_tokens"] if logs else 0,  # prompt + completion tokens trained on (TRL's count)
        "reward_first4": statistics.fmean(h["reward"] for h in logs[:4]),
        "reward_last4": statistics.fmean(h["reward"] for h in logs[-4:]),
        "step_s": [h.get("step_time") for h in logs],
        "staleness_mean": mean("async/staleness_mean"),
        "ess_mean": mean("is/ess"),
        "kl_behaviour_mean": mean("is/kl_behaviour"),
        "trainer_wait_s_mean": mean("async/trainer_wait_s"),
        "trainer_wait_s": [h.get("async/trainer_wait_s") for h in logs],  # per step: G of the synchronous schedule
        "generate_s": generate_s or None,  # GRPOTrainer's runs: generation per step (evaluations not counted)
        # AsyncGRPOTrainer's runs: each rollout worker generate call's seconds (one call a batch of groups)
        "worker_generate_s": [seconds for _, seconds in calls] or None,
        "weight_sync_s_mean": mean("async/weight_sync_s"),
        # decode steps spent on rows that had already finished, if the batch is one generate call: 1 - mean/max length
        "finished_row_steps": statistics.fmean(
            1 - h["completions/mean_length"] / h["completions/max_length"] for h in logs
        ),
        "dropped_stale": logs[-1].get("async/dropped_stale") if logs else None,
        # per step: the mean length of the completions consumed (a masked, truncated one counts, untrained)
        "mean_length": [h["completions/mean_length"] for h in logs],
        "clipped_ratio": [h.get("completions/clipped_ratio") for h in logs],
        # steps whose every group had rewards all equal (no gradient), and the groups dynamic sampling dropped
        "zero_signal_steps": sum(h.get("frac_reward_zero_std", 0.0) >= 1.0 for h in logs),
        "filtered_groups": logs[-1].get("async/filtered_groups") if logs else None,
        "filtered_frac": [h.get("async/filtered_frac") for h in logs],
    }


def launch(name: str, seed: int, steps: int, eval_every: int, work: str, servers: dict, completion_length=None,
           task: str = "demo", fixed_length: bool = False) -> dict:
    config = CONFIGS[name]
    out = Path(work) / f"{name}-{seed}.json"
    spec = {**config, "seed": seed, "steps": steps, "eval_every": eval_every, "task": task,
            "output_dir": str(Path(work) / f"out-{name}-{seed}"), "launched_at": time.time()}  # fmt: skip
    if completion_length:
        spec["train"] = {**spec.get("train", {}), "max_completion_length": completion_length}
    if fixed_length:  # equal work per step: no completion ends before the budget (EOS masked until then)
        budget = completion_length or TASK["max_completion_length"]
        spec["train"] = {**spec.get("train", {}),
                         "generation_kwargs": {"min_tokens" if config.get("vllm") else "min_new_tokens": budget}}  # fmt: skip
    if config.get("vllm"):
        server = servers[config["vllm"]]
        spec["overrides"] = {**spec["overrides"], "rollout_vllm_urls": [server.url], "vllm_server_timeout": 120}
        spec["server_pgid"] = server.process.pid  # started in its own session: its pid is its process group
    env = {**os.environ, "OMP_NUM_THREADS": str(config["threads"]), "TOKENIZERS_PARALLELISM": "false",
           **config["env"]}  # fmt: skip
    if "OMP_WAIT_POLICY" not in config["env"]:
        env.pop("OMP_WAIT_POLICY", None)
    cmd = [sys.executable, __file__, "--run", json.dumps(spec), "--result", str(out)]
    if config.get("cores"):  # the whole process on these cores (a training device of its own)
        cmd[:0] = ["taskset", "-c", ",".join(map(str, config["cores"]))]
    if config.get("processes", 1) > 1:
        ddp = HERE.parent / "recipes/accelerate/ddp.yaml"
        cmd[1:1] = ["-m", "accelerate.commands.launch", "--config_file", str(ddp),
                    "--num_processes", str(config["processes"])]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed:\n{done.stderr[-4000:]}")
    return {"config": name, "seed": seed, **json.loads(out.read_text())}


METRICS = {"accuracy": "held-out templates", "accuracy_train_templates": "train templates, new problems"}


def mean_curve(rs: list[dict], key: str) -> list[tuple[int, float, float]]:
    """(step, mean seconds, mean accuracy) at each evaluation, averaged over the runs (seeds)."""
    n = min(len(r["curve"]) for r in rs)
    return [
        (rs[0]["curve"][i]["step"], statistics.fmean(r["curve"][i]["seconds"] for r in rs),
         statistics.fmean(r["curve"][i][key] for r in rs))
        for i in range(n)
    ]  # fmt: skip


def time_to(curve: list[tuple[int, float, float]], target: float) -> float | None:
    """Seconds at which the mean curve first reaches ``target`` after training started (linear between
    evaluations; step 0 does not count: a target below the base model's accuracy is not reached by training)."""
    for (s0, t0, a0), (_, t1, a1) in zip(curve, curve[1:], strict=False):
        if a1 >= target - 1e-9:
            if s0 == 0 or a0 >= target or a1 == a0:
                return t1
            return t0 + (t1 - t0) * (target - a0) / (a1 - a0)
    return None


def accuracy_stats(rs: list[dict], key: str, target: float | None) -> dict:
    """Final accuracy (mean, sd over seeds) and when the seed-averaged curve reaches ``target``."""
    rs = [r for r in rs if r["curve"] and key in r["curve"][-1]]
    if not rs:
        return {"final": None, "sd": None, "tta": None}
    finals = [r["curve"][-1][key] for r in rs]
    return {
        "final": statistics.fmean(finals),
        "sd": statistics.pstdev(finals) if len(finals) > 1 else 0.0,
        "tta": time_to(mean_curve(rs, key), target) if target is not None else None,
    }


def phase_bound(rs: list[dict]) -> dict | None:
    """G (the trainer's wait for generation) and T (the rest of a step: training and the weight sync) per step of
    the synchronous-schedule runs, first step left out (start-up), and the bound (G+T)/max(G,T) on what overlapping
    the two can gain."""
    waits = [w for r in rs for w in r.get("trainer_wait_s", [])[1:] if w is not None]
    steps = [s for r in rs for s in r["step_s"][1:] if s is not None]
    if not waits or not steps:
        return None
    g = statistics.fmean(waits)
    t = statistics.fmean(steps) - g
    return {"G_s": g, "T_s": t, "bound": (g + t) / max(g, t)}


def filtered_share(run: dict, prompts_per_step: int) -> float | None:
    """Of the groups a run scored and either trained or dropped, the share dynamic sampling dropped."""
    if run.get("filtered_groups") is None:
        return None
    trained = len(run["step_s"]) * prompts_per_step
    return run["filtered_groups"] / (run["filtered_groups"] + trained)


def summarise(runs: list[dict], configs: list[str], reference: str = "sync") -> tuple[list[dict], dict]:
    """Rows per configuration; the ``reference`` configuration's final accuracy is every row's target, and ratios
    (``× sync``) are against it. With the dedicated-device reference (ded_sync) each row also gets the bound from
    its phases and the fraction of it reached."""
    by = {c: [r for r in runs if r["config"] == c] for c in configs}
    prompts_per_step = TASK["per_device_train_batch_size"] // TASK["num_generations"]
    for r in runs:
        r["filtered_share"] = filtered_share(r, prompts_per_step)
    sync_runs = by.get(reference, [])
    bound = phase_bound(sync_runs) if reference == "ded_sync" else None
    targets = {key: accuracy_stats(sync_runs, key, None)["final"] for key in METRICS}  # sync's final accuracy
    sync_tps = (
        statistics.fmean(r["tokens"] / r["end_to_end_s"] for r in sync_runs)
        if sync_runs and all(r.get("tokens") for r in sync_runs)
        else None
    )
    rows = []
    for c in configs:
        rs = by[c]
        tps = (
            statistics.fmean(r["tokens"] / r["end_to_end_s"] for r in rs) if all(r.get("tokens") for r in rs) else None
        )

        def pick(key: str, rs=rs) -> float | None:
            values = [r[key] for r in rs if r.get(key) is not None]
            return statistics.fmean(values) if values else None

        later = [st for r in rs for st in r["step_s"][1:] if st is not None]  # steady state: first step left out
        # the training phase per step (step - the trainer's wait for data); only where waits were recorded (async)
        phases = [st - w for r in rs for st, w in zip(r["step_s"][1:], r.get("trainer_wait_s", [])[1:], strict=False)
                  if st is not None and w is not None]  # fmt: skip
        row = {
            "config": c, "seeds": len(rs),
            "steady_step_s": statistics.fmean(later) if later else None,
            "train_phase_s": statistics.fmean(phases) if phases else None,
            "end_to_end_s": pick("end_to_end_s"), "startup_s": pick("startup_s"),
            "steps_per_min": statistics.fmean(len(r["step_s"]) / r["end_to_end_s"] * 60 for r in rs),
            "tokens_per_s": tps, "tokens_per_s_vs_sync": tps / sync_tps if sync_tps and tps else None,
            "completion_tokens_per_s": statistics.fmean(r["completion_tokens"] / r["end_to_end_s"] for r in rs),
            "staleness_mean": pick("staleness_mean"), "ess_mean": pick("ess_mean"),
            "kl_behaviour_mean": pick("kl_behaviour_mean"), "trainer_wait_s": pick("trainer_wait_s_mean"),
            "weight_sync_s": pick("weight_sync_s_mean"), "finished_row_steps": pick("finished_row_steps"),
            "zero_signal_steps": pick("zero_signal_steps"),
            # of the groups scored, the share dropped (trained groups: the prompts of every step)
            "filtered_share": pick("filtered_share"),
        }  # fmt: skip
        for key in METRICS:
            row[key] = accuracy_stats(rs, key, targets[key])
        rows.append(row)
    sync_row = next((row for row in rows if row["config"] == reference), None)
    for row in rows:
        row["steps_per_min_vs_sync"] = row["steps_per_min"] / sync_row["steps_per_min"] if sync_row else None
        row["steady_vs_sync"] = (sync_row["steady_step_s"] / row["steady_step_s"]
                                 if sync_row and sync_row["steady_step_s"] and row["steady_step_s"] else None)  # fmt: skip
        if bound is not None:
            row["phases"] = bound
            vs = row["tokens_per_s_vs_sync"]
            row["of_bound"] = vs / bound["bound"] if vs is not None else None
        for key in METRICS:
            mine, theirs = row[key]["tta"], sync_row[key]["tta"] if sync_row else None
            row[key]["tta_vs_sync"] = mine / theirs if mine is not None and theirs else None
    return rows, targets


def plot(runs: list[dict], configs: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(METRICS), figsize=(12, 4.5), sharey=True)
    for ax, (key, label) in zip(axes, METRICS.items(), strict=True):
        for c in configs:
            rs = [r for r in runs if r["config"] == c and r["curve"] and key in r["curve"][0]]
            if not rs:
                continue
            n = min(len(r["curve"]) for r in rs)
            x = np.mean([[p["seconds"] for p in r["curve"][:n]] for r in rs], axis=0)
            y = np.array([[p[key] for p in r["curve"][:n]] for r in rs])
            ax.plot(x, y.mean(0), marker="o", label=f"{c} ({len(rs)} seeds)")
            ax.fill_between(x, y.min(0), y.max(0), alpha=0.15)
        ax.set(xlabel="wall-clock seconds from launch (evaluations excluded)", ylabel="greedy accuracy",
               title=f"{label}")  # fmt: skip
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, arithmetic word problems, 2 CPU cores (mean, min-max over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_step_times(runs: list[dict], configs: list[str], path: Path) -> None:
    """Step-time runs (no evaluations): each configuration's seconds per step, first step and the rest, per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, c in enumerate(configs):
        rs = [r for r in runs if r["config"] == c]
        for offset, (label, part) in enumerate((("first step", slice(0, 1)), ("later steps", slice(1, None)))):
            per_seed = [statistics.fmean(r["step_s"][part]) for r in rs if r["step_s"][part]]
            x = i + (offset - 0.5) * 0.35
            ax.bar(x, statistics.fmean(per_seed), width=0.35, color=f"C{offset}", label=label if i == 0 else None)
            ax.scatter([x] * len(per_seed), per_seed, color="k", s=10, zorder=3)
    ax.set_xticks(range(len(configs)), configs, rotation=20)
    ax.set(ylabel="seconds per step (bars: mean over seeds, dots: seeds)")
    ax.legend()
    fig.suptitle("SmolLM2-135M-Instruct, arithmetic word problems, 2 CPU cores: step times")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def collect(cli) -> list[dict]:
    from trl_async.demo.pretrained import smollm2_135m_instruct

    model_dir = smollm2_135m_instruct()  # fetch and convert once, outside every run's clock
    runs = []
    servers = {}
    with tempfile.TemporaryDirectory(prefix="tta_") as work:
        try:
            for kind in dict.fromkeys(CONFIGS[c]["vllm"] for c in cli.configs if CONFIGS[c].get("vllm")):
                servers[kind] = start_vllm_server(model_dir, *VLLM_SERVERS[kind])
            for seed in cli.seeds:  # interleaved
                for name in cli.configs:
                    runs.append(launch(name, seed, cli.steps, cli.eval_every, work, servers, cli.max_completion_length,
                                       cli.task, cli.fixed_length))
                    run = runs[-1]
                    print(f"{name} seed {seed}: {run['end_to_end_s']:.0f} s, {run['completion_tokens']:.0f} tokens, "
                          f"final {run['curve'][-1]['accuracy'] if run['curve'] else '-'}", flush=True)  # fmt: skip
        finally:
            for server in servers.values():
                server.stop()
    return runs


def start_vllm_server(model_dir, cores: list[int] | None, niceness: int, threads: int):
    """The CPU vLLM server the tests use (tests/vllm_server.py: float32, eager, gloo weight transfer). Shared cores:
    at niceness 19 so that it fills the trainer's idle moments as the transformers workers do, its threads passive.
    Dedicated: on ``cores`` only, at the trainer's priority."""
    sys.path.insert(0, str(HERE.parent))
    from tests.vllm_server import start_server

    log = Path(tempfile.gettempdir()) / f"tta_vllm_server_{'shared' if cores is None else 'dedicated'}.log"
    # a batch budget that never splits a prompt's prefill: vllm-cpu 0.32 crashes on a seeded request whose chunked
    # prefill discards its sampled token ("CPU Generator does not use offset"); 64 sequences x 256 tokens
    server = start_server(str(model_dir), log, niceness=niceness, extra_flags=["--max-num-batched-tokens", "16384"],
                          extra_env={"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"},
                          cores=cores)  # fmt: skip
    print(f"vLLM server up at {server.url} (log {log})", flush=True)
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["sync", "async", "async_s2", "async_s4", "async_2w"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--eval_every", type=int, default=4, help="0: no evaluation (step times only)")
    parser.add_argument("--name", default="time_to_accuracy")
    parser.add_argument("--max_completion_length", type=int, default=None,
                        help=f"override the task's {TASK['max_completion_length']} tokens (reasoning length: 128)")
    parser.add_argument("--reference", default="sync",
                        help="the configuration whose final accuracy is the target and whose rates are 1.0 "
                        "(ded_sync for the dedicated-device runs: then the bound from its phases is reported)")
    parser.add_argument("--fixed_length", action="store_true",
                        help="every completion exactly max_completion_length tokens (EOS masked until then: "
                        "min_new_tokens / vLLM's min_tokens), so every step carries the same work")
    parser.add_argument("--task", choices=sorted(TASKS), default="demo",
                        help="sparse: the correct answer only, temperature 1.0, lr 5e-6 (most groups without signal)")
    parser.add_argument("--from_json", help="recompute the table and plot from a results JSON (no runs)")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.run:
        result = run_one(json.loads(cli.run))
        if int(os.environ.get("RANK", "0")) == 0:  # every rank evaluates the same problems; rank 0 reports
            Path(cli.result).write_text(json.dumps(result))
        return
    sys.path.insert(0, str(HERE))
    import report

    if cli.from_json:
        saved = json.loads(Path(cli.from_json).read_text())
        runs, cli.configs = saved["runs"], list(dict.fromkeys(r["config"] for r in saved["runs"]))
        cli.steps, cli.eval_every, cli.seeds = (saved["meta"][k] for k in ("steps", "eval_every", "seeds"))
    else:
        runs = collect(cli)
    if cli.from_json:
        cli.reference = saved["meta"].get("reference", "sync")
        cli.max_completion_length = saved["meta"].get("max_completion_length")
        cli.task = saved["meta"].get("task_name", "demo")
        cli.fixed_length = saved["meta"].get("fixed_length", False)
    rows, targets = summarise(runs, cli.configs, cli.reference)
    precision = saved["meta"].get("precision", "?") if cli.from_json else described_precision(TASK["bf16"] is None, False)
    meta = {"precision": precision, "reference": cli.reference, "task_name": cli.task,
            "task_overrides": TASKS[cli.task], "phases": rows[0].get("phases"),
            "max_completion_length": cli.max_completion_length or TASK["max_completion_length"],
            "fixed_length": cli.fixed_length, "steps": cli.steps, "eval_every": cli.eval_every, "seeds": cli.seeds, "task": TASK, "heldout": HELDOUT,
            "in_distribution": IN_DISTRIBUTION, "sync_final_accuracy": targets}  # fmt: skip
    recorded = {"machine": saved["machine"]} if cli.from_json and "machine" in saved else {}  # where it ran
    report.write_json(cli.name, {**recorded, "meta": meta, "rows": rows, "runs": runs})
    ref = "sync" if cli.reference == "sync" else cli.reference
    header = ["config", "seeds", "end-to-end s", "start-up s", "steps/min", f"× {ref}", "tokens/s", f"× {ref}",
              "of bound", "steady s/step", f"{ref} steady ÷ this", "step − wait s", "held-out acc", "± sd", f"s to {ref}'s", f"× {ref} time", "train-tmpl acc", "± sd",
              f"× {ref} time", "staleness", "ESS", "KL(μ‖π_prox)", "trainer wait s", "publish s",
              "finished-row steps", "zero-signal steps", "filtered share"]  # fmt: skip
    dash = lambda v: "-" if v is None else v  # noqa: E731
    held, seen = "accuracy", "accuracy_train_templates"
    table = report.markdown_table(header, [[
        r["config"], r["seeds"], r["end_to_end_s"], r["startup_s"], r["steps_per_min"], dash(r["steps_per_min_vs_sync"]),
        dash(r["tokens_per_s"]), dash(r["tokens_per_s_vs_sync"]), dash(r.get("of_bound")), dash(r["steady_step_s"]), dash(r["steady_vs_sync"]), dash(r["train_phase_s"]), dash(r[held]["final"]), dash(r[held]["sd"]),
        dash(r[held]["tta"]), dash(r[held]["tta_vs_sync"]), dash(r[seen]["final"]),
        dash(r[seen]["sd"]), dash(r[seen]["tta_vs_sync"]), dash(r["staleness_mean"]), dash(r["ess_mean"]),
        dash(r["kl_behaviour_mean"]), dash(r["trainer_wait_s"]), dash(r["weight_sync_s"]),
        dash(r["finished_row_steps"]), dash(r["zero_signal_steps"]), dash(r["filtered_share"])]
        for r in rows])  # fmt: skip
    print(table)
    if cli.eval_every:
        plot(runs, cli.configs, report.png_path(cli.name))
    else:
        plot_step_times(runs, cli.configs, report.png_path(cli.name))
    phases = meta["phases"]
    bound_note = (f" {ref}'s phases per step (first step left out): generation wait G = {phases['G_s']:.1f} s, "
                  f"training and sync T = {phases['T_s']:.1f} s, so overlap can gain at most (G+T)/max(G,T) = "
                  f"{phases['bound']:.2f}×; 'of bound' is tokens/s × {ref} over that." if phases else "")  # fmt: skip
    task_note = "" if cli.task == "demo" else f"Task {cli.task!r}: {TASKS[cli.task]}. "
    header_note = (f"{task_note}2 cores; configurations without a precision in their name in {precision}; "
                   f"{meta['max_completion_length']} completion tokens "
                   f"{'exactly (EOS masked until then)' if cli.fixed_length else 'at most'}.{bound_note} "
                   f"{cli.steps} steps, seeds {cli.seeds}, greedy accuracy every {cli.eval_every} steps on "
                   f"{HELDOUT['n']} held-out-template and {IN_DISTRIBUTION['n']} train-template problems; the "
                   f"final accuracies (the targets, from {ref}): {targets}")  # fmt: skip
    figure = f"\n\n![{cli.name}](results/{cli.name}.png)" if cli.eval_every == 0 else ""  # curves: above the table
    report.update_readme(cli.name, f"{header_note}\n\n{table}{figure}")


if __name__ == "__main__":
    main()
