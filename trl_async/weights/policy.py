"""Full policy tensors out of the training model, bucket by bucket, for the rollout workers.

The trainer's model may be plain, DDP, DeepSpeed ZeRO-2 (full parameters on every rank) or ZeRO-3 (each rank holds a
shard), and may carry LoRA adapters. Workers need plain full tensors under the base model's names, with adapters
merged. ``iter_policy_buckets`` yields them in buckets of bounded size: under ZeRO-3 every rank must iterate it in
lock-step on its main thread (a bucket of plain parameters travels as shards straight to rank 0; a bucket that needs
a merge is one ``GatheredParameters`` gather, through TRL's ``DistributedBackend``), and the tensors of a bucket are
only valid until the generator is resumed, because the gather context closes then: the consumer copies them out before
asking for the next bucket. LoRA is merged one layer at a time (W + peft's own ``get_delta_weight``) without touching
the training weights, so nothing needs unmerging and the whole model is never materialised at once."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from .buckets import plan_buckets
from .lora import adapter_tensors, clean_peft_name
from .lora_merge import SCALES


@dataclass(frozen=True)
class _Unit:
    """One tensor the workers receive: the parameters to gather for it and how to compute it once gathered."""

    name: str
    params: tuple[torch.Tensor, ...]
    compute: Callable[[], torch.Tensor]
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    plain: bool  # the tensor is one parameter/buffer as is (no merge)


def _full_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(t, "ds_shape", t.shape))  # ZeRO-3 partitioned params keep their full shape in ds_shape
    # (an FSDP2 DTensor's shape is already the full one)


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one plain tensor: an FSDP2 parameter (a ``DTensor`` sharded across the ranks) is gathered, a collective
    every rank takes part in; anything else as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def unsharded_class(model: torch.nn.Module) -> type:
    """The model's own class: FSDP2's ``fully_shard`` swaps it for a class made on the fly (``FSDP<Name>``, which
    cannot be pickled to a worker process)."""
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def _unit(name: str, tensor: torch.Tensor, params=None, compute=None) -> _Unit:
    shape = _full_shape(tensor)
    nbytes = int(torch.Size(shape).numel()) * tensor.element_size()
    gathered = tuple(params) if params is not None else ((tensor,) if isinstance(tensor, torch.nn.Parameter) else ())
    return _Unit(name, gathered, compute or (lambda: tensor.data), nbytes, shape, tensor.dtype, compute is None)


def _buffers(model: torch.nn.Module, persistent_only: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Buffers; with ``persistent_only``, only those a checkpoint holds (what a vLLM model loads: it computes the
    rotary tables and other non-persistent buffers itself)."""
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and not (persistent_only and name in module._non_persistent_buffers_set):
                yield (f"{module_name}.{name}" if module_name else name), buffer


def _peft_units(model, persistent_only: bool) -> list[_Unit]:
    from peft.tuners.lora import LoraLayer

    units, covered = [], set()
    for module_name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or module.disable_adapters:
            continue
        base = module.get_base_layer()
        # peft keeps an nn.Embedding's adapter in lora_embedding_A/B (plain parameters), other layers' in lora_A/B
        factors = {a: (module.lora_A[a].weight, module.lora_B[a].weight) for a in module.lora_A}
        factors.update({a: (module.lora_embedding_A[a], module.lora_embedding_B[a]) for a in module.lora_embedding_A})
        adapters = [a for a in module.active_adapters if a in factors]
        if module.merged:  # peft's merge_adapter(): the base weight already holds the delta
            raise NotImplementedError(
                f"{module_name}: the adapter is merged into the base weight (merge_adapter); unmerge it before training"
            )
        for a in adapters:
            if a in getattr(module, "lora_variant", {}) or getattr(module, "lora_bias", {}).get(a, False):
                raise NotImplementedError(
                    f"{module_name}: only plain LoRA adapters can be merged for the rollout workers (not DoRA or "
                    "other variants, nor lora_bias)"
                )
        extra = [p for a in adapters for p in factors[a]]

        def merged(base=base, module=module, adapters=adapters):
            weight = base.weight.data.clone()
            for a in adapters:
                weight += module.get_delta_weight(a).to(weight.dtype)
            return weight

        units.append(
            _unit(clean_peft_name(f"{module_name}.base_layer.weight"), base.weight, (base.weight, *extra), merged)
        )
        covered.add(id(base.weight))
    for name, p in model.named_parameters():
        if id(p) in covered or "lora_" in name or ".original_module." in name:
            continue
        units.append(_unit(clean_peft_name(name), p))
    for name, b in _buffers(model, persistent_only):
        units.append(_unit(clean_peft_name(name), b))
    return units


