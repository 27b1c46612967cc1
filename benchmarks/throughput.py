"""Throughput: TRL's synchronous GRPOTrainer vs AsyncGRPOTrainer, same model, task, batch, sampling and steps, in one
run, interleaved, on this machine's cores, in the regimes users meet.

    python benchmarks/throughput.py --quick   # ~5-8 min: one repeat, fewer steps, in every regime
    python benchmarks/throughput.py           # two interleaved repeats, more steps, unless a regime sets its own

Per run it measures, over the steps after a warm-up (steady state): wall time, samples/s, completion tokens/s, the
trainer's busy share (training compute, not generating or waiting), the workers' busy share (async), and the
weight-sync share. Outside the steady state: start-up (``train()`` called to the first batch ready: worker spawn and
the first generation) and end to end (trainer construction to the end of ``train()``, warm-up steps included).

Equal work: each side samples its own completion lengths (``long_tail``), so the comparison that holds whatever the
lengths is tokens per second ("tokens/s vs best sync"); steps per second is reported beside it. ``long_tail`` trains
with a learning rate of 0: the optimizer still steps and the weights are still pushed, but every run samples from the
same length distribution. With a learning rate, each run's lengths drift with its own learning trajectory, and
tokens/s would compare trajectories rather than schedules.

Sync baselines: TRL's GRPOTrainer in one process with 1 or 2 torch threads, and 2-process DDP under ``accelerate
launch`` (gloo, 1 thread per rank, half the batch per rank); the best of them is "best sync".

Bound (shared cores): no schedule beats the single-core CPU work / cores, nor the reward latency divided by the
groups scored at once. The single-core work is the synchronous 1-thread run's wall time minus its reward latency (a
sleeping verifier uses no core), scaled to this run's completion tokens; the reward latency is the verifier's sleep
over the run's completions divided by the concurrent scorers (1 for GRPOTrainer, ``rollout_scoring_threads`` for
async); bound = the larger of the two, efficiency = bound / measured time. Also reported: the ideal speed-up with
separate devices per phase, (G + T) / max(G, T), from the same 1-thread run.

Writes benchmarks/results/throughput.{json,png} (+ throughput_reward.png, throughput_timeline.png) and the tables in
benchmarks/RESULTS.md. The pipeline simulator (simulate.py) is validated against the async runs here.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "recipes"))

import agentic_task  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from report import usable_cores  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from trl_async.demo.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402

CORES = usable_cores()  # the affinity mask, not the host's count
TOOL_THREADS = 16  # AsyncGRPOConfig.rollout_tool_threads' default: tool calls in flight at once
BATCH, GROUP = 32, 8  # 4 prompts x 8 completions per optimizer step


@dataclass(frozen=True)
class Regime:
    name: str
    what: str
    hidden: int
    layers: int
    completion: int
    forced: bool = True  # every completion runs to max length (min_new_tokens)
    eos_scale: float | None = None  # long tail: the EOS logit's direction scaled (see make_model)
    reward_delay_s: float = 0.0  # per completion, a sleeping verifier
    workers: int = 1
    batch_groups: int | None = None  # rollout_batch_groups (None: the batch split across the workers)
    scoring_threads: tuple[int, ...] = ()  # extra async runs (max_staleness 1) with these rollout_scoring_threads
    agentic: bool = False  # multi-turn episodes with a slow tool (agentic_task.py): its own model, data and batch
    repeats: int = 0  # interleaved repeats (seeds) for this regime; 0: the command's default
    steps: tuple[int, int] | None = None  # (measured, warm-up) steps for this regime; None: the command's
    learning_rate: float = 1e-5  # 0: the policy held still, so its sampled lengths are the same in every run


REGIMES = [
    Regime("balanced", "balanced phases, instant reward", hidden=256, layers=4, completion=32),
    Regime("slow_reward", "verifier 20 ms per completion", hidden=256, layers=4, completion=32, reward_delay_s=0.02,
           scoring_threads=(4,)),  # fmt: skip
    Regime(
        "long_tail",
        "long-tailed lengths (median 21, max 96)",
        hidden=256,
        layers=4,
        completion=96,
        forced=False,
        eos_scale=-2.0,
        learning_rate=0.0,
        repeats=3,
    ),  # fmt: skip
    Regime(
        "gen_bound",
        "generation-bound (G >> T), 2 workers, a whole batch per generate call",
        hidden=64,
        layers=2,
        completion=128,
        workers=2,
        batch_groups=4,
        steps=(40, 5),  # steps of ~0.2 s: 12 of them would measure start-up jitter more than the schedule
    ),  # fmt: skip
    Regime(
        "agentic",
        "multi-turn episodes of 1-4 turns, a tool of log-normal latency (median 100 ms, p99 2 s)",
        hidden=128,
        layers=2,
        completion=128,
        forced=False,
        agentic=True,
        repeats=3,
        steps=(8, 2),
    ),  # fmt: skip
]
DEFAULT_REGIMES = ["balanced", "slow_reward", "long_tail", "gen_bound"]  # agentic: `--regimes agentic` (its own table)


def make_model(regime: Regime, path: str) -> str:
    if regime.agentic:
        return agentic_task.make_model(path)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=regime.hidden, num_layers=regime.layers, num_heads=4)
    if regime.eos_scale is not None:  # tied embeddings: scaling the EOS row by -2 gives geometric-ish lengths
        with torch.no_grad():
            model.get_output_embeddings().weight[tokenizer.eos_token_id] *= regime.eos_scale
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def dataset() -> Dataset:
    return Dataset.from_list([{"prompt": f"write {a}{b}:"} for a in "abcdefgh" for b in "abcd"])


def make_reward(delay_s: float):
    def vowel_reward(prompts, completions, **kwargs):
        if delay_s:
            time.sleep(delay_s * len(completions))  # a verifier running tests: latency, no CPU
        return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]

    return vowel_reward


class _Clock(TrainerCallback):
    def __init__(self) -> None:
        self.step_begin: list[float] = []
        self.step_end: list[float] = []
        self.rewards: list[tuple[float, float]] = []  # (time, reward)

    def on_step_begin(self, args, state, control, **kwargs):
        self.step_begin.append(time.time())

    def on_step_end(self, args, state, control, **kwargs):
        self.step_end.append(time.time())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.rewards.append((time.time(), logs["reward"]))


class TimedGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer, unchanged, with the wall-clock intervals of its generation and reward phases recorded."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.phases: list[tuple[str, float, float]] = []

    @contextlib.contextmanager
    def _phase(self, kind: str):
        start = time.time()
        try:
            yield
        finally:
            self.phases.append((kind, start, time.time()))

    def _generate_single_turn(self, *args, **kwargs):
        with self._phase("generate"):
            return super()._generate_single_turn(*args, **kwargs)

    def _calculate_rewards(self, *args, **kwargs):
        with self._phase("reward"):
            return super()._calculate_rewards(*args, **kwargs)


def _overlap(intervals, lo: float, hi: float) -> float:
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in intervals)


def busy_share(calls, lo: float, hi: float, workers: int) -> float:
    """The workers' busy share of the window (lo, hi): each lane's (lane, start, end) spans merged before they are
    measured: a continuously batching worker's spans nest (one per group end within a submit) and overlap (submits
    share its slots)."""
    busy = 0.0
    for lane in {w for w, _, _ in calls}:
        merged: list[list[float]] = []
        for s, e in sorted((s, e) for w, s, e in calls if w == lane):
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        busy += _overlap(merged, lo, hi)
    return busy / ((hi - lo) * workers)


def run_one(regime: Regime, model_dir: str, kind: str, steps: int, warmup: int, seed: int = 0,
            threads: int = 1, staleness: int = 0, task=None, scoring_threads: int = 1, processes: int = 1,
            consumption_window: int | None = None, continuous: bool = False) -> dict:  # fmt: skip
    """One training run; ``kind`` is "sync" (TRL GRPOTrainer with ``threads`` torch threads) or "async".

    ``processes`` > 1 (sync only): this is one rank of a DDP run launched by ``launch_ddp``; each rank takes
    BATCH / processes completions per step.
    """
    torch.set_num_threads(threads)
    constructed = time.time()
    common = dict(
        output_dir=tempfile.mkdtemp(prefix="tp_"), max_steps=warmup + steps, per_device_train_batch_size=BATCH // processes,
        num_generations=GROUP, max_completion_length=regime.completion, temperature=1.0,
        learning_rate=regime.learning_rate,
        beta=0.0, logging_steps=1, report_to=[], bf16=False, use_cpu=True, save_strategy="no", seed=seed,
        disable_tqdm=True, gradient_checkpointing=False,
        generation_kwargs={"min_new_tokens": regime.completion} if regime.forced else None,
        ddp_backend="gloo" if processes > 1 else None,
    )  # fmt: skip
    if regime.agentic:
        task = agentic_task.task(model_dir, seed)
    if task is not None:  # the learning-curve task (tiny_demo's spelling) overrides model-free settings
        common.update(task["settings"], max_steps=warmup + steps, output_dir=common["output_dir"], seed=seed,
                      logging_steps=1, disable_tqdm=True, generation_kwargs=None)  # fmt: skip
        common["per_device_train_batch_size"] = task["settings"]["per_device_train_batch_size"] // processes
    batch = common["per_device_train_batch_size"] * processes
    reward = task["reward"] if task else make_reward(regime.reward_delay_s)
    data = task["dataset"] if task else dataset()
    extra = {k: task[k] for k in ("tools", "processing_class") if task and k in task}
    clock = _Clock()
    if kind == "sync":
        trainer = TimedGRPOTrainer(model=model_dir, reward_funcs=reward, args=GRPOConfig(**common),
                                   train_dataset=data, callbacks=[clock], **extra)  # fmt: skip
    else:
        args = AsyncGRPOConfig(**common, max_staleness=staleness, num_rollout_workers=regime.workers,
                               rollout_batch_groups=regime.batch_groups,
                               rollout_scoring_threads=scoring_threads,
                               rollout_consumption_window=consumption_window,
                               use_transformers_continuous_batching=continuous)  # fmt: skip
        trainer = AsyncGRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=data,
                                   callbacks=[clock], **extra)  # fmt: skip
    started = time.time()
    trainer.train()
    finished = time.time()
    lo, hi = clock.step_end[warmup - 1] if warmup else started, clock.step_end[-1]
    wall = hi - lo
    window = [h for h in trainer.state.log_history if "completions/mean_length" in h][warmup:]
    tokens = sum(h["completions/mean_length"] * batch for h in window)  # sampled tokens (tool results excluded)
    tool_spans = getattr(extra.get("tools", [None])[0], "spans", [])
    row = {
        "regime": regime.name, "kind": kind if processes == 1 else "ddp", "threads": threads,
        "staleness": staleness if kind == "async" else None, "scoring_threads": scoring_threads if kind == "async" else 1,
        "consumption_window": consumption_window if kind == "async" else None,  # None: arrival order
        "continuous": continuous,  # the workers batch continuously (use_transformers_continuous_batching)
        "processes": processes,
        "workers": regime.workers if kind == "async" else 0, "steps": steps, "seed": seed, "wall_s": wall,
        "samples_per_s": steps * batch / wall, "tokens_per_s": tokens / wall, "tokens": tokens,
        "end_to_end_s": finished - constructed,
        "reward_sleep_s": regime.reward_delay_s * steps * batch,  # the verifier's latency over the measured steps
        "tool_sleep_s": _overlap(tool_spans, lo, hi),  # the tool's latency (agentic) over the measured steps
        "tool_calls_per_step": len(tool_spans) / (warmup + steps),  # made (by any episode, trained on or not)
        # calls per trained episode: the mix of the batches (async takes episodes as they end: short ones first)
        "trained_calls_per_episode": statistics.fmean(h.get("tools/call_frequency", 0.0) for h in window),
        "trained_mean_length": statistics.fmean(h["completions/mean_length"] for h in window),
        "rewards": [(t - started, r) for t, r in clock.rewards],
    }  # fmt: skip
    if kind == "sync":
        gen = _overlap([(s, e) for k, s, e in trainer.phases if k == "generate"], lo, hi)
        rew = _overlap([(s, e) for k, s, e in trainer.phases if k == "reward"], lo, hi)
        row.update(generate_s=gen, reward_s=rew, trainer_busy=(wall - gen - rew) / wall, worker_busy=None,
                   sync_share=0.0,
                   startup_s=next(e for k, _, e in trainer.phases if k == "reward") - started)  # fmt: skip
        row["timeline"] = [(k, 0, s - lo, e - lo) for k, s, e in trainer.phases if s < hi and e > lo]
    else:
        pool = trainer.last_rollout_pool
        activity = list(pool.activity)
        waits = [(s, e) for k, _, s, e in activity if k == "wait"]
        calls = [(w, s, e) for k, w, s, e in activity if k == "generate"]
        scores = [(s, e) for k, _, s, e in activity if k == "score"]
        wait = _overlap(waits, lo, hi)
        syncs = [h.get("async/weight_sync_s", 0.0) for h in window]
        row.update(
            startup_s=waits[0][1] - started,  # the first take() returned: the first batch is ready
            trainer_busy=(wall - wait) / wall,
            worker_busy=busy_share(calls, lo, hi, regime.workers),
            sync_share=sum(syncs) / wall,
            # simulator inputs, measured in this run
            gen_calls_s=[e - s for _, s, e in calls],
            train_steps_s=[(e - b) - _overlap(waits, b, e) for b, e in zip(clock.step_begin, clock.step_end, strict=True)][warmup:],
            sync_s=statistics.fmean(syncs) if syncs else 0.0,
            score_s=statistics.median(e - s for s, e in scores) if scores else 0.0,
            groups_per_call=trainer._geometry.groups_per_call,
            dropped_groups=pool.dropped_groups,  # too stale when consumed (or on arrival): generated again
            max_length=[h["completions/max_length"] for h in window],  # per step (one generate call per step here)
        )  # fmt: skip
        row["timeline"] = (
            [("wait", 0, s - lo, e - lo) for s, e in waits if s < hi and e > lo]
            + [("reward", 0, s - lo, e - lo) for s, e in scores if s < hi and e > lo]
            + [("generate", w + 1, s - lo, e - lo) for w, s, e in calls if s < hi and e > lo]
        )
    row["step_spans"] = [(b - lo, e - lo) for b, e in zip(clock.step_begin, clock.step_end, strict=True) if e > lo]
    del trainer
    gc.collect()
    return row


def configs(regime: Regime, quick: bool) -> list[dict]:
    out = [dict(kind="sync", threads=1), dict(kind="sync", threads=2), dict(kind="sync", threads=1, processes=2)]
    stalenesses = [0, 1, 2, 4] if (regime.name == "balanced" or not quick) else [1, 2]
    if regime.agentic:  # episodes wait seconds for their tool: room for several steps of staleness
        stalenesses = [2, 4, 8]
    out += [dict(kind="async", staleness=s) for s in stalenesses]
    if not regime.agentic:  # lengths that differ: rows to refill; forced lengths: a cheaper decode step only
        out += [dict(kind="async", staleness=s, continuous=True) for s in stalenesses]
    if regime.agentic:  # consumption in admission order: strict, and within one batch (4 groups)
        out += [dict(kind="async", staleness=s, consumption_window=w) for s, w in ((2, 1), (8, 1), (8, 4))]
    return out + [dict(kind="async", staleness=1, scoring_threads=n) for n in regime.scoring_threads]


def launch_ddp(regime: Regime, model_dir: str, **kwargs) -> dict:
    """A 2-process DDP run of TRL's GRPOTrainer under ``accelerate launch``; rank 0 writes the row."""
    result = Path(tempfile.mkdtemp(prefix="tp_ddp_")) / "row.json"
    spec = {"regime": regime.name, "model_dir": model_dir, **kwargs}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(HERE.parent / "recipes/accelerate/ddp.yaml"), "--num_processes", str(kwargs["processes"]),
           __file__, "--ddp_run", json.dumps(spec), "--result", str(result)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"DDP run failed:\n{done.stderr[-4000:]}")
    return json.loads(result.read_text())


