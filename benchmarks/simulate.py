"""Discrete-event model of the trl_async pipeline: size a cluster before renting it.

Inputs are rates a user can measure or estimate: how long one worker's generate call takes, how long a training
step takes, the weight-sync cost, and the async knobs (workers, ``max_staleness``, queue size, sync frequency).
Output: predicted time per optimizer step, trainer and worker utilisation, the staleness distribution and drops.

The model follows the trainer's rules, not a generic queue: admission control is ``trl_async.rollout.staleness.
max_groups_admitted`` (AReaL's rule) capped by the queue size; a worker takes up to ``groups_per_call`` admitted
groups per generate call and samples them with the newest published version at the call's start (``batch`` weight
update); the trainer consumes ``groups_per_step`` groups per optimizer step in arrival order, drops groups staler than
``max_staleness`` (their slots are admitted again), trains, and publishes every ``weight_sync_steps`` steps, paying
``sync_s`` on the trainer. Finished groups are scored ``scorers`` at a time (``score_s`` each; the trainer process's
scoring threads, ``rollout_scoring_threads``) before the trainer can take them. One step per generation batch (GRPOTrainer's default).

    python benchmarks/simulate.py          # cluster-scale plots (throughput and staleness vs workers, max_staleness)

``benchmarks/throughput.py`` validates the model against measured CPU runs (it feeds the measured generate-call and
step durations in and compares the predicted time per step with the measured one).
"""

from __future__ import annotations

import heapq
import itertools
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trl_async.rollout.staleness import max_groups_admitted  # noqa: E402


@dataclass(frozen=True)
class Pipeline:
    workers: int
    gen_call_s: float | Sequence[float]  # one full generate call (``groups_per_call`` groups); a sequence is cycled
    groups_per_call: int
    train_step_s: float | Sequence[float]  # trainer compute per optimizer step, excluding waits and syncs
    groups_per_step: int
    max_staleness: int
    sync_s: float = 0.0
    weight_sync_steps: int = 1
    queue_size: int | None = None  # groups queued or in flight; None: (max_staleness + 1) batches, as the trainer
    score_s: float | Sequence[float] = 0.0  # reward latency per group, first come first served
    scorers: int = 1  # groups scored concurrently (rollout_scoring_threads)


@dataclass
class Prediction:
    step_end_s: list[float]  # time each optimizer step finished (publish included)
    trainer_busy_s: float  # training + syncing
    worker_calls: list[list[tuple[float, float]]]  # per worker: (start, end) of each generate call
    staleness: Counter = field(default_factory=Counter)  # consumed groups per staleness
    dropped_groups: int = 0

    def seconds_per_step(self, warmup: int = 0) -> float:
        """Steady-state time per step: steps after ``warmup`` (the pipeline fills during the first steps)."""
        ends = [0.0, *self.step_end_s]
        return (ends[-1] - ends[warmup]) / (len(ends) - 1 - warmup)

    @property
    def total_s(self) -> float:
        return self.step_end_s[-1]

    @property
    def trainer_utilisation(self) -> float:
        return self.trainer_busy_s / self.total_s

    @property
    def worker_utilisation(self) -> float:
        """Fraction of the run the workers spent generating (calls still running at the end count up to it)."""
        busy = sum(min(end, self.total_s) - start for calls in self.worker_calls for start, end in calls)
        return busy / (len(self.worker_calls) * self.total_s)

    @property
    def mean_staleness(self) -> float:
        n = sum(self.staleness.values())
        return sum(k * v for k, v in self.staleness.items()) / n


def _cycle(value: float | Sequence[float]):
    return itertools.cycle(value) if isinstance(value, Sequence) else itertools.repeat(value)


