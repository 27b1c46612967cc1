"""``AsyncGRPOConfig``: ``trl.GRPOConfig`` plus the few fields asynchronous training needs.

The async fields live once, in ``AsyncFields`` (``async_fields.py``); ``AsyncGRPOConfig`` mixes them into
``GRPOConfig``, and a plain ``GRPOConfig`` given to the trainer gets ``AsyncFields()`` defaults. Building the settings
takes one call, ``resolve_settings``: ``defaults.resolve_defaults`` fills what depends on GRPO's own fields,
``checks.check_async_fields`` validates every field (``ValueError`` naming the field and the fix), and the trainer's
device decides where the transformers workers generate. The result is read-only."""

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
from .defaults import DEFAULT_CAPS, available_cores, correction_default, resolve_defaults
from .engine_choice import settle_rollout_device

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
    "available_cores",
    "for_grpo_trainer",
    "resolve_settings",
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


def resolve_settings(args, trainer_device=None) -> AsyncFields:
    """The async settings of a run on ``args`` (an ``AsyncGRPOConfig``'s own, or the defaults for a plain
    ``GRPOConfig``), resolved in one place: the engine from GRPOConfig's ``use_vllm``/``vllm_mode``, the correction
    from ``loss_type``, and, given the trainer's device, where the transformers workers generate. Every field is
    checked (``ValueError`` naming it and the fix). The result is read-only: the one object the trainer, the pool and
    the publisher read. ``args`` itself is left as it was given."""
    settings = AsyncFields(
        **{f.name: getattr(args, f.name) for f in fields(AsyncFields) if f.init and hasattr(args, f.name)}
    )
    trl = trl_engine_fields(args)
    resolve_defaults(settings, **trl)
    # an AsyncGRPOConfig's rules read GRPOConfig's fields beside the async ones; a plain GRPOConfig gets the async
    # defaults, checked alone (the transformers workers' rules on its own fields run after loading, setup/checks.py)
    check_async_fields(
        _BesideGRPOFields(settings, args) if isinstance(args, AsyncFields) else settings, trl["loss_type"]
    )
    if trainer_device is not None:
        settle_rollout_device(settings, trainer_device)
    settings.seal()
    return settings


class _BesideGRPOFields:
    """The settings, with GRPOConfig's own fields of ``args`` beside them: the cross-field rules read both
    (``generation_kwargs``, ``top_k``, continuous batching)."""

    def __init__(self, settings: AsyncFields, args) -> None:
        self._settings, self._args = settings, args

    def __getattr__(self, name):
        return getattr(self._settings if hasattr(self._settings, name) else self._args, name)


def trl_engine_fields(args) -> dict:
    """GRPOConfig's fields that the async settings resolve against."""
    return {
        "loss_type": getattr(args, "loss_type", None),
        "use_vllm": getattr(args, "use_vllm", False),
        "vllm_mode": getattr(args, "vllm_mode", "colocate"),
        "vllm_enable_sleep_mode": getattr(args, "vllm_enable_sleep_mode", False),
        "use_transformers_continuous_batching": bool(getattr(args, "use_transformers_continuous_batching", False)),
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
        # as GRPOConfig fills its own derived fields: the correction follows loss_type, a field of this config
        self.off_policy_correction = correction_default(self.off_policy_correction, self.loss_type)
        # every field checked now; the engine is left as given, since it follows use_vllm, which a copy of this
        # config may change: it is resolved when a trainer reads the config (resolve_settings)
        resolve_settings(self)
