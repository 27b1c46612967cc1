"""The bookkeeping of a continuously batching worker: tasks split into rows that wait for a slot, and groups that
leave as soon as their last row finishes, whatever else is still decoding.

A task is ``num_generations`` rows of one prompt, or one row per context of a later turn, each with its own token
budget. Both continuous loops (``slots.py``, ``continuous.py``) take rows from here and hand finished rows back.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...records import RolloutGroup, RolloutTask


def cut_at_eos(tokens: Sequence[int], eos: set[int], budget: int | None) -> int:
    """How many of ``tokens`` a completion keeps: through its first EOS, at most ``budget``."""
    length = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return length if budget is None else min(length, budget)


@dataclass(frozen=True)
class WaitingRow:
    request: str  # unique while the row is in flight
    ids: tuple[int, ...]  # the context it continues
    budget: int  # the most tokens it may generate


@dataclass
class _Pending:
    task: RolloutTask
    rows: list  # per row: (token ids, log-probs, versions), filled as rows finish
    started_at: float
    left: int


@dataclass
class RowGroups:
    num_generations: int
    max_new_tokens: int
    lane_id: int = 0
    waiting: deque = field(default_factory=deque)  # WaitingRow, in arrival order
    pending: dict = field(default_factory=dict)  # task key -> _Pending
    rows_of: dict = field(default_factory=dict)  # request -> (task key, row)
    active: int = 0  # rows decoding
    occupancy: deque = field(default_factory=lambda: deque(maxlen=100_000))  # (time.time(), rows decoding) per change

    @property
    def busy(self) -> bool:
        return bool(self.pending)

    def add(self, tasks: Sequence[RolloutTask]) -> None:
        now = time.time()
        for task in tasks:
            contexts = [tuple(c) for c in task.contexts] or [tuple(task.prompt_ids)] * self.num_generations
            budget = task.max_new_tokens or self.max_new_tokens
            self.pending[task.key] = _Pending(task, [None] * len(contexts), now, len(contexts))
            for row, ids in enumerate(contexts):
                request = f"{task.group_id}/{'.'.join(map(str, task.rows))}/{row}"
                self.rows_of[request] = (task.key, row)
                self.waiting.append(WaitingRow(request, ids, budget))

    def take(self, free: int) -> list[WaitingRow]:
        """Up to ``free`` waiting rows, which start decoding now."""
        taken = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
        if taken:
            self.active += len(taken)
            self.occupancy.append((time.time(), self.active))
        return taken

    def row_done(self, request: str, tokens, logprobs, versions) -> RolloutGroup | None:
        """A finished row (already cut at its EOS and budget); returns its group once that was the last row."""
        key, row = self.rows_of.pop(request)
        self.active -= 1
        self.occupancy.append((time.time(), self.active))
        pending = self.pending[key]
        pending.rows[row] = (tuple(tokens), tuple(float(x) for x in logprobs), tuple(versions))
        pending.left -= 1
        if pending.left:
            return None
        del self.pending[key]
        task = pending.task
        ids, logps, row_versions = zip(*pending.rows, strict=True)
        return RolloutGroup(
            group_id=task.group_id,
            prompt_index=task.prompt_index,
            prompt_ids=task.prompt_ids,
            completion_ids=ids,
            logprobs=logps,
            versions=row_versions,
            lane_id=self.lane_id,
            generate_s=time.time() - pending.started_at,
            generate_started_at=pending.started_at,
            rows=task.rows,
        )


class RowsFront:
    """What the worker's loop (``serve_continuously``) reads of a continuous engine, from its ``book``."""

    book: RowGroups

    @property
    def busy(self) -> bool:
        return self.book.busy

    @property
    def active(self) -> int:
        return self.book.active

    @property
    def waiting(self) -> deque:
        return self.book.waiting

    @property
    def occupancy(self) -> deque:
        return self.book.occupancy