def simulate(p: Pipeline, steps: int) -> Prediction:
    """Run the pipeline for ``steps`` optimizer steps from an empty queue (version 0 published at time 0)."""
    if p.workers < 1 or p.groups_per_call < 1 or p.groups_per_step < 1 or steps < 1 or p.max_staleness < 0:
        raise ValueError("workers, groups_per_call, groups_per_step and steps must be >= 1, max_staleness >= 0")
    queue_size = p.queue_size or (p.max_staleness + 1) * p.groups_per_step
    gen_times, train_times, score_times = _cycle(p.gen_call_s), _cycle(p.train_step_s), _cycle(p.score_s)
    to_score: list[int] = []  # versions of generated groups waiting for the scorer
    scoring = 0  # groups being scored now
    published, admitted, consumed = 0, 0, 0
    ready: list[int] = []  # versions of finished groups, in arrival order
    idle_workers = list(range(p.workers))
    events: list[tuple[float, int, str, tuple]] = []  # (time, tie-break, kind, data)
    order = itertools.count()
    pred = Prediction(step_end_s=[], trainer_busy_s=0.0, worker_calls=[[] for _ in range(p.workers)])
    trainer_waiting_since: float | None = 0.0
    version = 0  # optimizer steps done

    def dispatch(now: float) -> None:
        nonlocal admitted
        while idle_workers:
            limit = min(max_groups_admitted(published, p.max_staleness, p.groups_per_step, 1), consumed + queue_size)
            k = min(p.groups_per_call, limit - admitted)
            if k <= 0:
                return
            w = idle_workers.pop(0)
            admitted += k
            duration = next(gen_times) * k / p.groups_per_call
            pred.worker_calls[w].append((now, now + duration))
            heapq.heappush(events, (now + duration, next(order), "generated", (w, k, published)))

    def try_train(now: float) -> None:
        nonlocal trainer_waiting_since, admitted
        fresh = []
        while ready and len(fresh) < p.groups_per_step:
            v = ready.pop(0)
            if version - v > p.max_staleness:
                admitted -= 1  # dropped: its prompt is generated again
                pred.dropped_groups += 1
            else:
                fresh.append(v)
        if len(fresh) < p.groups_per_step:
            ready[:0] = fresh  # not enough yet: keep them, in order
            return
        for v in fresh:
            pred.staleness[version - v] += 1
        trainer_waiting_since = None
        duration = next(train_times)
        if (version + 1) % p.weight_sync_steps == 0:
            duration += p.sync_s
        pred.trainer_busy_s += duration
        heapq.heappush(events, (now + duration, next(order), "trained", ()))

    def score_next(now: float) -> None:
        nonlocal scoring
        while to_score and scoring < p.scorers:
            scoring += 1
            heapq.heappush(events, (now + next(score_times), next(order), "scored", (to_score.pop(0),)))

    dispatch(0.0)
    while len(pred.step_end_s) < steps:
        now, _, kind, data = heapq.heappop(events)
        if kind == "generated":
            w, k, v = data
            if p.score_s:
                to_score.extend([v] * k)
            else:
                ready.extend([v] * k)
            idle_workers.append(w)
        elif kind == "scored":
            ready.append(data[0])
            scoring -= 1
        else:  # trained
            version += 1
            consumed += p.groups_per_step
            if version % p.weight_sync_steps == 0:
                published = version
            pred.step_end_s.append(now)
            if len(pred.step_end_s) == steps:
                break
            trainer_waiting_since = now
        if trainer_waiting_since is not None:
            try_train(now)
        score_next(now)
        dispatch(now)
    return pred


# ---- cluster-scale study -------------------------------------------------------------------------------------------

# Rates of the kind AReaL / PipelineRL report for a 7B model (ANCHORS.md): one inference server generates 8 groups
# (8 prompts x 16 completions, long reasoning traces) in ~60 s, the trainer needs ~40 s per step of 64 groups, and a
# weight sync costs ~5 s. Synchronous GRPO with S servers costs 8 * 60 / S + 40 + 5 s per step.
CLUSTER = dict(gen_call_s=60.0, groups_per_call=8, train_step_s=40.0, groups_per_step=64, sync_s=5.0)


def cluster_study(workers: Sequence[int] = (1, 2, 4, 8, 12, 16, 24, 32), staleness: Sequence[int] = (0, 1, 2, 4, 8)):
    rows = []
    for s in staleness:
        for n in workers:
            pred = simulate(Pipeline(workers=n, max_staleness=s, **CLUSTER), steps=60)
            rows.append(
                {
                    "workers": n,
                    "max_staleness": s,
                    "s_per_step": pred.seconds_per_step(warmup=10),
                    "trainer_util": pred.trainer_utilisation,
                    "worker_util": pred.worker_utilisation,
                    "mean_staleness": pred.mean_staleness,
                }
            )
    return rows


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import report

    rows = cluster_study()
    sync = {r["workers"]: r["s_per_step"] for r in rows if r["max_staleness"] == 0}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for s in sorted({r["max_staleness"] for r in rows}):
        mine = [r for r in rows if r["max_staleness"] == s]
        a1.plot([r["workers"] for r in mine], [3600 / r["s_per_step"] for r in mine], marker="o", label=f"η={s}")
        a2.plot([r["workers"] for r in mine], [r["mean_staleness"] for r in mine], marker="o", label=f"η={s}")
    bound = 3600 / (CLUSTER["train_step_s"] + CLUSTER["sync_s"])
    a1.axhline(bound, color="k", ls="--", lw=1, label="trainer-bound limit")
    a1.set(xlabel="inference workers", ylabel="optimizer steps / hour", title="throughput")
    a2.set(xlabel="inference workers", ylabel="mean staleness of consumed groups", title="staleness")
    a1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(report.png_path("simulate"), dpi=110)
    table = report.markdown_table(
        ["workers", "max_staleness", "s/step", "speed-up vs η=0", "trainer util", "worker util", "mean staleness"],
        [
            [
                r["workers"],
                r["max_staleness"],
                r["s_per_step"],
                sync[r["workers"]] / r["s_per_step"],
                r["trainer_util"],
                r["worker_util"],
                r["mean_staleness"],
            ]  # fmt: skip
            for r in rows
            if r["workers"] in (2, 8, 16, 32)
        ],
    )
    report.write_json("simulate", {"cluster": CLUSTER, "rows": rows})
    c = CLUSTER
    report.update_readme(
        "simulate",
        "### Pipeline simulator at cluster scale (`python benchmarks/simulate.py`)\n\n"
        f"Rates: one worker generates {c['groups_per_call']} groups in {c['gen_call_s']:.0f} s, a training step of "
        f"{c['groups_per_step']} groups takes {c['train_step_s']:.0f} s, a weight sync {c['sync_s']:.0f} s. "
        "η = `max_staleness`; η = 0 is synchronous GRPO (generation and training alternate).\n\n"
        f"{table}\n\n![](results/simulate.png)",
    )
    print(table)


if __name__ == "__main__":
    main()