def is_peft(model: torch.nn.Module) -> bool:
    # not accelerate's is_peft_model: it reads package metadata on every call, and this runs every sync
    return hasattr(model, "get_base_model") and getattr(model, "peft_config", None) is not None


def _frozen_units(model, persistent_only: bool) -> list[_Unit]:
    """A peft model's parameters and buffers outside the adapters, as they are (adapted layers unmerged)."""
    params = [
        _unit(clean_peft_name(n), p)
        for n, p in model.named_parameters()
        if "lora_" not in n and ".original_module." not in n
    ]
    return params + [_unit(clean_peft_name(n), b) for n, b in _buffers(model, persistent_only)]


def _adapter_units(model) -> list[_Unit]:
    """The active adapters' factors, then one float64 tensor of their scales (weights/lora.py)."""
    factors, scales, _ = adapter_tensors(model)
    scale_tensor = torch.tensor(scales, dtype=torch.float64)
    units = [_unit(n, p) for n, p in factors]
    units.append(
        _Unit(
            SCALES, (), lambda: scale_tensor, scale_tensor.numel() * 8, tuple(scale_tensor.shape), torch.float64, True
        )
    )
    return units


PARTS = ("full", "frozen", "adapters")


def policy_units(model: torch.nn.Module, persistent_only: bool = False, part: str = "full") -> list[_Unit]:
    """What the workers receive, in a fixed order: parameters then buffers (only checkpointed ones with
    ``persistent_only``), under the base model's names. ``part`` (peft models): "full", the merged model; "frozen",
    everything outside the adapters, unmerged (sent once); "adapters", the adapter factors and their scales (sent
    every version, weights/lora.py)."""
    if part not in PARTS or (part != "full" and not is_peft(model)):
        raise ValueError(f"part={part!r}: one of {PARTS}, and only 'full' for a model without adapters")
    if part == "frozen":
        return _frozen_units(model, persistent_only)
    if part == "adapters":
        return _adapter_units(model)
    if is_peft(model):
        return _peft_units(model, persistent_only)
    params = [_unit(n, p) for n, p in model.named_parameters()]
    return params + [_unit(n, b) for n, b in _buffers(model, persistent_only)]


def policy_specs(
    model: torch.nn.Module, persistent_only: bool = False, part: str = "full"
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Full shape and dtype of every tensor ``iter_policy_buckets`` yields (readable without any gather)."""
    return {u.name: (u.shape, u.dtype) for u in policy_units(model, persistent_only, part)}


def _zero3_full_tensors(params: list[torch.Tensor], dests: list[torch.Tensor | None]) -> list[torch.Tensor] | None:
    """Full tensors of ZeRO-3 partitioned ``params`` on rank 0 (``None`` on the other ranks), moving only shards.

    ZeRO-3 stores parameter p flattened and padded to world_size * partition_size; rank r holds elements
    [r * partition_size, (r + 1) * partition_size) in ``p.ds_tensor``. Only rank 0 (which feeds the workers) needs
    full tensors, so every other rank sends rank 0 its concatenated shards of the bucket, point to point: one message
    per rank and bucket, (world - 1) / world of the bytes, instead of DeepSpeed's per-parameter all-gathers (gloo's
    all-gather and gather were 2.5-5x slower than a broadcast of the same bytes here; send/recv was faster than
    it). On rank 0 each shard is copied once, straight into its place in ``dests[i]`` (the workers' shared memory
    when the caller passes it; a new tensor where ``None``). Every rank must call this with the same params in the
    same order.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        dist.send(torch.cat([p.ds_tensor.detach().reshape(-1) for p in params]), dst=0)
        return None
    fulls = [
        d if d is not None else torch.empty(p.ds_shape, dtype=p.dtype, device=p.ds_tensor.device)
        for p, d in zip(params, dests, strict=True)
    ]
    flat_fulls = [f.view(-1) for f in fulls]
    sizes = [p.ds_tensor.numel() for p in params]

    def place(src: int, shards: Iterable[torch.Tensor]) -> None:
        dst, srcs = [], []
        for p, full, shard in zip(params, flat_fulls, shards, strict=True):
            start = src * shard.numel()
            n = max(0, min(shard.numel(), p.ds_numel - start))  # the last ranks' shards end in padding
            if n:
                dst.append(full[start : start + n])
                srcs.append(shard[:n])
        torch._foreach_copy_(dst, srcs)  # one call for the bucket: per-tensor copy_ overhead dominated small models

    device = params[0].ds_tensor.device
    pending = []
    for src in range(1, world):
        buffer = torch.empty(sum(sizes), dtype=params[0].dtype, device=device)
        pending.append((src, buffer, dist.irecv(buffer, src=src)))
    place(0, (p.ds_tensor.detach().reshape(-1) for p in params))  # own shards while the others arrive
    for src, buffer, request in pending:
        request.wait()
        place(src, buffer.split(sizes))
    return fulls


