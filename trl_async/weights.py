"""Weight transport on one host: shared-memory tensors plus a version counter.

The trainer ``publish``es a full set of named tensors with a version; a worker ``pull_into`` its model at a safe point
(between generate calls, or between decode steps). One lock orders the two copies, so a worker never reads a
half-written set: after ``pull_into`` returns version ``v``, the worker's tensors equal exactly what was published as
``v``. This module must not import the trainer or deepspeed; the trainer decides what the named tensors are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch


def weights_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-1 over names and raw bytes of tensors, in name order: equal digests mean bit-identical weights."""
    h = hashlib.sha1()
    for name, tensor in sorted(named_tensors, key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class SharedMemoryWeights:
    """Named tensors in shared memory with a version; created in the trainer, passed to spawned workers."""

    def __init__(self, named_tensors: Mapping[str, torch.Tensor], mp_context) -> None:
        self.tensors = {name: t.detach().to("cpu").clone().share_memory_() for name, t in named_tensors.items()}
        self._version = mp_context.Value("q", -1, lock=False)
        self._lock = mp_context.Lock()

    @property
    def version(self) -> int:
        return int(self._version.value)

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy ``named_tensors`` (every name, each exactly once) in and set ``version``."""
        with self._lock, torch.no_grad():
            seen = set()
            for name, tensor in named_tensors:
                self.tensors[name].copy_(tensor.detach())
                seen.add(name)
            if seen != self.tensors.keys():
                missing = sorted(self.tensors.keys() - seen)[:5]
                raise RuntimeError(f"weight publish is missing tensors {missing}; the worker copy would be mixed")
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
