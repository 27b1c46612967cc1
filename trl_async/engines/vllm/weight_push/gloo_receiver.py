"""Server side of the CPU weight transport: a vLLM ``WeightTransferEngine`` that receives the trainer's weights over
a gloo group (``gloo_wire.py``) and loads them with the model's own ``load_weights``.

It is the CPU twin of vLLM's NCCL engine and follows the same lifecycle, driven by the same HTTP endpoints
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``): only
the collective library differs. Imported only inside a vLLM server (it needs vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .gloo_wire import open_group, receive_buckets


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    world_size: int  # trainer (rank 0) + every server worker
    rank_offset: int  # rank of this server's first worker
    bucket_bytes: int
    timeout_s: float = 300.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"update_info lists differ in length: {len(self.names)} names, {len(self.dtype_names)} dtypes, "
                f"{len(self.shapes)} shapes"
            )


def refresh_cpu_gemm_handles(model) -> int:
    """vLLM on CPU multiplies with a pre-packed copy of each weight (``layer.cpu_linear``). Layers that reload
    re-pack, but a layer whose weight is *tied* to another one's (an LM head sharing the embedding matrix) loads
    nothing itself and keeps multiplying with the old pack: its logits would stay those of the initial weights.
    Re-pack every layer that kept its weight (embeddings and LM heads; other linear layers drop theirs after
    packing). Returns how many were re-packed."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    refreshed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.dim() == 2 and weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            refreshed += 1
    return refreshed


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.bucket_bytes = 0

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.bucket_bytes = init_info.bucket_bytes
        self.group = open_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_cpu_gemm_handles(self.model)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: call /init_weight_transfer_engine first")
        try:
            for bucket in receive_buckets(
                self.group, update_info.names, update_info.dtype_names, update_info.shapes, self.bucket_bytes
            ):
                self.model.load_weights(bucket)
        except BaseException:
            # a transfer that broke off (the trainer or another server died): vLLM ends the update session but
            # leaves the layer-wise reload that start_weight_update opened, and the next start would wrap the
            # loaders again and break them. Close it: each layer keeps what it received, or its old weights.
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            raise

    def shutdown(self) -> None:
        self.group = None
