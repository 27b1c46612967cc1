"""Prompt source: dataset rows in the order GRPOTrainer's sampler gives them, one entry per group.

GRPOTrainer's ``RepeatSampler`` shuffles with ``args.seed``, cuts each permutation into generation batches of
``generation_batch_size // num_generations`` unique prompts (dropping an incomplete last batch), and repeats each
batch for ``num_iterations * steps_per_generation`` micro-steps. The rollout workers need each unique prompt once, so
this stream walks the same sampler with ``repeat_count=1``: the same permutations, epoch after epoch, forever (the
trainer's own loop decides when training stops).

An ``IterableDataset`` cannot be indexed: ``StreamedRows`` reads it, on a thread of its own, in the order GRPOTrainer's
loop reads it in one process (a seeded buffered shuffle, then ``repeat_iterable_dataset`` cutting generation batches,
reshuffled each epoch) and keeps each row under its draw number until its prompt is trained on, so the stream's
"rows" are those draw numbers.

Every draw has a *position* (its ordinal in that endless sequence). A dropped (too stale) group is pushed back to
the front with its position, so its prompt is generated again rather than lost. Groups finish out of order (several
workers, concurrent scoring), so the prompts a checkpoint has trained on need not be a prefix of the sequence: the
stream records the version at which each position was taken for training, and ``progress`` summarises what is done
as "every position below ``next_position``, plus ``consumed_after``". A stream built from that summary skips exactly
those positions, so a resumed run neither repeats nor skips prompts.
"""

from __future__ import annotations

import copy
import itertools
import queue
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from trl.trainer.utils import RepeatSampler, repeat_iterable_dataset

TOO_FEW = (
    "train_dataset has {rows} rows but one generation batch needs {needed} distinct prompts "
    "(generation_batch_size // num_generations); add rows or lower generation_batch_size"
)


class StreamedRows:
    """An ``IterableDataset``'s rows for the rollout workers, in the order GRPOTrainer's loop reads it in one process:
    shuffled with ``seed`` in a buffer (``IterableDataset.shuffle``) when ``shuffle``, cut into generation batches of
    ``groups_per_batch`` rows with an incomplete last batch dropped (``repeat_iterable_dataset``), reshuffled each epoch
    (``set_epoch``), forever.

    A thread of its own reads the stream up to ``ahead`` rows ahead of the workers, so a slow read (the network, the
    dataset's map functions, a shuffle buffer's refill) holds no lock of the pool. Each row is kept under its draw
    number until :meth:`release`; draws already trained on (before a resume) are read there and dropped."""

    def __init__(self, dataset, groups_per_batch: int, shuffle: bool, seed: int, ahead: int | None = None) -> None:
        self.groups_per_batch = groups_per_batch
        source = dataset.shuffle(seed=seed) if shuffle else dataset
        self._batches = repeat_iterable_dataset(source, mini_repeat_count=1, batch_size=groups_per_batch)
        self._ready: queue.Queue = queue.Queue(maxsize=ahead or 2 * groups_per_batch)
        self._rows: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, done: Callable[[int], bool]) -> None:
        """Start reading; a draw for which ``done(draw)`` holds is read and dropped."""
        self._thread = threading.Thread(target=self._read, args=(done,), name="trl_async-stream", daemon=True)
        self._thread.start()

    def _read(self, done: Callable[[int], bool]) -> None:
        try:
            drawn = 0
            for epoch in itertools.count():
                self._batches.set_epoch(epoch)
                first = drawn
                for row in self._batches:
                    if self._stop.is_set():
                        return
                    if not done(drawn):
                        with self._lock:
                            self._rows[drawn] = row
                        self._put(drawn)
                    drawn += 1
                if drawn == first:
                    raise ValueError(
                        "train_dataset (an iterable dataset) gave no whole generation batch in an epoch: one needs "
                        f"{self.groups_per_batch} distinct prompts (generation_batch_size // num_generations); add "
                        "rows or lower generation_batch_size"
                    )
        except BaseException as exc:  # noqa: BLE001 - raised where the next draw is taken
            self._put(exc)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def ready(self) -> int:
        """Draws read and waiting to be generated."""
        return self._ready.qsize()

    def next_draw(self) -> int:
        """The next draw number (waits for the reader); what the reader raised, raised here."""
        item = self._ready.get()
        if isinstance(item, BaseException):
            self._ready.put(item)  # every later draw raises it too
            raise item
        return item

    def __getitem__(self, draw: int):
        with self._lock:
            row = self._rows[draw]
        return copy.deepcopy(row)  # a fresh row per read, as a map-style dataset gives

    def release(self, draws: Iterable[int]) -> None:
        with self._lock:
            for draw in draws:
                self._rows.pop(draw, None)

    def __len__(self) -> int:  # rows held: read and not yet trained on
        with self._lock:
            return len(self._rows)

    def close(self) -> None:
        self._stop.set()  # a read under way ends the thread when it returns (a daemon meanwhile)


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
        self._front: deque[tuple[int, int]] = deque()
        self._lock = threading.Lock()
        if progress is None:
            progress = {"next_position": skip_batches * groups_per_batch, "consumed_after": []}
        self._below = int(progress["next_position"])  # every position below this one is done (and forgotten)
        self._taken: dict[int, int] = dict.fromkeys(progress["consumed_after"], -1)  # position -> version taken at
        self._drawn = 0
        self._streamed = num_rows if isinstance(num_rows, StreamedRows) else None
        if self._streamed is not None:  # its reader skips what was trained (a draw number is a position)
            below, consumed = self._below, frozenset(self._taken)
            self._streamed.start(lambda draw: draw < below or draw in consumed)
            return
        if num_rows < groups_per_batch:
            raise ValueError(TOO_FEW.format(rows=num_rows, needed=groups_per_batch))
        self._sampler = RepeatSampler(
            range(num_rows), mini_repeat_count=1, batch_size=groups_per_batch, shuffle=shuffle, seed=seed
        )
        self._indices = self._forever()
        for _ in range(self._below):
            next(self._indices)
            self._drawn += 1

    def _forever(self) -> Iterator[int]:
        while True:
            yield from self._sampler

    def next(self) -> tuple[int, int]:
        """The next prompt to generate: ``(position, dataset row)``."""
        with self._lock:
            if self._front:
                return self._front.popleft()
            if self._streamed is not None:
                draw = self._streamed.next_draw()
                return draw, draw
            while True:
                position, row = self._drawn, next(self._indices)
                self._drawn += 1
                if position not in self._taken:  # not trained on before the resume
                    return position, row

    def available(self) -> int:
        """Prompts :meth:`next` gives without waiting (an iterable dataset's reader may lag behind)."""
        if self._streamed is None:
            return sys.maxsize
        with self._lock:
            return len(self._front) + self._streamed.ready()

    @property
    def poll_s(self) -> float | None:
        """How often a caller waiting for :meth:`available` looks again (``None``: it never waits for it)."""
        return None if self._streamed is None else 0.05

    def close(self) -> None:
        if self._streamed is not None:
            self._streamed.close()

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
