"""Every server of a push at once, behind vLLM's four-method weight-sync client protocol
(``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``, ``finish_weight_update``)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ..client import VLLMServer


def free_port() -> int:
    """A TCP port nothing listens on now (for a rendezvous store)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def on_all(servers: Sequence[VLLMServer], call: Callable[[VLLMServer], object]) -> list:
    """Run ``call`` on every server concurrently; re-raise the first failure."""
    with ThreadPoolExecutor(max_workers=len(servers)) as pool:
        return [f.result() for f in [pool.submit(call, s) for s in servers]]


class FanOutClient:
    """All servers behind vLLM's four-method weight-sync client protocol: one collective group spans the trainer
    and every server's workers, so each server is told its own ``rank_offset`` in it."""

    def __init__(self, servers: Sequence[VLLMServer]) -> None:
        self.servers = list(servers)
        self.world_sizes = on_all(self.servers, lambda s: s.world_size())
        self.offsets = [1 + sum(self.world_sizes[:i]) for i in range(len(self.servers))]
        self.world_size = 1 + sum(self.world_sizes)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        with ThreadPoolExecutor(max_workers=len(self.servers)) as pool:
            futures = [
                pool.submit(s.init_weight_transfer_engine, {**init_info, "rank_offset": offset})
                for s, offset in zip(self.servers, self.offsets, strict=True)
            ]
            for f in futures:
                f.result()

    def start_weight_update(self) -> None:
        on_all(self.servers, lambda s: s.start_weight_update())

    def update_weights(self, update_info: dict) -> None:
        on_all(self.servers, lambda s: s.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        on_all(self.servers, lambda s: s.finish_weight_update(weight_version))


def update_info(specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict:
    return {
        "names": list(specs),
        "dtype_names": [str(dtype).removeprefix("torch.") for _, dtype in specs.values()],
        "shapes": [list(shape) for shape, _ in specs.values()],
    }
