"""Versions and staleness: the rule that bounds how old a trained sample may be, and every place it is applied, each
one pure function.

The guarantee is one check: no sample older than ``max_staleness`` trains (``trainable``, applied when the trainer
takes a batch, ``RolloutPool.take``). The others only save work and never decide what trains:
  * admission (``max_groups_admitted``, applied by ``rollout/admission.py``) starts no group that could only be
    consumed too stale, so generation runs at most ``max_staleness`` steps ahead;
  * a finished group that is already too stale for any future step is dropped before its reward calls
    (``too_stale_already``, ``RolloutPool``'s scoring threads);
  * the queue holds, by default, the groups of every batch the staleness bound lets run ahead
    (``default_queue_size``).

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


def trainable(consumer_version: int, token_versions: Iterable[int], max_staleness: int) -> bool:
    """The guarantee: a sample trains at ``consumer_version`` only if its staleness is at most ``max_staleness``."""
    return staleness(consumer_version, token_versions) <= max_staleness


def too_stale_already(published_version: int | None, token_versions: Iterable[int], max_staleness: int) -> bool:
    """Whether a finished group can no longer train: the trainer consumes at a version at least the newest one
    published, so a group older than that by more than ``max_staleness`` would only be dropped later, after its
    rewards. A direct difference, not ``staleness()``: a lane may sample with version v a moment before
    ``published_version`` records it. Nothing published yet: nothing is too stale."""
    return published_version is not None and published_version - min(token_versions) > max_staleness


def default_queue_size(max_staleness: int, steps_per_batch: int, groups_per_batch: int) -> int:
    """The groups admitted ahead of the trainer that the staleness bound allows: the current generation batch and
    every later one still fresh when consumed (``max_staleness // steps_per_batch`` of them), so that the queue, not
    admission, is never what holds generation back."""
    return (max_staleness // steps_per_batch + 1) * groups_per_batch
