"""The admission ledger: how many groups are admitted, consumed and in flight, and how many more may start.

Admission control bounds what is generated ahead of the trainer two ways: by staleness (``max_groups_admitted``,
AReaL's rule: no group is admitted that could only be consumed too stale) and by memory (``queue_size``: groups
admitted but not yet consumed). A group that leaves without training (dropped as stale, filtered by dynamic sampling,
abandoned, or handed back by a lost lane to be generated again) returns its slot.

Not thread-safe by itself: the pool calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .staleness import max_groups_admitted, too_stale_already


@dataclass
class AdmissionLedger:
    groups_per_batch: int  # B: groups the trainer consumes per generation batch
    steps_per_batch: int  # k: optimizer steps per generation batch
    max_staleness: int
    queue_size: int  # most groups admitted but not yet consumed
    start_version: int = 0  # trainer version when the pool starts (0, or the resumed global step)
    published: int | None = None  # the newest version workers can load (None: nothing published, nothing admitted)
    admitted: int = 0  # groups admitted and not returned (trained ones included)
    consumed: int = 0  # groups trained on

    def limit(self) -> int:
        """Groups that may have been admitted in total, under both bounds."""
        if self.published is None:
            return 0
        by_staleness = max_groups_admitted(
            self.published, self.max_staleness, self.groups_per_batch, self.steps_per_batch, self.start_version
        )
        return min(by_staleness, self.consumed + self.queue_size)

    def room(self) -> int:
        """How many more groups may be admitted now."""
        return max(0, self.limit() - self.admitted)

    def admit(self, n: int) -> None:
        if n > self.room():
            raise ValueError(f"admitting {n} groups with room for {self.room()}")
        self.admitted += n

    def give_back(self, n: int = 1) -> None:
        """``n`` admitted groups leave without training: their slots go to new prompts."""
        if n > self.in_flight:
            raise ValueError(f"giving back {n} groups with {self.in_flight} in flight")
        self.admitted -= n

    def consume(self, n: int) -> None:
        if n > self.in_flight:
            raise ValueError(f"consuming {n} groups with {self.in_flight} in flight")
        self.consumed += n

    @property
    def in_flight(self) -> int:
        """Admitted and not yet consumed: queued, being generated or scored, or ready."""
        return self.admitted - self.consumed

    def too_stale_already(self, token_versions: Iterable[int]) -> bool:
        """Whether a finished group can no longer train at any step from the newest published version on
        (``staleness.too_stale_already``)."""
        return too_stale_already(self.published, token_versions, self.max_staleness)
