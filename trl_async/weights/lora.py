"""Adapter-only weight sync for LoRA, the trainer's side: what travels from a peft model.

With ``peft_config`` every parameter outside the adapters is frozen, so after the first sync only the LoRA factors
change. A worker then holds the frozen base once (published with the first version, in shared memory it only reads)
and receives, per version, the factors A and B of every adapted layer and their scales (``adapter_tensors``), and
rebuilds the adapted weights itself (``weights/lora_merge.py``).

What cannot go adapter-only (``adapter_sync_blocker`` says why) falls back to the merged full weights: LoRA on
embeddings or convolutions, and any trainable parameter outside the adapters (``modules_to_save``, peft's
``bias="all"``/``"lora_only"``). DoRA and other variants and ``lora_bias`` are refused at construction
(``weights/policy.py``): neither way sends them.
"""

from __future__ import annotations

import torch

from .lora_merge import LoraMerge


def clean_peft_name(name: str) -> str:
    """A peft parameter's name as the base model (and so a worker's plain model) calls it."""
    return (
        name.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
    )


def _lora_layers(model: torch.nn.Module):
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and not module.disable_adapters:
            yield name, module


def adapter_sync_blocker(model: torch.nn.Module) -> str | None:
    """Why this peft model's updates cannot travel as its adapters alone, or ``None`` when they can: every
    trainable parameter is the A or B factor of a plain LoRA adapter on an ``nn.Linear``."""
    from peft.tuners.lora import Linear as LoraLinear

    types = {str(getattr(c, "peft_type", "?")) for c in model.peft_config.values()}
    if types != {"PeftType.LORA"} and types != {"LORA"}:
        return f"peft type {sorted(types)} (adapter-only sync handles LoRA)"
    factors = set()
    for name, module in _lora_layers(model):
        active = [a for a in module.active_adapters if a in module.lora_A or a in module.lora_embedding_A]
        if not isinstance(module, LoraLinear) or any(a in module.lora_embedding_A for a in active):
            return f"LoRA on `{clean_peft_name(name)}` ({type(module.get_base_layer()).__name__}, not nn.Linear)"
        for a in active:  # (variants such as DoRA, and lora_bias, are refused before this: weights/policy.py)
            factors.update(id(p) for p in (module.lora_A[a].weight, module.lora_B[a].weight))
    others = [clean_peft_name(n) for n, p in model.named_parameters() if p.requires_grad and id(p) not in factors]
    if others:
        return (
            f"{len(others)} trainable parameters outside the adapters ({', '.join(others[:3])}"
            f"{', ...' if len(others) > 3 else ''}: modules_to_save, or peft's bias='all'/'lora_only')"
        )
    if not factors:
        return "no active LoRA adapter"
    return None


def adapter_tensors(
    model: torch.nn.Module,
) -> tuple[list[tuple[str, torch.Tensor]], list[float], tuple[LoraMerge, ...]]:
    """``(factors, scales, merges)``: every active adapter's A and B parameters under their published names, the
    scale of each (A, B) pair, and how each adapted weight is rebuilt from them. Valid when
    ``adapter_sync_blocker(model)`` is None."""
    factors, scales, merges = [], [], []
    for name, module in _lora_layers(model):
        pairs = []
        for a in module.active_adapters:
            if a not in module.lora_A:
                continue
            prefix = clean_peft_name(name)
            names = (f"{prefix}.lora_A.{a}.weight", f"{prefix}.lora_B.{a}.weight")
            factors += [(names[0], module.lora_A[a].weight), (names[1], module.lora_B[a].weight)]
            pairs.append((*names, len(scales)))
            scales.append(float(module.scaling[a]))
        if pairs:
            merges.append(LoraMerge(f"{clean_peft_name(name)}.weight", tuple(pairs), bool(module.fan_in_fan_out)))
    return factors, scales, tuple(merges)
