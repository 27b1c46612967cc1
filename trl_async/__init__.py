"""trl_async: asynchronous GRPO for TRL (background rollout workers, bounded version-tagged queue, staleness
correction). ``from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer``.

The two names are loaded on first use: a rollout worker process imports ``trl_async.engines.transformers.worker``, which
needs torch and transformers only, and importing the package eagerly would pull in TRL, peft and the trainer (seconds
per worker start)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import _moved

_moved.install()  # old module paths (trl_async.sync, trl_async.arithmetic, ...) still import

if TYPE_CHECKING:
    from .config import AsyncGRPOConfig
    from .trainer import AsyncGRPOTrainer

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer"]
__version__ = "0.1.0"
_LAZY = {"AsyncGRPOConfig": ".config", "AsyncGRPOTrainer": ".trainer"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trl_async' has no attribute {name!r}")
