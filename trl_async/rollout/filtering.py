"""Dynamic sampling (DAPO's "dynamic sampling", ``dynamic_sampling=True``): a scored group whose rewards cannot give
any completion a non-zero advantage trains nothing, so it is dropped before it takes a batch slot and the pool
generates another prompt in its place.

When a group has no signal follows GRPOTrainer's advantage computation (``_generate_and_score_completions``, TRL
1.16), which gives every row of such a group an advantage of exactly 0:
  * ``sum_then_normalize`` (its default): the weighted sum of the reward functions (NaN counted as 0, as ``nansum``;
    a row every function left unscored is left out, as GRPOTrainer leaves it out) is the same for every scored row,
    or fewer than two rows are scored. ``scale_rewards`` does not change this: the group mean is subtracted first.
  * ``normalize_then_sum``: each reward function is normalised within the group first, ``(r - mean) / (std +
    1e-4)``, then weighted and summed; the group has no signal when that sum is the same on every scored row (a
    function that is constant, or has weight 0, contributes nothing; two that vary in opposite ways can cancel).
"Equal" is exact equality or GRPOTrainer's own test for ``frac_reward_zero_std`` (``torch.isclose`` of the group's
std to 0); after normalising, values within 1e-6 (float rounding).
With ``beta > 0`` such a group would still have contributed its KL term; DAPO filters it regardless (and has no KL).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.utils import logging
from trl.trainer.utils import nanstd

logger = logging.get_logger(__name__)


def _constant(values: torch.Tensor) -> bool:
    """Equal over the scored rows (NaN: not scored): exactly, or as GRPOTrainer's ``frac_reward_zero_std`` tests it
    (``torch.isclose`` of the std to 0); fewer than two scored rows give an advantage of 0 too."""
    values = values[~values.isnan()]
    if values.numel() < 2 or bool(values.max() == values.min()):
        return True
    return bool(torch.isclose(nanstd(values), torch.zeros((), dtype=values.dtype)))


def without_signal(rewards: torch.Tensor, weights: torch.Tensor, aggregation: str = "sum_then_normalize") -> bool:
    """Whether a group's rewards (``(num_generations, num_reward_funcs)``, NaN = not scored) give every completion an
    advantage of 0 under GRPOTrainer's ``multi_objective_aggregation``."""
    if not rewards.is_floating_point():
        rewards = rewards.float()
    unscorable = rewards.isnan().all(dim=1)
    if aggregation == "normalize_then_sum":  # each function normalised within the group, then the weighted sum
        mean, std = torch.nanmean(rewards, dim=0, keepdim=True), nanstd(rewards, dim=0, keepdim=True)
        rewards = (rewards - mean) / (std + 1e-4)
    summed = (rewards * weights.to(rewards).unsqueeze(0)).nansum(dim=1)
    summed[unscorable] = torch.nan  # unscorable rows are not part of the group's baseline
    if aggregation == "normalize_then_sum":  # values of order 1 after normalising: rounding, not signal, below 1e-6
        scored = summed[~summed.isnan()]
        return scored.numel() < 2 or bool((scored.max() - scored.min()).abs() <= 1e-6)
    return _constant(summed)


class SignalFilter:
    """Keeps the groups that can train (``keep``, called by the pool's scoring threads under its lock) and counts the
    rest. A long run of groups without signal is a saturated task or a reward that is constant by mistake: a warning
    after every ``WARN_EVERY_BATCHES`` generation batches' worth of them in a row, and an error after
    ``limit_batches`` batches' worth (``None``: never), rather than generating forever while the trainer waits."""

    WARN_EVERY_BATCHES = 5

    def __init__(
        self,
        weights: torch.Tensor,
        aggregation: str,
        reward_names: Sequence[str],
        groups_per_batch: int,
        limit_batches: int | None,
    ) -> None:
        self.weights = weights.detach().float().cpu()
        self.aggregation = aggregation
        self.reward_names = list(reward_names)
        self.groups_per_batch = groups_per_batch
        self.limit_batches = limit_batches
        self.filtered = 0  # groups dropped so far
        self.in_a_row = 0

    def keep(self, rewards: torch.Tensor) -> bool:
        if not without_signal(rewards, self.weights, self.aggregation):
            self.in_a_row = 0
            return True
        self.filtered += 1
        self.in_a_row += 1
        if self.limit_batches is not None and self.in_a_row >= self.limit_batches * self.groups_per_batch:
            raise RuntimeError(
                f"{self._many()}; stopping (dynamic_sampling_limit={self.limit_batches} generation "
                "batches' worth). Check the reward functions, or raise dynamic_sampling_limit "
                "(None: no limit)"
            )
        if self.in_a_row % (self.WARN_EVERY_BATCHES * self.groups_per_batch) == 0:
            logger.warning("%s; they are dropped and other prompts generated (dynamic_sampling)", self._many())
        return False

    def _many(self) -> str:
        weights = ", ".join(
            f"{n} (weight {w:g})" for n, w in zip(self.reward_names, self.weights.tolist(), strict=True)
        )
        return (
            f"dynamic_sampling: the last {self.in_a_row} scored groups in a row gave every completion the same "
            f"reward ({self.aggregation} of {weights}), so none of them can train: the task may be saturated "
            "(every completion right, or every one wrong) or a reward function constant by mistake"
        )
