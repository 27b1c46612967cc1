"""Adapter-only weight sync for LoRA, both ends: how the adapted weights are rebuilt from what travels.

A worker merges each version's factors into its own plain copy, ``W = W_base + scale * (B @ A)`` (transposed for
``fan_in_fan_out``), with the arithmetic of peft's ``get_delta_weight``, so it generates with a plain model at the
base model's speed: no adapter matmuls per token. For vLLM servers, ``served_adapter`` folds a version's adapters and
scales into one peft-format adapter that a server applies at scale 1 (engines/vllm/adapters.py loads it as a named
adapter). The rollout workers import this module: it imports torch alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

SCALES = "lora_scales"  # the name of the float64 tensor of every factor's scale, sent with each version


@dataclass(frozen=True)
class LoraMerge:
    """How one adapted weight is rebuilt: ``weight = base + sum(scale[i] * (B @ A))`` over its active adapters.
    ``factors`` are ``(A name, B name, index into the scales tensor)``; names are those of the published tensors."""

    weight: str
    factors: tuple[tuple[str, str, int], ...]
    fan_in_fan_out: bool


def merge_adapters(
    merges: tuple[LoraMerge, ...],
    base: Mapping[str, torch.Tensor],
    adapters: Mapping[str, torch.Tensor],
    out: Mapping[str, torch.Tensor],
) -> None:
    """``out[m.weight] = base[m.weight] + sum(scale * (B @ A))`` for every merge, cast into ``out``'s dtype; ``base``
    is never written. float32 factors and base: one fused ``addmm`` per adapter, written straight into ``out`` (one
    pass over the weight, no model-sized temporaries). Otherwise as peft's ``get_delta_weight`` computes it
    (bf16/fp16 factors on a CPU in float32, the delta cast to the factors' dtype, then to the base's)."""
    scales = adapters[SCALES].tolist()
    scratch: dict[tuple, torch.Tensor] = {}  # one float32 buffer per shape, where ``out`` is of another dtype
    with torch.no_grad():
        for m in merges:
            w0, target = base[m.weight], out[m.weight]
            factors = [(adapters[a], adapters[b], scales[i]) for a, b, i in m.factors]
            if all(a.dtype == b.dtype == w0.dtype == torch.float32 for a, b, _ in factors):
                same = target.dtype == w0.dtype and target.device == w0.device
                key = (tuple(w0.shape), w0.device)
                dest = target if same else scratch.setdefault(key, torch.empty_like(w0))
                for k, (a, b, scale) in enumerate(factors):
                    lhs, rhs = (a.T, b.T) if m.fan_in_fan_out else (b, a)  # (B @ A).T = A.T @ B.T
                    if k == 0:
                        torch.addmm(w0, lhs, rhs, alpha=scale, out=dest)
                    else:
                        dest.addmm_(lhs, rhs, alpha=scale)
                if not same:
                    target.copy_(dest)
                continue
            weight = w0.clone()
            for a, b, scale in factors:
                to_fp32 = a.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)
                delta = b.float() @ a.float() if to_fp32 else b @ a
                if m.fan_in_fan_out:
                    delta = delta.T
                delta = (delta * scale).to(b.dtype)
                weight += delta.to(weight.dtype)
            target.copy_(weight)


def merged_weights(
    merges: tuple[LoraMerge, ...], base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The full weights a worker generates with: ``base`` with every adapted weight replaced by its merge (new
    tensors; ``base`` is not written)."""
    out = dict(base)
    out.update({m.weight: torch.empty_like(base[m.weight]) for m in merges})
    merge_adapters(merges, base, adapters, out)
    return out


def served_adapter(
    merges: tuple[LoraMerge, ...], adapters: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], int]:
    """One version's adapters as a single peft-format LoRA adapter a server applies with scale 1 (``lora_alpha ==
    r``, no rslora): per adapted layer, ``A`` stacks the active adapters' A factors and ``B`` their B factors times
    their scales, so ``B @ A == sum(scale * (B_i @ A_i))`` whatever the scaling rule (alpha/r, rslora, alpha_pattern,
    ``set_scale``). Layers of lower rank are padded with zero rows of A and zero columns of B to the adapter's rank
    ``r`` (the largest), which leaves their product unchanged. Returns ``(tensors, r)``; the tensors are float32 and
    named ``base_model.model.<layer>.lora_{A,B}.weight``, as ``peft.save_pretrained`` writes them."""
    scales = adapters[SCALES].tolist()
    stacked = {}
    for m in merges:
        a = torch.cat([adapters[a].float() for a, _, _ in m.factors], dim=0)
        b = torch.cat([adapters[b].float() * scales[i] for _, b, i in m.factors], dim=1)
        stacked[m.weight.removesuffix(".weight")] = (a, b)
    rank = max(a.shape[0] for a, _ in stacked.values())
    tensors = {}
    for layer, (a, b) in stacked.items():
        pad = rank - a.shape[0]
        tensors[f"base_model.model.{layer}.lora_A.weight"] = torch.nn.functional.pad(a, (0, 0, 0, pad)).contiguous()
        tensors[f"base_model.model.{layer}.lora_B.weight"] = torch.nn.functional.pad(b, (0, pad)).contiguous()
    return tensors, rank


def served_rank(merges: tuple[LoraMerge, ...], specs: Mapping[str, tuple]) -> int:
    """The rank of ``served_adapter``'s adapter, from the published tensors' shapes
    (``policy_specs(part="adapters")``)."""
    return max(sum(specs[a][0][0] for a, _, _ in m.factors) for m in merges)
