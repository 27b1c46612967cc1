"""trl_async: asynchronous GRPO for TRL (background rollout workers, bounded version-tagged queue, staleness
correction). ``from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer``.

The package's names are loaded on first use: a rollout worker process imports ``trl_async.engines.transformers.worker``,
which needs torch and transformers only, and importing the package eagerly would pull in TRL, peft and the trainer
(seconds per worker start). Besides the trainer and its config it exports the errors a run can raise to the caller
and the progress callback the trainer installs; agents trained through an OpenAI-compatible endpoint are in
``trl_async.agents``; the sandbox, the code-execution reward and the Python tool are in
``trl_async.sandbox``."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import AsyncGRPOConfig
    from .engines.vllm.client import VLLMServerError
    from .reporting.progress import AsyncProgressCallback
    from .rollout.lanes import RolloutLaneError
    from .rollout.rollout_func import GroupAbandoned
    from .rollout.scoring import RewardFunctionError
    from .sandbox import SandboxError, SandboxUnavailable
    from .trainer import AsyncGRPOTrainer

__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "AsyncProgressCallback",
    "GroupAbandoned",
    "RewardFunctionError",
    "RolloutLaneError",
    "SandboxError",
    "SandboxUnavailable",
    "VLLMServerError",
]
__version__ = "0.1.0"
_LAZY = {
    "AsyncGRPOConfig": ".config",
    "AsyncGRPOTrainer": ".trainer",
    "AsyncProgressCallback": ".reporting.progress",
    "GroupAbandoned": ".rollout.rollout_func",
    "RewardFunctionError": ".rollout.scoring",
    "RolloutLaneError": ".rollout.lanes",
    "SandboxError": ".sandbox",
    "SandboxUnavailable": ".sandbox",
    "VLLMServerError": ".engines.vllm.client",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trl_async' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
