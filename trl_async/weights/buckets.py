"""Weight buckets: consecutive tensors cut into groups of bounded size, the unit every weight transport sends (and,
under ZeRO-3, gathers) at a time. Imports only torch, so a vLLM server's environment loads it too."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

Buckets = Iterable[Sequence[tuple[str, torch.Tensor]]]  # each bucket: (name, tensor) pairs, sent as one


def plan_buckets(nbytes: Sequence[int], limit: int) -> list[range]:
    """Cut consecutive tensors of ``nbytes`` into buckets of at most ``limit`` bytes (a larger tensor alone)."""
    buckets, start, size = [], 0, 0
    for i, n in enumerate(nbytes):
        if i > start and size + n > limit:
            buckets.append(range(start, i))
            start, size = i, 0
        size += n
    if start < len(nbytes):
        buckets.append(range(start, len(nbytes)))
    return buckets
