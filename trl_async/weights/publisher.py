"""``WeightPublisher``: the one way weights leave the trainer. It decides whether LoRA training sends the adapters
alone, agrees on that across ranks once the pool has started, remembers when the frozen base must go (with the first
version, and again for a vLLM server that came back), and streams the policy bucket by bucket into the pool (with a
digest of it when weights are verified), or, on ranks without a pool, through the same gathers and nowhere (under
ZeRO-3 every rank's shards move to rank 0).

Every rank calls ``publish`` in the same order, on the main thread."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch
from accelerate.utils import is_peft_model
from transformers.utils import logging

from .lora import adapter_sync_blocker
from .policy import iter_policy_buckets, policy_units
from .shared_memory import Digest

logger = logging.get_logger(__name__)


def _say_merged_instead(reason: str) -> None:
    logger.warning(
        f"rollout_lora_sync='adapters': every weight sync sends the merged full weights instead, because {reason}."
        " Set rollout_lora_sync='merged' to silence this."
    )


def adapter_only_sync(model, lora_sync: str, is_main_process: bool) -> bool:
    """Whether weight syncs send the LoRA adapters alone (``rollout_lora_sync="adapters"``, weights/lora.py). Where a
    peft model's updates cannot go that way, the main process says why once and the merged full weights are sent
    (every rank decides alike: it depends on the model's structure only)."""
    if not is_peft_model(model):
        return False
    policy_units(model)  # refuses here, at construction, what neither way can send (DoRA, lora_bias, merged layers)
    if lora_sync == "merged":
        return False
    reason = adapter_sync_blocker(model)
    if reason is not None and is_main_process:
        _say_merged_instead(reason)
    return reason is None


def main_process_says(num_processes: int, flag: bool) -> bool:
    """``flag`` as the main process has it, on every rank."""
    if num_processes == 1:
        return flag
    box = [flag]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def drain(buckets: Iterator) -> None:
    """Take part in the gathers of a stream that goes nowhere (a rank without the pool)."""
    for _ in buckets:
        pass


class WeightPublisher:
    """Publishes the trainer's weights as versions. ``model``: returns the unwrapped policy; ``dist``: the trainer's
    distributed view (``gather_params``, ``is_zero3``)."""

    def __init__(self, model: Callable, dist, async_args, num_processes: int, is_main_process: bool) -> None:
        self._model, self._dist, self._args = model, dist, async_args
        self._num_processes = num_processes
        self.adapter_sync = adapter_only_sync(model(), async_args.rollout_lora_sync, is_main_process)
        self._base_pending = False
        self._pool = None

    def attach(self, pool) -> None:
        """The pool has started (``None`` on ranks without one). A vLLM server without LoRA, or with a smaller
        ``--max-lora-rank``, is found only now (the backend says why, logged here); every rank takes the main
        process's answer, since all of them stream the same part of the model. The frozen base goes with the first
        version."""
        self._pool = pool
        if self.adapter_sync:
            agreed = True
            blocker = pool.backend.adapter_blocker if pool is not None else None
            if blocker is not None:
                _say_merged_instead(blocker)
                agreed = False
            self.adapter_sync = main_process_says(self._num_processes, agreed)
        self._base_pending = self.adapter_sync

    def detach(self) -> None:
        self._pool = None

    def _base_needed_again(self) -> bool:
        """Adapter-only sync to vLLM: whether a server that came back must get the frozen base with this publish."""
        if not self.adapter_sync or self._args.rollout_backend != "vllm":
            return False
        return main_process_says(self._num_processes, self._pool is not None and self._pool.backend.needs_base)

    def _stream(self, part: str, out) -> Iterator:
        return iter_policy_buckets(
            self._model(),
            self._dist.gather_params,
            int(self._args.weight_sync_bucket_mb * 2**20),
            flat_zero3=self._dist.is_zero3,
            out=out,  # ZeRO-3 shards land there directly
            persistent_only=self._args.rollout_backend == "vllm",  # a vLLM model loads checkpoint tensors
            part=part,
        )

    def publish(self, version: int) -> float | None:
        """All ranks, main thread, same order: stream the policy bucket by bucket; the main process hands each
        bucket to the pool before the next one is gathered. With adapter-only LoRA sync the frozen rest goes when
        pending, and then only the adapters. Returns the seconds it took where there is a pool, else ``None``."""
        pool = self._pool
        base_s = 0.0
        self._base_pending = self._base_pending or self._base_needed_again()  # a vLLM server came back
        if self._base_pending:
            self._base_pending = False
            start = time.perf_counter()
            base = self._stream("frozen", pool.base_target if pool is not None else None)
            pool.publish_base(base, version, self._digest()) if pool is not None else drain(base)
            base_s = time.perf_counter() - start
        target = pool.publish_target if pool is not None else None
        buckets = self._stream("adapters" if self.adapter_sync else "full", target)
        if pool is None:
            drain(buckets)
            return None
        return pool.publish(buckets, version, self._digest()) + base_s

    def _digest(self) -> Digest | None:
        """What the workers must report adopting (``rollout_verify_weights``), filled as the buckets stream."""
        return Digest() if self._args.rollout_verify_weights else None
