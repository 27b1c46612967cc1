"""Prompt source: dataset rows in the order GRPOTrainer's sampler gives them, one entry per group.

GRPOTrainer's ``RepeatSampler`` shuffles with ``args.seed``, cuts each permutation into generation batches of
``generation_batch_size // num_generations`` unique prompts (dropping an incomplete last batch), and repeats each
batch for ``num_iterations * steps_per_generation`` micro-steps. The rollout workers need each unique prompt once, so
this stream walks the same sampler with ``repeat_count=1``: the same permutations, epoch after epoch, forever (the
trainer's own loop decides when training stops). A dropped (too stale) group is pushed back to the front, so its
prompt is generated again rather than lost.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator

from trl.trainer.utils import RepeatSampler


class PromptStream:
    def __init__(self, num_rows: int, groups_per_batch: int, shuffle: bool, seed: int, skip_batches: int = 0) -> None:
        if num_rows < groups_per_batch:
            raise ValueError(
                f"train_dataset has {num_rows} rows but one generation batch needs {groups_per_batch} distinct prompts "
                "(generation_batch_size // num_generations); add rows or lower generation_batch_size"
            )
        self._sampler = RepeatSampler(
            range(num_rows), mini_repeat_count=1, batch_size=groups_per_batch, shuffle=shuffle, seed=seed
        )
        self._indices = self._forever()
        self._front: deque[int] = deque()
        self._lock = threading.Lock()
        for _ in range(skip_batches * groups_per_batch):
            next(self._indices)

    def _forever(self) -> Iterator[int]:
        while True:
            yield from self._sampler

    def next_index(self) -> int:
        with self._lock:
            return self._front.popleft() if self._front else next(self._indices)

    def push_front(self, index: int) -> None:
        with self._lock:
            self._front.appendleft(index)
