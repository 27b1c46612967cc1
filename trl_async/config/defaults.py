"""Defaults that depend on other settings, resolved in one place.

``resolve_defaults`` is the one step that writes into the settings: the engine that GRPOConfig's ``use_vllm`` and
``vllm_mode`` ask for, the correction mode ``loss_type`` calls for, and where new weights are adopted (which follows
the engine and GRPOConfig's ``use_transformers_continuous_batching``). The ``resolved_*`` properties compute the
rest on read (they depend on the machine or on the trainer's precision, which the config does not know when it is
built).
"""

from __future__ import annotations

import os

import torch

from ..hardware.cores import allowed_cores, parse_cpu_list, split_cores
from ..hardware.precision import NativePrecision
from .engine_choice import rollout_engine

DEFAULT_CAPS = {"decoupled": 5.0}  # AReaL's behav_imp_weight_cap in its examples; 2.0 (verl/SkyRL TIS) otherwise


def available_cores() -> int:
    """How many cores this process may run on (its CPU affinity where the OS reports one)."""
    cores = allowed_cores()
    return len(cores) if cores else os.cpu_count() or 1


def resolve_defaults(
    settings,
    loss_type: str | None = None,
    use_vllm: bool = False,
    vllm_mode: str = "colocate",
    vllm_enable_sleep_mode: bool = False,
    use_transformers_continuous_batching: bool = False,
) -> None:
    """Fill the defaults of ``settings`` (an ``AsyncFields``) that GRPO's own fields decide: ``rollout_backend`` and
    ``vllm_colocate`` from ``use_vllm``/``vllm_mode`` (``ValueError`` when they disagree), ``off_policy_correction``
    from ``loss_type`` ('tis' under VESPO, else 'decoupled'), and ``rollout_weight_update`` (``weight_update_default``)."""
    choice = rollout_engine(
        settings.rollout_backend, use_vllm, vllm_mode, settings.rollout_vllm_urls, vllm_enable_sleep_mode
    )
    settings.rollout_backend, settings.vllm_colocate = choice.backend, choice.colocate
    settings.off_policy_correction = correction_default(settings.off_policy_correction, loss_type)
    if settings.rollout_weight_update is None:
        settings.rollout_weight_update = weight_update_default(choice.backend, use_transformers_continuous_batching)


def weight_update_default(backend: str, continuous_batching: bool) -> str:
    """Where new weights are adopted unless ``rollout_weight_update`` says: between decode steps where generation
    runs as a stream that rows join and leave (vLLM servers, paused and resumed; transformers workers with continuous
    batching, re-encoding the rows in flight), else between generate calls."""
    return "decode_step" if backend == "vllm" or continuous_batching else "batch"


def correction_default(given: str | None, loss_type: str | None) -> str:
    """``off_policy_correction`` as given, or its default for ``loss_type``: 'tis' under VESPO, else 'decoupled'."""
    if given is not None:
        return given
    return "tis" if loss_type == "vespo" else "decoupled"


class ResolvedDefaults:
    """The defaults computed on read, mixed into ``AsyncFields``."""

    @property
    def resolved_rollout_threads(self) -> int:
        if self.rollout_torch_threads is not None:
            return self.rollout_torch_threads
        return max(1, available_cores() // self.num_rollout_workers)

    def resolved_rollout_dtype(
        self, weights: torch.dtype, bf16: bool, fp16: bool, native: NativePrecision
    ) -> torch.dtype:
        """``rollout_dtype`` if set; else the dtype the trainer computes in (bf16/fp16 under mixed precision, where
        the trainer's matmuls see its float32 weights rounded to that dtype) where the workers' device computes it
        natively (``native``, trl_async.hardware.precision), else the weights' dtype; the weights' dtype always when weights
        are verified bit for bit."""
        if self.rollout_dtype:
            return getattr(torch, self.rollout_dtype)
        if self.rollout_verify_weights or weights != torch.float32:
            return weights
        mixed = torch.bfloat16 if bf16 else torch.float16 if fp16 else weights
        return mixed if native.native(mixed) else weights

    @property
    def resolved_rollout_nice(self) -> int:
        if self.rollout_nice is not None:
            return self.rollout_nice
        if self.rollout_cpu_affinity is not None:
            return 0  # cores of their own: nothing to yield to
        return 19 if torch.device(self.rollout_device or "cpu").type == "cpu" else 0

    @property
    def resolved_weight_update(self) -> str:
        """``rollout_weight_update``, filled by ``resolve_defaults``; read on a config not yet resolved, the default
        from its own fields (GRPOConfig's ``use_transformers_continuous_batching`` where it has them)."""
        if self.rollout_weight_update is not None:
            return self.rollout_weight_update
        backend = self.rollout_backend or (
            "vllm" if getattr(self, "use_vllm", False) else "transformers"
        )  # an unresolved config's engine follows use_vllm, as resolve_defaults decides it
        return weight_update_default(backend, bool(getattr(self, "use_transformers_continuous_batching", False)))

    @property
    def resolved_importance_sampling_cap(self) -> float:
        if self.importance_sampling_cap is not None:
            return self.importance_sampling_cap
        return DEFAULT_CAPS.get(self.off_policy_correction, 2.0)

    def core_split(self):
        """``CoreSplit`` of ``rollout_cpu_affinity`` against this process's cores now, or ``None`` when unset."""
        if self.rollout_cpu_affinity is None:
            return None
        return split_cores(parse_cpu_list(self.rollout_cpu_affinity), allowed_cores(), self.num_rollout_workers)
