"""Trainer side of the weight push to vLLM servers.

One push: every server is paused (``keep``: running requests freeze and continue on the new weights, each token
labelled with the weights that sampled it; ``wait``: running requests finish first), the weights stream over one
collective group spanning the trainer (rank 0) and every server worker, each server finishes the update under the
new version's label, and resumes. Transports:
  * ``nccl`` (GPU servers): vLLM's own ``NCCLTrainerWeightTransferEngine`` (as TRL 1.16's synchronous trainer uses);
    vLLM must be importable in the trainer's environment.
  * ``gloo`` (CPU servers, and the tested twin of the NCCL path): ``weights/gloo.py`` on our side and the
    ``trl_async_gloo`` engine inside the servers; same endpoints, same lifecycle.
The buckets come from ``weight_sync.iter_policy_buckets`` on every trainer rank, in lock-step on the main thread
(under ZeRO-3 each bucket is a collective gather); only rank 0 holds a sender, and a bucket is sent completely before
the next one is gathered, so a send never interleaves with a gather and never reads a tensor after its gather ended.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ...weights.gloo import open_group, send_buckets
from .client import VLLMServer

Buckets = Iterable[Sequence[tuple[str, torch.Tensor]]]


def free_port() -> int:
    """A TCP port nothing listens on now (for a rendezvous store)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _all(servers: Sequence[VLLMServer], call: Callable[[VLLMServer], object]) -> list:
    """Run ``call`` on every server concurrently; re-raise the first failure."""
    with ThreadPoolExecutor(max_workers=len(servers)) as pool:
        return [f.result() for f in [pool.submit(call, s) for s in servers]]


class FanOutClient:
    """All servers behind vLLM's four-method weight-sync client protocol: one collective group spans the trainer
    and every server's workers, so each server is told its own ``rank_offset`` in it."""

    def __init__(self, servers: Sequence[VLLMServer]) -> None:
        self.servers = list(servers)
        self.world_sizes = _all(self.servers, lambda s: s.world_size())
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
        _all(self.servers, lambda s: s.start_weight_update())

    def update_weights(self, update_info: dict) -> None:
        _all(self.servers, lambda s: s.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        _all(self.servers, lambda s: s.finish_weight_update(weight_version))


def update_info(specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict:
    return {
        "names": list(specs),
        "dtype_names": [str(dtype).removeprefix("torch.") for _, dtype in specs.values()],
        "shapes": [list(shape) for shape, _ in specs.values()],
    }


class GlooSender:
    """Rank 0's end of the CPU transport (see module docstring)."""

    def __init__(self, client: FanOutClient, bucket_bytes: int, timeout_s: float, host: str = "127.0.0.1") -> None:
        self.client = client
        init_info = {
            "master_address": host,
            "master_port": free_port(),
            "world_size": client.world_size,
            "bucket_bytes": bucket_bytes,
            "timeout_s": timeout_s,
        }
        self.timeout_s = timeout_s
        self._unsettled = None
        with ThreadPoolExecutor(max_workers=1) as pool:  # the servers block in the rendezvous until we join it
            joined = pool.submit(client.init_weight_transfer_engine, init_info)
            self.group = open_group(host, init_info["master_port"], 0, client.world_size, timeout_s)
            joined.result()

    def send(self, buckets: Buckets, specs: dict, version: int) -> None:
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        receiving = pool.submit(self.client.update_weights, update_info(specs))  # blocks in the receive
        try:
            send_buckets(self.group, buckets)
            receiving.result()
        except BaseException:
            self._unsettled = receiving  # see settle()
            raise
        finally:
            pool.shutdown(wait=False)  # after a failed broadcast the request may never return; don't wait for it
        self.client.finish_weight_update(str(version))

    def settle(self) -> None:
        """After a broadcast that broke off (a member died): the other servers stay blocked in their receive until
        the group's timeout. Wait for their calls to end (bounded), so that a new group finds them free, not wedged."""
        receiving, self._unsettled = self._unsettled, None
        if receiving is not None:
            with contextlib.suppress(BaseException):
                receiving.result(timeout=self.timeout_s + 30.0)


class _BucketSource:
    """vLLM ``WeightSource`` over the current push's buckets. vLLM's packed producer keeps the tensors it has
    consumed until its buffer is full, possibly past our next gather, so each tensor is copied out first."""

    def __init__(self, specs: dict) -> None:
        self.specs = specs
        self.buckets: Buckets = ()

    def metadata(self):
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name, dtype, tuple(shape)) for name, (shape, dtype) in self.specs.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.buckets:
            for name, tensor in bucket:
                yield name, tensor.detach().clone()


class NCCLSender:
    """Rank 0's end of the GPU transport: vLLM's NCCL trainer engine fed by our buckets."""

    def __init__(self, client: FanOutClient, specs: dict, host: str | None = None) -> None:
        from vllm.distributed.weight_transfer.base import WeightSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        source_cls = type("BucketSource", (_BucketSource, WeightSource), {})
        self.source = source_cls(specs)
        init_info = NCCLTrainerInitInfo(
            master_address=host or socket.gethostbyname(socket.gethostname()),
            master_port=free_port(),
            world_size=client.world_size,
            rank=0,
        )
        self.engine = WeightTransferTrainerFactory.trainer_init(
            init_info, client=_Labelled(client), source=self.source
        )

    def send(self, buckets: Buckets, specs: dict, version: int) -> None:
        self.source.buckets = buckets
        self.engine.client.label = str(version)
        self.engine.send_weights()


class _Labelled:
    """vLLM's engine finishes an update without a version label; this passes ours to ``finish_weight_update``."""

    def __init__(self, client: FanOutClient) -> None:
        self.client, self.label = client, None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.client.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.client.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.client.finish_weight_update(self.label if weight_version is None else weight_version)


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
        update itself when its receive fails (``gloo_engine.py``) and stays paused, with half a version, until it
        is re-attached."""
        settle = getattr(self.sender, "settle", None)
        if settle is not None:
            settle()

    def push(self, buckets: Buckets, version: int, pause_mode: str) -> float:
        """Returns the seconds it took; ``last_phases`` holds the seconds of each phase (for benchmarks)."""
        marks = [time.perf_counter()]
        _all(self.servers, lambda s: s.pause(pause_mode))
        marks.append(time.perf_counter())
        self.sender.send(buckets, self.specs, version)  # on failure the servers stay paused: their weights are mixed
        marks.append(time.perf_counter())
        _all(self.servers, lambda s: s.reset_prefix_cache())  # cached KV is the old weights'
        _all(self.servers, lambda s: s.resume())
        marks.append(time.perf_counter())
        phases = ("pause", "send", "reset_resume")
        self.last_phases = {name: marks[i + 1] - marks[i] for i, name in enumerate(phases)}
        self.pushes += 1
        return marks[-1] - marks[0]
