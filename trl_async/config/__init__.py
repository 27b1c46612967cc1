"""``AsyncGRPOConfig``: ``trl.GRPOConfig`` plus the few fields asynchronous training needs.

The async fields live once, in ``AsyncFields`` (``async_fields.py``); ``AsyncGRPOConfig`` mixes them into
``GRPOConfig``, and a plain ``GRPOConfig`` given to the trainer gets ``AsyncFields()`` defaults. Building the settings
takes two steps: ``defaults.resolve_defaults`` fills what depends on GRPO's own fields, then
``checks.check_async_fields`` validates every field (``ValueError`` naming the field and the fix)."""

from __future__ import annotations

import copy
import importlib.util
import os
from dataclasses import dataclass, fields

from trl import GRPOConfig

from . import reference
from .async_fields import (
    LORA_SYNCS,
    OFF_POLICY_CORRECTIONS,
    ROLLOUT_BACKENDS,
    ROLLOUT_DTYPES,
    WEIGHT_TRANSPORTS,
    WEIGHT_UPDATE_POINTS,
    AsyncFields,
)
from .checks import check_async_fields
from .defaults import DEFAULT_CAPS, available_cores, resolve_defaults

__all__ = [
    "DEFAULT_CAPS",
    "LORA_SYNCS",
    "OFF_POLICY_CORRECTIONS",
    "ROLLOUT_BACKENDS",
    "ROLLOUT_DTYPES",
    "WEIGHT_TRANSPORTS",
    "WEIGHT_UPDATE_POINTS",
    "AsyncFields",
    "AsyncGRPOConfig",
    "async_fields_of",
    "available_cores",
    "for_grpo_trainer",
    "settle",
    "trl_engine_fields",
]


def require_deepspeed(deepspeed_config) -> None:
    """A DeepSpeed run (``deepspeed=`` here, or ``accelerate launch`` with a DeepSpeed config) without the package
    fails deep inside transformers or accelerate; name the extra to install first."""
    wanted = bool(deepspeed_config) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    if wanted and importlib.util.find_spec("deepspeed") is None:
        raise ImportError(
            'this run uses DeepSpeed, which is not installed: pip install deepspeed (or `pip install -e ".[deepspeed]"` '
            "in a source checkout of trl_async)"
        )


def settle(settings: AsyncFields, args) -> AsyncFields:
    """Resolve the defaults of ``settings`` against GRPO's fields in ``args``, then check every field."""
    trl = trl_engine_fields(args)
    resolve_defaults(settings, **trl)
    check_async_fields(settings, trl["loss_type"])
    return settings


def async_fields_of(args: GRPOConfig) -> AsyncFields:
    """The async settings of ``args``: its own for an ``AsyncGRPOConfig``, the defaults for a plain ``GRPOConfig``."""
    settings = AsyncFields(
        **{f.name: getattr(args, f.name) for f in fields(AsyncFields) if f.init and hasattr(args, f.name)}
    )
    return settle(settings, args)


def trl_engine_fields(args) -> dict:
    """GRPOConfig's fields that the async settings resolve against."""
    return {
        "loss_type": getattr(args, "loss_type", None),
        "use_vllm": getattr(args, "use_vllm", False),
        "vllm_mode": getattr(args, "vllm_mode", "colocate"),
        "vllm_enable_sleep_mode": getattr(args, "vllm_enable_sleep_mode", False),
    }


def for_grpo_trainer(args):
    """``args`` as GRPOTrainer's own set-up must see them: with ``use_vllm`` off (a copy), since the async settings
    already turned TRL's vLLM fields into the rollout engine, and GRPOTrainer would otherwise start or connect to a
    vLLM of its own."""
    if args is None or not getattr(args, "use_vllm", False):
        return args
    parent = copy.copy(args)
    parent.use_vllm = False
    parent.use_transformers_continuous_batching = False  # with vLLM GRPOTrainer ignores it, evaluation included
    return parent


@dataclass
class AsyncGRPOConfig(GRPOConfig, AsyncFields):
    __doc__ = reference.docstring()

    def __post_init__(self):
        require_deepspeed(self.deepspeed)
        super().__post_init__()
        given = self.rollout_backend
        settle(self, self)
        # kept as set: the engine is resolved again, with use_vllm as it is then, wherever the settings are read
        # (async_fields_of), so a config copied with another use_vllm follows it
        self.rollout_backend, self.vllm_colocate = given, False