def shard_resident(p: torch.Tensor) -> bool:
    """Whether a ZeRO-3 parameter's shard (``p.ds_tensor``) is in memory on the device the parameter computes on, so
    it can be sent as it is: not offloaded to the CPU from an accelerator (``offload_param: cpu``), not swapped out
    to NVMe (``offload_param: nvme``: an empty tensor until DeepSpeed swaps it back in)."""
    shard = getattr(p, "ds_tensor", None)
    if shard is None or shard.numel() == 0:
        return False
    status = getattr(shard, "status", None)  # deepspeed PartitionedParamStatus: AVAILABLE, NOT_AVAILABLE, INFLIGHT
    return shard.device == p.device and (status is None or status.name == "AVAILABLE")


def _flat_gatherable(bucket: list[_Unit]) -> bool:
    params = [u.params[0] for u in bucket if u.params]
    return (
        all(u.plain for u in bucket)
        and bool(params)
        and all(shard_resident(p) for p in params)
        and len({p.dtype for p in params}) == 1
    )


def _on_every_rank(flags: list[bool], device: torch.device) -> list[bool]:
    """``flags[i]`` and-ed over the ranks (one small all-reduce): every rank must take the same path per bucket."""
    import torch.distributed as dist

    if not flags or not dist.is_initialized() or dist.get_world_size() == 1:
        return flags
    t = torch.tensor(flags, dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [bool(v) for v in t.tolist()]


def iter_policy_buckets(
    model: torch.nn.Module,
    gather_params,
    bucket_bytes: int,
    flat_zero3: bool = False,
    out: Mapping[str, torch.Tensor] | None = None,
    persistent_only: bool = False,
    part: str = "full",
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield ``[(name, full tensor), ...]`` buckets of at most ``bucket_bytes`` (one oversized tensor goes alone).

    ``gather_params`` is ``DistributedBackend.gather_params`` (a no-op context without ZeRO-3). With ``flat_zero3``
    (ZeRO-3 only), buckets of plain parameters instead travel as shards straight to rank 0, and other ranks get
    empty buckets, and rank 0 writes those tensors straight into ``out[name]`` when ``out`` is given (the yielded
    tensor is then ``out[name]`` itself, which a consumer can skip copying). Only rank 0's buckets are meant to be
    consumed. Every rank must exhaust this generator in the same order; tensors are valid only until the next
    ``next()``. ``part``: as ``policy_units``.
    """
    units = policy_units(model, persistent_only, part)
    buckets = [[units[i] for i in span] for span in plan_buckets([u.nbytes for u in units], bucket_bytes)]  # as the
    # vLLM gloo receiver cuts them. Shards off the compute device (offloaded) take DeepSpeed's gather, and every rank
    # must agree per bucket (its shards may be swapped in on one rank and not another)
    flat = [False] * len(buckets)
    if flat_zero3:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        flat = _on_every_rank([_flat_gatherable(b) for b in buckets], device)
    for bucket, fast in zip(buckets, flat, strict=True):
        if fast:
            with torch.no_grad():
                shipped = [u for u in bucket if u.params]
                dests = [out.get(u.name) if out is not None else None for u in shipped]
                fulls = _zero3_full_tensors([u.params[0] for u in shipped], dests)
                if fulls is None:  # not rank 0: nothing to hand out, the shards went to rank 0
                    yield []
                else:
                    gathered = iter(fulls)
                    yield [(u.name, next(gathered) if u.params else u.compute()) for u in bucket]
        else:
            params = [p for u in bucket for p in u.params]
            with torch.no_grad(), gather_params(params):
                yield [(u.name, whole(u.compute())) for u in bucket]
