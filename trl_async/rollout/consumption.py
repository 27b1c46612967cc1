"""Which ready group the trainer takes next: arrival order, or admission order within a bounded lag.

In arrival order (the default, ``rollout_consumption_window=None``) a group that finishes first trains first. A long
episode (many turns, slow tools, a long completion) then trains late: shorter ones overtake it while it grows stale,
and it is dropped and generated again, or never trains. The trained mix leans toward what finishes fast.

With a window of ``k`` groups, the trainer takes a ready group only if it was admitted less than ``k`` groups after
the oldest group still pending (admitted, not yet trained or dropped): the oldest one is overtaken by at most
``k - 1`` others, whatever its length. ``k = 1`` is strict admission order, which is what admission control
(``staleness.max_groups_admitted``) assumes; the price is waiting for the oldest group when it is the slow one.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


def next_ready(ready_ids: Sequence[int], pending_ids: Collection[int], window: int | None) -> int | None:
    """The index into ``ready_ids`` (ready groups' ids in arrival order) of the group to take next, or None to wait.

    ``pending_ids``: the ids of every group admitted and not yet taken or dropped (the ready ones included); ids grow
    in admission order. ``window``: None for arrival order, else ``k`` as above.
    """
    if not ready_ids:
        return None
    if window is None:
        return 0
    limit = min(pending_ids) + window
    candidates = [(gid, i) for i, gid in enumerate(ready_ids) if gid < limit]
    return min(candidates)[1] if candidates else None
