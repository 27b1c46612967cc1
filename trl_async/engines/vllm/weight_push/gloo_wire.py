"""The wire of the CPU weight transport to vLLM servers: a gloo group between the trainer (rank 0) and the servers'
workers.

Both ends import this module: the trainer (``gloo.py``) and the ``trl_async_gloo`` weight-transfer engine inside a
vLLM server (``gloo_receiver.py``, registered by ``engines/vllm/plugin.py``). It imports only torch, so it loads in
either virtual environment. The wire format is the trainer's weight buckets (``plan_buckets``, the same greedy rule
``weights/policy.py`` uses), each broadcast as one flat byte buffer, so both ends cut the stream at the
same places from the tensors' names, shapes and dtypes alone. A bucket is sent completely before the trainer asks for
the next one (under ZeRO-3 the next gather), so no tensor is ever read after its gather context closed."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from ....weights.buckets import plan_buckets

STORE_PREFIX = "trl_async_weights"


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def nbytes_of(shape: Sequence[int], dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


def open_group(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of its own (not the default group, which a distributed trainer already uses). Rank 0 hosts the
    rendezvous store; every rank blocks here until all ``world_size`` ranks have joined or ``timeout_s`` passes."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, store), rank, world_size, timeout)


def _broadcast(group: dist.ProcessGroup, buffer: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([buffer], opts).wait()


def send_buckets(group: dist.ProcessGroup, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> int:
    """Rank 0: broadcast each bucket as one byte buffer before taking the next. Returns the bytes sent."""
    sent = 0
    for bucket in buckets:
        if not bucket:
            continue
        flat = torch.cat([t.detach().to("cpu").contiguous().view(-1).view(torch.uint8) for _, t in bucket])
        _broadcast(group, flat)
        sent += flat.numel()
    return sent


def receive_buckets(
    group: dist.ProcessGroup,
    names: Sequence[str],
    dtype_names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    bucket_bytes: int,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Other ranks: yield each received bucket as ``[(name, tensor), ...]`` (tensors own their memory)."""
    dtypes = [dtype_from_name(d) for d in dtype_names]
    sizes = [nbytes_of(s, d) for s, d in zip(shapes, dtypes, strict=True)]
    for bucket in plan_buckets(sizes, bucket_bytes):
        flat = torch.empty(sum(sizes[i] for i in bucket), dtype=torch.uint8)
        _broadcast(group, flat)
        out, offset = [], 0
        for i in bucket:
            chunk = flat[offset : offset + sizes[i]]
            out.append((names[i], chunk.view(dtypes[i]).reshape(shapes[i])))
            offset += sizes[i]
        yield out
