"""Weight transport on one host: shared-memory tensors plus a version counter.

The trainer ``publish``es a full set of named tensors with a version, bucket by bucket (so a ZeRO-3 trainer never has
to hold the whole model gathered); a worker ``pull_into`` its model at a safe point (between generate calls, or
between decode steps). One lock is held across a whole publish and a whole pull, so a worker never reads a
half-written set: after ``pull_into`` returns version ``v``, the worker's tensors equal exactly what was published as
``v``. This module must not import the trainer or deepspeed; the trainer decides what the named tensors are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping

import torch


class Digest:
    """SHA-1 over names and raw bytes of tensors, fed in order: equal digests mean bit-identical weights."""

    def __init__(self) -> None:
        self._h = hashlib.sha1()

    def update(self, name: str, tensor: torch.Tensor) -> None:
        self._h.update(name.encode())
        self._h.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())

    def update_text(self, text: str) -> None:
        """Chain in another digest (the frozen base's, under adapter-only LoRA sync) or any label."""
        self._h.update(text.encode())

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def weights_digest(named_tensors: Iterable[tuple[str, torch.Tensor]], chained: str | None = None) -> str:
    digest = Digest()
    if chained is not None:
        digest.update_text(chained)
    for name, tensor in named_tensors:
        digest.update(name, tensor)
    return digest.hexdigest()


def flat_layout(specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]):
    """Where each named tensor lives in one flat tensor per dtype: ``({name: (dtype, start, torch.Size)}, {dtype:
    total elements})``, names in spec order, each dtype's tensors back to back."""
    layout, sizes = {}, {}
    for name, (shape, dtype) in specs.items():
        shape = torch.Size(shape)
        layout[name] = (dtype, sizes.get(dtype, 0), shape)
        sizes[dtype] = sizes.get(dtype, 0) + shape.numel()
    return layout, sizes


class SharedMemoryWeights:
    """Two sets of named tensors in shared memory (double buffering) with a version each, created in the trainer and
    passed to worker processes.

    The trainer never waits for a worker: ``publish`` writes into the buffer that is not the newest one and then
    makes it the newest. Each buffer has a sequence counter (a seqlock): odd while it is being written, bumped again
    when done. A worker copies the newest buffer and re-reads its counter; if a publish touched the buffer meanwhile
    (two publishes during one copy), the copy is discarded and repeated, so a worker never adopts a mixed set.
    Memory: twice the policy size. With ``copies=1`` (a set published once, such as the frozen base under
    adapter-only LoRA sync) there is one buffer: a publish then overwrites the set readers use, and a reader that
    overlaps it waits for it to finish (the seqlock), so a single buffer suits only rarely published sets.

    Each buffer is one flat shared tensor per dtype, and the named tensors are views into it, so a worker receives
    the whole set in a few file descriptors: a forkserver hands a child at most ~250, and a policy has hundreds of
    tensors.
    """

    def __init__(self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], mp_context, copies: int = 2) -> None:
        self._layout, sizes = flat_layout(specs)
        self._flats = [
            {dtype: torch.empty(max(size, 1), dtype=dtype).share_memory_() for dtype, size in sizes.items()}
            for _ in range(copies)
        ]
        self.buffers = [self._views(flats) for flats in self._flats]  # unset until written: no version reads them
        self._seq = mp_context.Array("q", copies, lock=False)  # per buffer: odd while being written
        self._versions = mp_context.Array("q", [-1] * copies, lock=False)
        self._newest = mp_context.Value("q", 0, lock=False)

    def _views(self, flats: Mapping[torch.dtype, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            name: flats[dtype][start : start + shape.numel()].view(shape)
            for name, (dtype, start, shape) in self._layout.items()
        }

    def __getstate__(self) -> dict:  # the flat tensors travel; the views are rebuilt on the other side
        return {k: v for k, v in self.__dict__.items() if k != "buffers"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.buffers = [self._views(flats) for flats in self._flats]

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The newest complete set (for inspection; workers use ``pull_into``)."""
        if not self.buffers:
            raise RuntimeError("these shared weights were released (their pool is closed); read them before")
        return self.buffers[self._newest.value]

    def release(self) -> None:
        """Drop this process's hold on the shared buffers (once no worker uses them): their memory, twice the policy,
        is returned as soon as nothing else refers to it. Versions and counters stay readable."""
        self._flats, self.buffers = [], []

    @property
    def spare_tensors(self) -> dict[str, torch.Tensor]:
        """The set the next ``publish`` writes into. A producer may fill these in place (only from the publishing
        thread, only for that next publish) and yield them as they are: ``publish`` skips copying a tensor onto
        itself."""
        return self.buffers[self._spare]

    @property
    def _spare(self) -> int:
        return (self._newest.value + 1) % len(self.buffers)

    @property
    def version(self) -> int:
        return int(self._versions[self._newest.value])

    def publish(
        self,
        buckets: Iterable[Iterable[tuple[str, torch.Tensor]]],
        version: int,
        digest: Digest | None = None,
        ready: Callable[[], None] | None = None,
    ) -> None:
        """Copy every bucket's ``(name, tensor)`` pairs into the spare buffer (each name exactly once, in spec order
        when a ``digest`` is fed), then make it the newest with ``version``. Each bucket is copied before the next
        one is requested. On error the newest buffer is untouched. ``ready`` is called once the set is complete (the
        digest final) and before any worker can see it: a worker may adopt it the moment it is visible. With
        ``copies=1`` an error leaves the only buffer half written (its counter even again): publish such a set once,
        before any reader."""
        spare = self._spare
        target = self.buffers[spare]
        self._seq[spare] += 1  # odd: being written
        try:
            with torch.no_grad():
                seen = []
                for bucket in buckets:
                    for name, tensor in bucket:
                        if tensor.data_ptr() != target[name].data_ptr():  # not already written in place
                            target[name].copy_(tensor.detach())
                        if digest is not None:
                            digest.update(name, target[name])
                        seen.append(name)
            if seen != list(target):
                missing = sorted(target.keys() - set(seen))[:5]
                raise RuntimeError(f"weight publish sent {len(seen)} tensors, missing {missing}; refusing a mixed set")
            self._versions[spare] = version
        finally:
            self._seq[spare] += 1  # even again
        if ready is not None:
            ready()
        self._newest.value = spare

    def pull_into(self, params: Mapping[str, torch.Tensor], have_version: int) -> int | None:
        """Copy the newest set into ``params`` if its version is newer than ``have_version``.

        Returns the version now held, or ``None`` when nothing newer was published.
        """
        while True:
            index = self._newest.value
            seq = self._seq[index]  # the counter first: the version is then read inside the checked window
            version = int(self._versions[index])
            if version <= have_version:
                return None
            if seq % 2:  # overwritten right now (two publishes since we looked): look again
                continue
            with torch.no_grad():
                for name, tensor in self.buffers[index].items():
                    params[name].copy_(tensor)
            if self._seq[index] == seq:
                return version
