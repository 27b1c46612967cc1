"""Rank 0's end of the GPU transport: vLLM's own NCCL trainer engine (as TRL's synchronous trainer uses it), fed
by the trainer's buckets. vLLM must be importable in the trainer's environment."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import torch

from ....weights.buckets import Buckets
from .fan_out import FanOutClient, free_port


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
