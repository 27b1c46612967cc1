"""Versions, staleness and admission control: the subtle rules, each one pure function.

Definitions:
  * a policy version is the number of optimizer steps applied to the weights (``trainer.state.global_step`` when they
    were published);
  * a token's staleness is ``consumer_version - token_version``, where ``consumer_version`` is the trainer's version
    at the optimizer step that consumes the token (the step whose ``_generate_and_score_completions`` pulls it);
  * a sample's (and a group's) staleness is the maximum over its tokens, i.e. that of its oldest token.
"""

from __future__ import annotations

from collections.abc import Iterable


def staleness(consumer_version: int, token_versions: Iterable[int]) -> int:
    """Staleness of a sample: ``consumer_version - min(token_versions)``.

    Off-by-one written down: a token sampled with the weights the trainer holds right now has staleness 0, so with
    ``max_staleness=0`` every sample is exactly on-policy (synchronous GRPO). A token from version ``v`` consumed at
    version ``v + 1`` (one optimizer step happened in between) has staleness 1.

    A token can never come from a version newer than the consumer; that would mean a worker holds weights the trainer
    has not produced yet, so it raises.
    """
    oldest = min(token_versions, default=None)
    if oldest is None:
        raise ValueError("a sample must have at least one token to have a staleness")
    s = consumer_version - oldest
    if s < 0:
        raise ValueError(f"token version {oldest} is newer than the consuming trainer version {consumer_version}")
    return s


def max_groups_admitted(
    published_version: int, max_staleness: int, groups_per_batch: int, steps_per_batch: int, start_version: int = 0
) -> int:
    """How many groups may have been admitted (consumed + queued + in flight, not counting drops) in total, once
    ``published_version`` is the newest version the workers can load. AReaL's admission rule, in batches.

    The trainer consumes one generation batch of ``groups_per_batch`` groups every ``steps_per_batch`` optimizer steps,
    starting at ``start_version`` (0, or the step the run resumed at: GRPOTrainer generates a fresh batch at the
    resumed step even inside a generation batch), so the ``i``-th batch of this run is consumed at version
    ``start_version + i * steps_per_batch``. A group generated now, with version ``>= published_version``, is fresh
    when consumed in batch ``i`` iff ``start_version + i * steps_per_batch - published_version <= max_staleness``, i.e.
    ``i <= (published_version + max_staleness - start_version) // steps_per_batch``. Batches ``0 .. that i`` hold the
    returned number of groups; groups are consumed in admission order, so admitting one more could only be consumed
    too late.

    Example: ``max_staleness=0``, one step per batch, 4 groups per batch: with version 0 published, 4 groups (batch 0)
    may be admitted; after step 1 is published, 8 in total: generation and training alternate, as in sync GRPO.
    Resumed at step 3 with 2 steps per batch: batches are consumed at versions 3, 5, 7, ... (not 4, 6, ...).
    """
    if min(max_staleness, published_version, start_version) < 0 or groups_per_batch < 1 or steps_per_batch < 1:
        raise ValueError("versions and max_staleness must be >= 0; groups_per_batch and steps_per_batch >= 1")
    last_fresh_batch = (published_version + max_staleness - start_version) // steps_per_batch
    return max(0, last_fresh_batch + 1) * groups_per_batch