def label(r: dict) -> str:
    if r["kind"] == "ddp":
        return "sync DDP 2×1 thr"
    if r["kind"] == "sync":
        return f"sync {r['threads']} thr"
    window = f", window {r['consumption_window']}" if r.get("consumption_window") else ""
    window += ", continuous" if r.get("continuous") else ""
    return f"async η={r['staleness']}{window}" + (f", {r['scoring_threads']} scorers" if r["scoring_threads"] > 1 else "")


def regime_terms(g: Regime, quick: bool) -> str:
    """The model and whatever a regime sets apart from the command's defaults, for the table's legend."""
    terms = [f"h{g.hidden}×{g.layers} layers, {g.completion} tokens"]
    if g.steps and not quick:
        terms.append(f"{g.steps[0]} measured steps after {g.steps[1]} warm-up")
    if g.repeats and not quick:
        terms.append(f"{g.repeats} repeats")
    if g.learning_rate == 0:
        terms.append("learning rate 0 (the length distribution held still)")
    return "; ".join(terms)


def summarise(rows: list[dict]) -> list[dict]:
    """Median over repeats per (regime, config); bound and efficiency from the 1-thread sync run of the regime."""
    keyed: dict[tuple, list[dict]] = {}
    for r in rows:
        keyed.setdefault((r["regime"], label(r)), []).append(r)
    out = []
    for (regime, name), group in keyed.items():
        med = {k: statistics.median(r.get(k, 0.0) for r in group) for k in (
            "wall_s", "samples_per_s", "tokens_per_s", "tokens", "trainer_busy", "sync_share", "startup_s",
            "end_to_end_s", "reward_sleep_s", "tool_sleep_s")}  # fmt: skip
        wb = [r["worker_busy"] for r in group if r["worker_busy"] is not None]
        first = group[0]
        # groups scored at once: the scoring threads, and under DDP every rank scores its share at the same time
        concurrent = first["scoring_threads"] * first.get("processes", 2 if first["kind"] == "ddp" else 1)
        out.append({"regime": regime, "config": name, "kind": first["kind"], "threads": first["threads"],
                    "staleness": first["staleness"], "scoring_threads": first["scoring_threads"],
                    "concurrent_scorers": concurrent, **med,
                    "worker_busy": statistics.median(wb) if wb else None, "repeats": len(group)})  # fmt: skip
    for regime in {r["regime"] for r in out}:
        mine = [r for r in out if r["regime"] == regime]
        one = [r for r in rows if r["regime"] == regime and r["kind"] == "sync" and r["threads"] == 1]
        # single-core CPU work: the verifier and the tool sleep
        work = statistics.median(r["wall_s"] - r["reward_s"] - r.get("tool_sleep_s", 0.0) for r in one)
        work_per_token = work / statistics.median(r["tokens"] for r in one)
        gen = statistics.median(r["generate_s"] for r in one)
        syncs = [r for r in mine if r["kind"] != "async"]
        best_wall, best_tokens = min(r["wall_s"] for r in syncs), max(r["tokens_per_s"] for r in syncs)
        for r in mine:
            r["bound_s"] = max(work_per_token * r["tokens"] / CORES, r["reward_sleep_s"] / r["concurrent_scorers"],
                               r["tool_sleep_s"] / TOOL_THREADS)  # fmt: skip
            r["efficiency"] = r["bound_s"] / r["wall_s"]
            r["speedup_vs_best_sync"] = best_wall / r["wall_s"]  # steps per second
            r["tokens_vs_best_sync"] = r["tokens_per_s"] / best_tokens  # equal work whatever the lengths
            r["separate_device_ideal"] = work / max(gen, work - gen)
    return out


