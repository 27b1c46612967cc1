"""One push, the same for every transport: every server is paused (``keep``: running requests freeze and continue on
the new weights, each token labelled with the weights that sampled it; ``wait``: running requests finish first), the
weights stream over one collective group spanning the trainer (rank 0) and every server worker, each server
finishes the update under the new version's label, and resumes."""

from __future__ import annotations

import time
from collections.abc import Sequence

from ....weights.buckets import Buckets
from ..client import VLLMServer
from .fan_out import FanOutClient, on_all
from .gloo import GlooSender
from .nccl import NCCLSender


class VLLMWeightPusher:
    """Pause, push, label, resume: one call per published version (rank 0 only)."""

    def __init__(self, servers: Sequence[VLLMServer], transport: str, bucket_bytes: int, timeout_s: float, specs):
        self.servers = list(servers)
        self.specs = specs
        self.last_phases: dict[str, float] = {}
        self.pushes = 0
        client = FanOutClient(self.servers)
        if transport == "nccl":
            self.sender = NCCLSender(client, specs)
        else:
            self.sender = GlooSender(client, bucket_bytes, timeout_s)

    def settle(self) -> None:
        """After a failed push: wait until no server is still busy with it (``GlooSender.settle``). Each closes the
        update itself when its receive fails (``gloo_receiver.py``) and stays paused, with half a version, until it
        is re-attached."""
        settle = getattr(self.sender, "settle", None)
        if settle is not None:
            settle()

    def push(self, buckets: Buckets, version: int, pause_mode: str) -> float:
        """Returns the seconds it took; ``last_phases`` holds the seconds of each phase (for benchmarks)."""
        marks = [time.perf_counter()]
        on_all(self.servers, lambda s: s.pause(pause_mode))
        marks.append(time.perf_counter())
        self.sender.send(buckets, self.specs, version)  # on failure the servers stay paused: their weights are mixed
        marks.append(time.perf_counter())
        on_all(self.servers, lambda s: s.reset_prefix_cache())  # cached KV is the old weights'
        on_all(self.servers, lambda s: s.resume())
        marks.append(time.perf_counter())
        phases = ("pause", "send", "reset_resume")
        self.last_phases = {name: marks[i + 1] - marks[i] for i, name in enumerate(phases)}
        self.pushes += 1
        return marks[-1] - marks[0]
