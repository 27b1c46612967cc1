"""Core placement: which CPU cores the rollout workers run on and which the trainer keeps (``rollout_cpu_affinity``).

On a many-core CPU server this is how generation gets 16 cores and training 48; on a small machine it gives each
side its own cores, as a dedicated generation device would. Pure functions here; the worker applies its share with
``os.sched_setaffinity`` when it starts, the trainer process its share while training.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass


def parse_cpu_list(spec: str | int | Iterable[int]) -> tuple[int, ...]:
    """A CPU list as ``taskset -c`` and Linux's ``cpuset`` write it (``"1"``, ``"0-3"``, ``"4-7,12"``), or integers,
    as sorted distinct core ids. ``ValueError`` on anything else."""
    if isinstance(spec, bool):
        raise ValueError(f"not a CPU list: {spec!r}")
    if isinstance(spec, int):
        spec = [spec]
    cores: set[int] = set()
    if isinstance(spec, str):
        for part in spec.replace(" ", "").split(","):
            low, dash, high = part.partition("-")
            if not low.isdigit() or (dash and not high.isdigit()):
                raise ValueError(f"not a CPU list: {spec!r} (write it as taskset -c does: '1', '0-3', '4-7,12')")
            first, last = int(low), int(high) if dash else int(low)
            if last < first:
                raise ValueError(f"not a CPU list: {spec!r} ({part} runs backwards)")
            cores.update(range(first, last + 1))
    else:
        for core in spec:
            if isinstance(core, bool) or not isinstance(core, int) or core < 0:
                raise ValueError(f"not a CPU list: {spec!r} (core ids are integers >= 0)")
            cores.add(core)
    if not cores:
        raise ValueError(f"not a CPU list: {spec!r} (no cores)")
    return tuple(sorted(cores))


@dataclass(frozen=True)
class CoreSplit:
    trainer: tuple[int, ...]  # the cores the trainer process keeps
    workers: tuple[tuple[int, ...], ...]  # per rollout worker, the cores it runs on


def split_cores(rollout: Iterable[int], allowed: Iterable[int], num_workers: int) -> CoreSplit:
    """Give the rollout workers ``rollout`` (contiguous shares, as even as can be; workers share cores when there
    are fewer cores than workers) and the trainer the rest of ``allowed`` (the process's affinity mask)."""
    rollout, allowed = tuple(sorted(set(rollout))), set(allowed)
    outside = sorted(set(rollout) - allowed)
    if outside:
        raise ValueError(
            f"cores {outside} are not among the cores this process may run on ({sorted(allowed)}, "
            "os.sched_getaffinity); choose rollout cores from those"
        )
    trainer = tuple(sorted(allowed - set(rollout)))
    if not trainer:
        raise ValueError(
            f"it takes every core this process may run on ({sorted(allowed)}) and leaves the trainer none; leave "
            "at least one core out"
        )
    if len(rollout) >= num_workers:
        base, extra = divmod(len(rollout), num_workers)
        bounds = [i * base + min(i, extra) for i in range(num_workers + 1)]
        workers = tuple(rollout[bounds[i] : bounds[i + 1]] for i in range(num_workers))
    else:
        workers = tuple((rollout[i % len(rollout)],) for i in range(num_workers))
    return CoreSplit(trainer, workers)


def allowed_cores() -> tuple[int, ...] | None:
    """The cores this process may run on, or ``None`` where the OS does not say (no ``sched_getaffinity``)."""
    return tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else None


def set_process_affinity(cores: Iterable[int]) -> None:
    """Every thread of this process onto ``cores`` (``os.sched_setaffinity(0)`` moves only the calling thread; the
    OpenMP threads torch has started, and threads started later from them, must follow too)."""
    cores = set(cores)
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError):  # a thread that has just exited
            pass


class PinnedTrainer:
    """While training with ``rollout_cpu_affinity``: the trainer process on the cores left to it, with as many torch
    threads; ``restore`` puts back the cores and thread count it had."""

    def __init__(self, cores: tuple[int, ...]) -> None:
        import torch

        self.cores = cores
        self._saved = (tuple(sorted(os.sched_getaffinity(0))), torch.get_num_threads())
        set_process_affinity(cores)
        torch.set_num_threads(len(cores))

    def restore(self) -> None:
        import torch

        cores, threads = self._saved
        set_process_affinity(cores)
        torch.set_num_threads(threads)