def learning_curves(steps: int) -> dict:
    """Reward vs wall-clock on tiny_demo's task: sync GRPOTrainer (2 threads) vs async (max_staleness 1), same seed."""
    import tiny_demo

    from trl_async.demo.tiny import save_tiny_model

    model_dir = str(save_tiny_model(tempfile.mkdtemp(prefix="lc_"), chars=tiny_demo.VOCAB))
    settings = {k: v for k, v in tiny_demo.DEMO_DEFAULTS.items() if k not in ("max_staleness", "num_rollout_workers")}
    task = dict(reward=tiny_demo.spelling_reward, dataset=tiny_demo.make_dataset(), settings=settings)
    regime = Regime("learning", "tiny_demo task", 64, 2, settings["max_completion_length"], forced=False)
    curves = {}
    for name, kind, threads in (("sync (2 threads)", "sync", 2), ("async (max_staleness 1)", "async", 1)):
        r = run_one(regime, model_dir, kind, steps, warmup=0, threads=threads, staleness=1, task=task)
        curves[name] = {"rewards": r["rewards"], "wall_s": r["wall_s"]}
    return curves


def _simulate(pipeline_kwargs: dict, steps: int) -> float:
    from simulate import Pipeline, simulate

    return simulate(Pipeline(**pipeline_kwargs), steps=steps + 10).seconds_per_step(warmup=10)


