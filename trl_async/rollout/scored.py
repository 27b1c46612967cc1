"""What the pool hands the trainer: scored groups, and what one ``take`` observed (trainer side only)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..records import RolloutGroup


@dataclass(frozen=True, slots=True)
class ScoredGroup:
    group: RolloutGroup
    staleness: int = 0
    rewards: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # (num_generations, num_reward_funcs)
    extra_logs: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    # the dataset row as read once, when the group was admitted: what the workers sampled from, the rewards scored and
    # GRPOTrainer trains on (a row read again can differ: a template printing the date, a random transform)
    row: dict = field(default_factory=dict)


@dataclass
class TakeStats:
    """What one ``take`` observed; the trainer logs it under ``async/``."""

    staleness: list[int]
    queue_size: int
    wait_s: float
    dropped_samples_total: int
    gen_tokens_per_s: float
    filtered_groups_total: int | None = None  # dynamic_sampling: groups dropped for no signal (None: off)
    filtered_since: int = 0  # of those, since the previous take
    kept_since: int = 0  # groups scored and kept since the previous take
    lanes_healthy: int | None = None  # lanes taking work (workers alive; vLLM servers attached)


@dataclass
class TakeTally:
    """What happened between two takes (groups scored, their tokens, groups filtered), turned into the next take's
    ``TakeStats``. The pool calls it under its lock."""

    tokens: int = 0  # sampled tokens of the groups scored
    filtered: int = 0  # dynamic_sampling: groups dropped for no signal
    kept: int = 0  # dynamic_sampling: groups scored and kept
    since: float = field(default_factory=time.perf_counter)  # when the previous take returned

    def close(self, taken: list[ScoredGroup], now: float, **observed) -> TakeStats:
        """The stats of a take that returned ``taken`` at ``now`` (``time.perf_counter``); the tally starts over.
        ``observed``: the rest of ``TakeStats``, as the pool saw it."""
        stats = TakeStats(
            staleness=[g.staleness for g in taken for _ in g.group.completion_ids],
            gen_tokens_per_s=self.tokens / max(now - self.since, 1e-9),
            filtered_since=self.filtered,
            kept_since=self.kept,
            **observed,
        )
        self.tokens = self.filtered = self.kept = 0
        self.since = now
        return stats
