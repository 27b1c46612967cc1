"""What a user watches while an async run trains, and the summary it ends with.

``AsyncProgressCallback`` is transformers' own ``ProgressCallback`` (same bar, same log lines) with the live state of
the pipeline in the bar's postfix after every optimizer step: the mean reward of the batch just consumed, its mean
staleness and how many scored groups were waiting in the queue. ``run_summary`` condenses ``state.log_history``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from transformers.trainer_callback import ProgressCallback


class AsyncProgressCallback(ProgressCallback):
    """``ProgressCallback`` plus ``reward``, ``staleness`` and ``queue`` in the postfix (main process only).

    ``live`` returns the latest values (an empty dict before the first batch is consumed)."""

    def __init__(self, live: Callable[[], dict[str, float]], max_str_len: int = 100) -> None:
        super().__init__(max_str_len)
        self.live = live
        self.last_postfix: dict[str, float] = {}

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        if state.is_world_process_zero and self.training_bar is not None:
            values = self.live()
            if values:
                self.last_postfix = dict(values)
                self.training_bar.set_postfix(
                    {k: f"{v:.3g}" if isinstance(v, float) else v for k, v in values.items()}, refresh=False
                )


def run_summary(log_history: list[dict], train_seconds: float, samples_per_step: int) -> dict[str, float]:
    """One dict for the end of a run, from the Trainer's ``log_history`` (GRPOTrainer's and trl_async's metrics).

    ``reward_first``/``reward_last`` are the first and last logged mean rewards; staleness and waits are means over
    the logged steps; ``dropped_stale_samples`` is the run's total."""
    logs = [h for h in log_history if "reward" in h]
    steps = max((h.get("step", 0) for h in log_history), default=0)
    summary: dict[str, float] = {
        "steps": steps,
        "train_seconds": round(train_seconds, 1),
        "samples_per_s": round(steps * samples_per_step / train_seconds, 1) if train_seconds > 0 else 0.0,
    }
    if logs:
        summary["reward_first"] = round(logs[0]["reward"], 3)
        summary["reward_last"] = round(logs[-1]["reward"], 3)
    asynchronous = [h for h in logs if "async/staleness_max" in h]
    if asynchronous:
        summary["staleness_mean"] = round(statistics.fmean(h["async/staleness_mean"] for h in asynchronous), 2)
        summary["staleness_max"] = max(h["async/staleness_max"] for h in asynchronous)
        summary["dropped_stale_samples"] = asynchronous[-1]["async/dropped_stale"]
        summary["trainer_wait_s_per_step"] = round(
            statistics.fmean(h["async/trainer_wait_s"] for h in asynchronous), 4
        )
    return summary


def samples_per_step(args, num_processes: int) -> int:
    """Completions consumed per optimizer step (GRPO's batch sizes count completions)."""
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * num_processes


def print_summary(title: str, summary: dict) -> None:
    print(f"\n=== {title} ===")
    for key, value in summary.items():
        print(f"{key:>26}: {value}")


def batch_metrics(stats, groups, max_staleness: int, worker_restarts: int, abandoned_groups: int | None) -> dict:
    """The ``async/`` metrics of one consumed generation batch (``stats``: the pool's ``TakeStats``)."""
    staleness = stats.staleness
    out = {"async/staleness_mean": sum(staleness) / len(staleness), "async/staleness_max": max(staleness)}
    for k in range(max_staleness + 1):  # histogram: samples per staleness in this batch
        out[f"async/staleness_k{k}"] = staleness.count(k)
    out.update(
        {
            "async/queue_size": stats.queue_size,
            "async/trainer_wait_s": stats.wait_s,
            "async/dropped_stale": stats.dropped_samples_total,
            "async/gen_tokens_per_s": stats.gen_tokens_per_s,
            # reward functions that returned None/NaN: GRPOTrainer ignores those values (nansum), we count them
            "async/reward_nan": sum(int(g.rewards.isnan().sum()) for g in groups),
            "async/worker_restarts": worker_restarts,
        }
    )
    if stats.lanes_healthy is not None:  # workers alive, vLLM servers attached (not down, not yet re-attached)
        out["async/lanes_healthy"] = stats.lanes_healthy
    if stats.filtered_groups_total is not None:  # dynamic_sampling: groups dropped for having no signal
        out["async/filtered_groups"] = stats.filtered_groups_total
        # of the groups scored since the previous batch was taken, the fraction filtered
        scored = stats.filtered_since + stats.kept_since
        out["async/filtered_frac"] = stats.filtered_since / scored if scored else 0.0
    if abandoned_groups is not None:  # environments: groups skipped because their reset raised
        out["async/abandoned_groups"] = abandoned_groups
    return out