def validate_simulator(rows: list[dict]) -> list[dict]:
    """Two checks of benchmarks/simulate.py against the async runs.

    "fed": the simulator gets the run's own measured generate-call, step, sync and scoring times, so it only checks
    the scheduling rules (admission, staleness, queueing). "predicted": it gets the *balanced* regime's times, scaled
    to the other regime by what a user knows before running (completion lengths, the verifier's latency, the number
    of scorers), and predicts that regime's seconds per step, which it cannot match by construction. The per-token
    scaling: a generate call and a training step on a padded batch cost in proportion to (prompt + longest
    completion) tokens. gen_bound uses another model, so it is not predicted from balanced. Runs with continuous
    batching are left out: the simulator models a worker as one generate call per chunk.
    """
    out = []
    asyncs = [r for r in rows if r["kind"] == "async" and r["gen_calls_s"] and not r.get("continuous")]
    prompt = len(dataset()[0]["prompt"])  # character tokenizer, no chat template: one token per character
    for r in asyncs:
        regime = next(g for g in REGIMES if g.name == r["regime"])
        base = dict(workers=regime.workers, groups_per_call=r["groups_per_call"], groups_per_step=BATCH // GROUP,
                    max_staleness=r["staleness"], scorers=r["scoring_threads"])  # fmt: skip
        fed = _simulate({**base, "gen_call_s": statistics.median(r["gen_calls_s"]), "sync_s": r["sync_s"],
                         "train_step_s": statistics.median(r["train_steps_s"]), "score_s": r["score_s"]}, r["steps"])  # fmt: skip
        measured = r["wall_s"] / r["steps"]
        row = {"regime": r["regime"], "staleness": r["staleness"], "scoring_threads": r["scoring_threads"],
               "seed": r["seed"], "measured_s_per_step": measured, "fed_s_per_step": fed,
               "fed_error": fed / measured - 1, "predicted_s_per_step": None, "predicted_error": None}  # fmt: skip
        ref = next((b for b in asyncs if b["regime"] == "balanced" and b["staleness"] == r["staleness"]
                    and b["seed"] == r["seed"] and b["scoring_threads"] == 1), None)  # fmt: skip
        if r["regime"] in ("slow_reward", "long_tail") and ref is not None:
            ref_len = next(g.completion for g in REGIMES if g.name == "balanced")
            scale = (prompt + statistics.fmean(r["max_length"])) / (prompt + ref_len)
            pred = _simulate({**base, "gen_call_s": statistics.median(ref["gen_calls_s"]) * scale,
                              "train_step_s": statistics.median(ref["train_steps_s"]) * scale, "sync_s": ref["sync_s"],
                              "score_s": regime.reward_delay_s * GROUP + ref["score_s"]}, r["steps"])  # fmt: skip
            row.update(predicted_s_per_step=pred, predicted_error=pred / measured - 1)
        out.append(row)
    return out


