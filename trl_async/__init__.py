"""trl_async: asynchronous GRPO for TRL (background rollout workers, bounded version-tagged queue, staleness
correction). ``from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer``."""

from .config import AsyncGRPOConfig
from .trainer import AsyncGRPOTrainer

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer"]
__version__ = "0.1.0"
