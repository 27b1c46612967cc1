"""Prompt source: dataset rows in the order GRPOTrainer's sampler gives them, one entry per group.

GRPOTrainer's ``RepeatSampler`` shuffles with ``args.seed``, cuts each permutation into generation batches of
``generation_batch_size // num_generations`` unique prompts (dropping an incomplete last batch), and repeats each
batch for ``num_iterations * steps_per_generation`` micro-steps. The rollout workers need each unique prompt once, so
this stream walks the same sampler with ``repeat_count=1``: the same permutations, epoch after epoch, forever (the
trainer's own loop decides when training stops).

An ``IterableDataset`` cannot be indexed: ``StreamedRows`` reads it in the order GRPOTrainer's loop reads it (a seeded
buffered shuffle, then ``repeat_iterable_dataset`` cutting generation batches, reshuffled each epoch) and keeps each
row under its draw number until its prompt is trained on, so the stream's "rows" are those draw numbers.

Every draw has a *position* (its ordinal in that endless sequence). A dropped (too stale) group is pushed back to
the front with its position, so its prompt is generated again rather than lost. Groups finish out of order (several
workers, concurrent scoring), so the prompts a checkpoint has trained on need not be a prefix of the sequence: the
stream records the version at which each position was taken for training, and ``progress`` summarises what is done
as "every position below ``next_position``, plus ``consumed_after``". A stream built from that summary skips exactly
those positions, so a resumed run neither repeats nor skips prompts.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from trl.trainer.utils import RepeatSampler, repeat_iterable_dataset

TOO_FEW = (
    "train_dataset has {rows} rows but one generation batch needs {needed} distinct prompts "
    "(generation_batch_size // num_generations); add rows or lower generation_batch_size"
)


class StreamedRows:
    """An ``IterableDataset``'s rows for the rollout workers, in GRPOTrainer's order for it: shuffled with ``seed``
    in a buffer (``IterableDataset.shuffle``) when ``shuffle``, cut into generation batches of ``groups_per_batch``
    rows with an incomplete last batch dropped (``repeat_iterable_dataset``), reshuffled each epoch (``set_epoch``),
    forever. Each row is kept under its draw number (``draws``) until :meth:`release`."""

    def __init__(self, dataset, groups_per_batch: int, shuffle: bool, seed: int) -> None:
        self.groups_per_batch = groups_per_batch
        source = dataset.shuffle(seed=seed) if shuffle else dataset
        self._batches = repeat_iterable_dataset(source, mini_repeat_count=1, batch_size=groups_per_batch)
        self._rows: dict[int, Any] = {}
        self._lock = threading.Lock()

    def draws(self) -> Iterator[int]:
        drawn = 0
        for epoch in itertools.count():
            self._batches.set_epoch(epoch)
            first = drawn
            for row in self._batches:
                with self._lock:
                    self._rows[drawn] = row
                yield drawn
                drawn += 1
            if drawn == first:  # not one whole generation batch in an epoch
                raise ValueError(TOO_FEW.format(rows="fewer", needed=self.groups_per_batch))

    def __getitem__(self, draw: int):
        with self._lock:
            return self._rows[draw]

    def release(self, draws: Iterable[int]) -> None:
        with self._lock:
            for draw in draws:
                self._rows.pop(draw, None)

    def __len__(self) -> int:  # rows held: those drawn and not yet trained on
        return len(self._rows)


class PromptStream:
    def __init__(
        self,
        num_rows: int | StreamedRows,
        groups_per_batch: int,
        shuffle: bool,
        seed: int,
        skip_batches: int = 0,
        progress: dict | None = None,
    ) -> None:
        """``num_rows``: a map-style dataset's length, or the ``StreamedRows`` of an iterable one (its draw numbers are
        then the rows). ``progress`` (from :meth:`progress` of the interrupted run) takes precedence over
        ``skip_batches`` (the in-order fallback for a checkpoint that has none)."""
        self._streamed = num_rows if isinstance(num_rows, StreamedRows) else None
        if self._streamed is not None:
            self._indices = self._streamed.draws()
        else:
            if num_rows < groups_per_batch:
                raise ValueError(TOO_FEW.format(rows=num_rows, needed=groups_per_batch))
            self._sampler = RepeatSampler(
                range(num_rows), mini_repeat_count=1, batch_size=groups_per_batch, shuffle=shuffle, seed=seed
            )
            self._indices = self._forever()
        self._front: deque[tuple[int, int]] = deque()
        self._lock = threading.Lock()
        if progress is None:
            progress = {"next_position": skip_batches * groups_per_batch, "consumed_after": []}
        self._below = int(progress["next_position"])  # every position below this one is done (and forgotten)
        self._taken: dict[int, int] = dict.fromkeys(progress["consumed_after"], -1)  # position -> version taken at
        self._drawn = 0
        for _ in range(self._below):
            self._release([next(self._indices)])
            self._drawn += 1

    def _forever(self) -> Iterator[int]:
        while True:
            yield from self._sampler

    def next(self) -> tuple[int, int]:
        """The next prompt to generate: ``(position, dataset row)``."""
        with self._lock:
            if self._front:
                return self._front.popleft()
            while True:
                position, row = self._drawn, next(self._indices)
                self._drawn += 1
                if position not in self._taken:  # not trained on before the resume
                    return position, row
                self._release([row])

    def next_index(self) -> int:
        return self.next()[1]

    def push_front(self, position: int, row: int) -> None:
        with self._lock:
            self._front.appendleft((position, row))

    def taken(self, positions: Iterable[int], version: int) -> None:
        """The trainer took these positions for training at policy ``version``."""
        positions = list(positions)
        with self._lock:
            for p in positions:
                self._taken[p] = version
        self._release(positions)  # a streamed row's draw number is its position

    def _release(self, rows: Iterable[int]) -> None:
        if self._streamed is not None:
            self._streamed.release(rows)

    def progress(self, done_up_to_version: int) -> dict:
        """Positions whose training is complete (taken at a version <= ``done_up_to_version``), as a small JSON-able
        summary; positions below the new watermark are forgotten."""
        with self._lock:
            done = {p for p, v in self._taken.items() if v <= done_up_to_version}
            while self._below in done:
                del self._taken[self._below]
                done.discard(self._below)
                self._below += 1
            return {"next_position": self._below, "consumed_after": sorted(done)}