def plots(rows: list[dict], curves: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import report

    summary = summarise(rows)
    regimes = list(dict.fromkeys(r["regime"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = list(dict.fromkeys(r["config"] for r in summary))
    width = 0.8 / len(labels)
    for i, name in enumerate(labels):
        ys = [next((r["tokens_vs_best_sync"] for r in summary if r["regime"] == g and r["config"] == name), 0)
              for g in regimes]  # fmt: skip
        ax.bar([x + i * width for x in range(len(regimes))], ys, width, label=name, color=plt.cm.tab20(i % 20))
    ax.axhline(1.0, color="k", lw=1)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(regimes))], regimes)
    ax.set(ylabel="tokens/s vs best sync", title="throughput, equal work (higher is better)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(report.png_path("throughput"), dpi=110)

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, c in curves.items():
        ts, rs = zip(*c["rewards"], strict=True)
        smooth = [statistics.fmean(rs[max(0, i - 9) : i + 1]) for i in range(len(rs))]
        ax.plot(ts, smooth, label=name)
    ax.set(xlabel="wall-clock s (from train() start)", ylabel="batch reward (10-step mean)", title="tiny_demo task")
    ax.legend()
    fig.tight_layout()
    fig.savefig(report.png_path("throughput_reward"), dpi=110)

    picks = [r for r in rows if r["regime"] == "balanced" and (r["kind"], r["threads"], r["staleness"])
             in (("sync", 2, None), ("async", 1, 1))][:2]  # fmt: skip
    fig, axes = plt.subplots(len(picks), 1, figsize=(9, 1.2 + 1.3 * len(picks)), squeeze=False)
    colours = {"generate": "tab:orange", "reward": "tab:red", "wait": "lightgrey", "train": "tab:blue"}
    for ax, r in zip(axes[:, 0], picks, strict=True):
        span = 4.0
        for b, e in r["step_spans"]:
            ax.broken_barh([(b, e - b)], (0, 0.8), color=colours["train"])
        for kind, lane, s, e in r["timeline"]:
            # trainer lane 0 (train, wait; sync also generates and scores there); async scoring runs on the
            # trainer process's collector thread, drawn as a thin bar under the trainer lane
            y, h = (-0.35, 0.3) if (kind == "reward" and r["kind"] == "async") else (lane, 0.8)
            ax.broken_barh([(s, e - s)], (y, h), color=colours[kind])
        lanes = ["trainer"] + [f"worker {i}" for i in range(1, (r["workers"] or 0) + 1)]
        ax.set_yticks([0.4 + i for i in range(len(lanes))], lanes)
        ax.set_xlim(0, span)
        title = "TRL GRPOTrainer, 2 threads" if r["kind"] == "sync" else "AsyncGRPOTrainer, max_staleness 1"
        ax.set_title(f"{title}: blue train, orange generate, red reward scoring, grey trainer waiting", fontsize=8)
    axes[-1, 0].set_xlabel("seconds (balanced regime, after warm-up)")
    fig.tight_layout()
    fig.savefig(report.png_path("throughput_timeline"), dpi=110)


def main() -> None:
    import report

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="one repeat, fewer steps (~8 min)")
    parser.add_argument("--regimes", nargs="*", default=DEFAULT_REGIMES, help="`agentic` alone writes its own table")
    parser.add_argument("--ddp_run", help=argparse.SUPPRESS)  # one DDP rank, launched by launch_ddp
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--from_json", action="store_true", help="redraw tables and plots from results/*.json")
    cli = parser.parse_args()
    if cli.ddp_run:
        spec = json.loads(cli.ddp_run)
        name = spec.pop("regime")
        regime = next(g for g in REGIMES if g.name == name)
        row = run_one(regime, spec.pop("model_dir"), **spec)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(cli.result).write_text(json.dumps(row))
        return
    repeats, steps, warmup, curve_steps = (1, 6, 2, 200) if cli.quick else (2, 12, 3, 400)
    started = time.time()
    work = tempfile.mkdtemp(prefix="throughput_")
    rows, saved = [], None
    if cli.from_json:  # the measurements of the last run, summarised by the current code
        saved = json.loads((HERE / "results" / ("agentic.json" if cli.regimes == ["agentic"] else "throughput.json")).read_text())
        rows, started = saved["runs"], time.time() - saved["elapsed_s"]
        cli.quick, steps, warmup = saved.get("quick", False), saved["steps"], saved["warmup"]
        repeats = saved.get("repeats", 1 + max(r["seed"] for r in rows))  # the command's, not a regime's own
    for regime in [g for g in REGIMES if g.name in cli.regimes and saved is None]:
        model_dir = make_model(regime, os.path.join(work, regime.name))
        for rep in range(repeats if cli.quick else regime.repeats or repeats):  # interleaved: every config in turn
            for cfg in configs(regime, cli.quick) if rep % 2 == 0 else configs(regime, cli.quick)[::-1]:
                run = launch_ddp if cfg.get("processes", 1) > 1 else run_one
                n, w = (steps, warmup) if cli.quick else regime.steps or (steps, warmup)
                rows.append(run(regime, model_dir, steps=n, warmup=w, seed=rep, **cfg))
                r = rows[-1]
                print(f"{regime.name:12s} {label(r):24s} {r['wall_s']:.2f}s {r['tokens_per_s']:.0f} tokens/s "
                      f"start-up {r['startup_s']:.1f}s", flush=True)  # fmt: skip
    if cli.regimes == ["agentic"]:
        agentic_report(rows, *((steps, warmup) if cli.quick else REGIMES[-1].steps), started)
        return
    curves = saved["curves"] if saved else learning_curves(curve_steps)
    curve_steps = len(next(iter(curves.values()))["rewards"])
    summary = summarise(rows)
    validation = validate_simulator(rows)
    command = "python benchmarks/throughput.py" + (" --quick" if cli.quick else "")
    report.write_json("throughput", {"cores": CORES, "quick": cli.quick, "steps": steps, "warmup": warmup,
                                     "repeats": repeats,
                                     "command": command, "elapsed_s": time.time() - started,
                                     "summary": summary, "simulator_validation": validation,
                                     "curves": curves, "runs": rows})  # fmt: skip
    plots(rows, curves)
    table = report.markdown_table(
        ["regime", "trainer", "wall s", "samples/s", "tokens/s", "tokens/s vs best sync", "steps/s vs best sync",
         "trainer busy", "worker busy", "sync share", "efficiency", "start-up s", "end to end s",
         "separate-device ideal"],
        [[r["regime"], r["config"], r["wall_s"], r["samples_per_s"], r["tokens_per_s"], r["tokens_vs_best_sync"],
          r["speedup_vs_best_sync"], r["trainer_busy"], "-" if r["worker_busy"] is None else r["worker_busy"],
          r["sync_share"], r["efficiency"], r["startup_s"], r["end_to_end_s"], r["separate_device_ideal"]]
         for r in summary],
    )  # fmt: skip
    pct = lambda e: "-" if e is None else f"{100 * e:+.0f}%"  # noqa: E731
    sim_table = report.markdown_table(
        ["regime", "max_staleness", "scorers", "seed", "measured s/step", "fed: simulated s/step", "fed error",
         "predicted from balanced s/step", "predicted error"],
        [[v["regime"], v["staleness"], v["scoring_threads"], v["seed"], v["measured_s_per_step"],
          v["fed_s_per_step"], pct(v["fed_error"]), "-" if v["predicted_s_per_step"] is None
          else v["predicted_s_per_step"], pct(v["predicted_error"])] for v in validation],
    )  # fmt: skip
    final = {name: statistics.fmean(r for _, r in c["rewards"][-20:]) for name, c in curves.items()}
    regimes = "\n".join(f"- `{g.name}`: {g.what}; {regime_terms(g, cli.quick)}" for g in REGIMES if g.name in cli.regimes)
    report.update_readme(
        "throughput",
        f"### Throughput vs TRL's GRPOTrainer (`{command}`)\n\n{CORES} cores; batch {BATCH} = {BATCH // GROUP} "
        f"prompts × {GROUP}; {steps} measured steps after {warmup} warm-up and {repeats} interleaved repeat(s) (median) "
        "where a regime below sets no other; "
        f"{(time.time() - started) / 60:.0f} min in all. "
        "Async: trainer 1 thread + workers 1 thread each. Steady state (after warm-up): wall s, samples/s, tokens/s, "
        "the two 'vs best sync' ratios, busy and sync shares, efficiency. 'start-up s' = `train()` called to the "
        "first batch ready; 'end to end s' = trainer construction to the end of `train()`, warm-up included. "
        "'tokens/s vs best sync' = this tokens/s ÷ the best synchronous tokens/s (equal work whatever the sampled "
        "lengths); 'steps/s vs best sync' = best synchronous wall ÷ this wall; 'efficiency' = bound ÷ wall time, "
        "bound = max(single-core CPU work for this run's tokens ÷ cores, verifier sleep ÷ concurrent scorers); "
        "'separate-device ideal' = (G+T)/max(G,T).\n\n"
        f"{regimes}\n\n{table}\n\nSimulator (`benchmarks/simulate.py`): 'fed' = given this run's own measured "
        "generate-call, step, sync and scoring times (checks the scheduling rules only); 'predicted' = given the "
        "balanced regime's times of the same seed and staleness, scaled by (prompt + longest completion) tokens and "
        "the verifier's known latency, predicting another regime (a check it cannot pass by construction):\n\n"
        f"{sim_table}\n\nLearning on the tiny_demo task ({curve_steps} steps, same seed), mean "
        f"reward of the last 20 steps: "
        + ", ".join(f"{k} {v:.2f} in {curves[k]['wall_s']:.0f} s" for k, v in final.items())
        + "\n\n![](results/throughput.png)\n![](results/throughput_reward.png)\n![](results/throughput_timeline.png)",
    )
    print(table)
    print(sim_table)


def agentic_report(rows: list[dict], steps: int, warmup: int, started: float) -> None:
    """The agentic regime's own table, plot and JSON (results/agentic.*): mean and spread over the seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import report

    names = list(dict.fromkeys(label(r) for r in rows))
    by = {n: [r for r in rows if label(r) == n] for n in names}
    mean = lambda n, k: statistics.fmean(r[k] for r in by[n])  # noqa: E731
    sd = lambda n, k: statistics.stdev(r[k] for r in by[n]) if len(by[n]) > 1 else 0.0  # noqa: E731
    syncs = [n for n in names if not n.startswith("async")]
    best_tokens = max(mean(n, "tokens_per_s") for n in syncs)
    best_steps = max(steps / mean(n, "wall_s") for n in syncs)
    summary = [{"config": n, "seeds": len(by[n]), "wall_s": mean(n, "wall_s"), "steps_per_s": steps / mean(n, "wall_s"),
                "tokens_per_s": mean(n, "tokens_per_s"), "tokens_per_s_sd": sd(n, "tokens_per_s"),
                "tokens_vs_best_sync": mean(n, "tokens_per_s") / best_tokens,
                "steps_vs_best_sync": steps / mean(n, "wall_s") / best_steps,
                "tool_calls_per_step": mean(n, "tool_calls_per_step"),
                "trained_calls_per_episode": mean(n, "trained_calls_per_episode"),
                "trained_mean_length": statistics.fmean(r.get("trained_mean_length", float("nan")) for r in by[n]),
                "dropped_per_step": statistics.fmean(r.get("dropped_groups", 0) / (steps + warmup) for r in by[n]),
                "tool_sleep_share": mean(n, "tool_sleep_s") / mean(n, "wall_s"),
                "trainer_busy": mean(n, "trainer_busy"), "startup_s": mean(n, "startup_s"),
                "end_to_end_s": mean(n, "end_to_end_s")} for n in names]  # fmt: skip
    command = "python benchmarks/throughput.py --regimes agentic"
    report.write_json("agentic", {"cores": CORES, "steps": steps, "warmup": warmup, "command": command,
                                  "elapsed_s": time.time() - started, "summary": summary, "runs": rows})  # fmt: skip
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, [r["tokens_vs_best_sync"] for r in summary],
           yerr=[r["tokens_per_s_sd"] / best_tokens for r in summary], color="tab:blue")  # fmt: skip
    ax.axhline(1.0, color="k", lw=1)
    ax.axhline(2.0, color="tab:red", lw=1, ls="--", label="goal: 2x")
    ax.set(ylabel="tokens/s vs best sync", title="agentic regime: tool latency log-normal (median 0.1 s, p99 2 s)")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend()
    fig.tight_layout()
    fig.savefig(report.png_path("agentic"), dpi=110)
    table = report.markdown_table(
        ["trainer", "seeds", "wall s", "steps/s", "tokens/s", "± sd", "tokens/s vs best sync", "steps/s vs best sync",
         "tool calls / step", "calls per trained episode", "trained mean length", "tool sleep ÷ wall",
         "dropped groups / step",
         "trainer busy", "start-up s",
         "end to end s"],
        [[r["config"], r["seeds"], r["wall_s"], r["steps_per_s"], r["tokens_per_s"], r["tokens_per_s_sd"],
          r["tokens_vs_best_sync"], r["steps_vs_best_sync"], r["tool_calls_per_step"],
          r["trained_calls_per_episode"], r["trained_mean_length"], r["tool_sleep_share"],
          r["dropped_per_step"], r["trainer_busy"], r["startup_s"], r["end_to_end_s"]] for r in summary],
    )  # fmt: skip
    report.update_readme(
        "agentic",
        f"### Agentic regime (`{command}`)\n\n{agentic_task.__doc__.strip()}\n\n{CORES} cores; 4 prompts × 4 "
        f"episodes per step; {steps} measured steps after {warmup} warm-up; seeds {sorted({r['seed'] for r in rows})}, "
        f"interleaved, mean; {(time.time() - started) / 60:.0f} min in all. TRL's GRPOTrainer runs the same tool in "
        "its own loop (one call after another); AsyncGRPOTrainer runs episodes as they come (rollout_tool_threads "
        "16). 'tool sleep ÷ wall': the tool's latency summed over the measured steps, over the wall time (above 1: "
        "calls overlapped). 'window k': rollout_consumption_window=k, the trainer takes only groups admitted within k "
        "of the oldest one not yet trained (1: strict admission order); without it, groups train as they finish. "
        "The sync rows train every episode they generate: their calls per trained episode and mean length are the "
        "prompts' true mix.\n\n"
        f"{table}\n\n![agentic](results/agentic.png)",
    )
    print(table)


if __name__ == "__main__":
    main()
