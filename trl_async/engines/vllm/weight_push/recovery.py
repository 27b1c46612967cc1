"""A lost vLLM server's way back: wait for it, check it is the same server, and only then give it work again.

When a server stops answering (killed, preempted, restarted by a supervisor), the pool's health check replaces its
lane (rollout/lanes.py): what it held is generated again on the other lanes, and the replacement lane waits, taking
no work, while training goes on with the others. Its ``Return`` watches the URL:

  1. *down*: the server does not answer. A warning every ``WARN_EVERY_S``; training stops with an error once it has
     been down ``down_limit_s`` (``rollout_vllm_down_limit_s``), or ``retry_s`` (``rollout_vllm_retry_s``) with no
     other lane attached.
  2. *back*: it answers, and its ``/server_info`` names the same model, length, dtype, LoRA set-up and weight
     transport as when training started (``identity``); a server that comes back as something else is refused
     with an error naming both.
  3. *attached*: at the trainer's next publish the backend re-opens the weight transport with it, pushes the current
     weights and version (with LoRA adapters: the frozen base, then the current adapter), checks that it samples
     as a peer does (``backend.py``), and only then does the lane take work again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers.utils import logging

logger = logging.get_logger(__name__)

WARN_EVERY_S = 30.0


def identity(info: dict) -> dict:
    """What must be the same for a server to be taken back: the served model and how it serves it."""
    config = info.get("vllm_config") or {}
    model = config.get("model_config") or {}
    lora = config.get("lora_config") or {}
    transfer = config.get("weight_transfer_config") or {}
    return {
        "model": model.get("model"),
        "max_model_len": model.get("max_model_len"),
        "dtype": model.get("dtype"),
        "logprobs_mode": model.get("logprobs_mode"),
        "max_lora_rank": lora.get("max_lora_rank"),
        "weight_transfer": transfer.get("backend"),
    }


@dataclass(eq=False)
class Return:
    url: str
    expected: dict  # identity() of the server when training started
    down_limit_s: float | None
    retry_s: float
    others_attached: Callable[[], bool]  # whether any other lane is taking work
    state: str = "down"  # "down" -> "back" -> "attached", or "refused" (backend._reattach: its probe differed)
    down_since: float = field(default_factory=time.time)
    back_at: float | None = None
    attached_at: float | None = None
    _warned_at: float = field(default_factory=time.time)

    @property
    def attached(self) -> bool:
        return self.state == "attached"

    def watch(self, healthy: bool, server_info: Callable[[], dict], now: float) -> str | None:
        """One health tick of the waiting lane; returns why training must stop, or None."""
        if self.state == "back" and not healthy:  # gone again before it was re-attached
            self.state, self.back_at = "down", None
        if self.state != "down":
            return None
        if healthy:
            try:
                found = identity(server_info())
            except Exception:  # noqa: BLE001 - not ready yet: try again at the next tick
                return None
            if found != self.expected:
                changed = {k: (self.expected[k], found[k]) for k in found if found[k] != self.expected[k]}
                return (
                    f"vLLM server {self.url} came back serving something else: {changed} (as (before, now)); "
                    "refused. Restart it with the model and flags it had when training started"
                )
            self.state, self.back_at = "back", now
            logger.warning(
                "vLLM server %s is back after %.0fs; it is re-attached at the next weight sync",
                self.url,
                now - self.down_since,
            )
            return None
        down = now - self.down_since
        if self.down_limit_s is not None and down > self.down_limit_s:
            return (
                f"vLLM server {self.url} has been down for {down:.0f}s (rollout_vllm_down_limit_s="
                f"{self.down_limit_s:.0f})"
            )
        if down > self.retry_s and not self.others_attached():
            return f"every vLLM server is down; {self.url} for {down:.0f}s (rollout_vllm_retry_s={self.retry_s:.0f})"
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            logger.warning(
                "vLLM server %s has been down for %.0fs; training goes on with the other servers%s",
                self.url,
                down,
                f" (it stops after {self.down_limit_s:.0f}s)" if self.down_limit_s else "",
            )
        return None

    def lost_again(self) -> None:
        """Its re-attach failed (the server died or stopped answering during the push or the probe): wait to see it
        answer again, then the next weight sync retries."""
        if self.state == "back":
            self.state, self.back_at = "down", None

    def attach(self, now: float) -> float:
        """Re-attached (weights pushed and checked): returns the seconds from going down to taking work again."""
        self.attached_at, self.state = now, "attached"  # (in this order: ``silent_for`` reads both once attached)
        return now - self.down_since
