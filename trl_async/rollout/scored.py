"""What the pool hands the trainer: scored groups, and what one ``take`` observed (trainer side only)."""

from __future__ import annotations

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
