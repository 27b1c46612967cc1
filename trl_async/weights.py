"""Weight transport on one host: shared-memory tensors plus a version counter.

The trainer ``publish``es a full set of named tensors with a version, bucket by bucket (so a ZeRO-3 trainer never has
to hold the whole model gathered); a worker ``pull_into`` its model at a safe point (between generate calls, or
between decode steps). One lock is held across a whole publish and a whole pull, so a worker never reads a
half-written set: after ``pull_into`` returns version ``v``, the worker's tensors equal exactly what was published as
``v``. This module must not import the trainer or deepspeed; the trainer decides what the named tensors are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch


class Digest:
    """SHA-1 over names and raw bytes of tensors, fed in order: equal digests mean bit-identical weights."""

    def __init__(self) -> None:
        self._h = hashlib.sha1()

    def update(self, name: str, tensor: torch.Tensor) -> None:
        self._h.update(name.encode())
        self._h.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def weights_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    digest = Digest()
    for name, tensor in named_tensors:
        digest.update(name, tensor)
    return digest.hexdigest()


class SharedMemoryWeights:
    """Named tensors in shared memory with a version; created in the trainer, passed to spawned workers."""

    def __init__(self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], mp_context) -> None:
        self.tensors = {
            name: torch.zeros(shape, dtype=dtype).share_memory_() for name, (shape, dtype) in specs.items()
        }
        self._version = mp_context.Value("q", -1, lock=False)
        self._lock = mp_context.Lock()

    @property
    def version(self) -> int:
        return int(self._version.value)

    def publish(
        self, buckets: Iterable[Iterable[tuple[str, torch.Tensor]]], version: int, digest: Digest | None = None
    ) -> None:
        """Copy every bucket's ``(name, tensor)`` pairs in (each name exactly once, in ``self.tensors`` order when a
        ``digest`` is fed), then set ``version``. Each bucket is copied before the next one is requested."""
        with self._lock, torch.no_grad():
            seen = []
            for bucket in buckets:
                for name, tensor in bucket:
                    self.tensors[name].copy_(tensor.detach())
                    if digest is not None:
                        digest.update(name, self.tensors[name])
                    seen.append(name)
            if seen != list(self.tensors):
                missing = sorted(self.tensors.keys() - set(seen))[:5]
                raise RuntimeError(f"weight publish sent {len(seen)} tensors, missing {missing}; refusing a mixed set")
            self._version.value = version

    def pull_into(self, params: Mapping[str, torch.Tensor], have_version: int) -> int | None:
        """Copy the published tensors into ``params`` if a version newer than ``have_version`` is there.

        Returns the version now held, or ``None`` when nothing newer was published.
        """
        if self._version.value <= have_version:
            return None
        with self._lock, torch.no_grad():
            for name, tensor in self.tensors.items():
                params[name].copy_(tensor)
            return int(self._version.value)
