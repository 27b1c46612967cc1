"""Continuous batching in a transformers worker: a finished row's slot takes the next queued row at once.

The batching is transformers' own (``model.init_continuous_batching``: a paged KV cache, rows joining and leaving
between decode steps). This module adds what a rollout worker needs on top of it:

- **Groups.** A task is ``num_generations`` rows of one prompt, or one row per context of a later turn, each with its
  own token budget. At most ``slots`` rows decode at once; the rest wait here, and a group is returned as soon as its
  last row finishes, not with a batch.
- **Behaviour log-probs.** The manager's ``return_logprobs``: each token's log-prob under the processed distribution
  it was sampled from (temperature, top-k, top-p, min-p and the other warpers, in ``generate``'s order).
- **Per-token versions, each token from one version.** New weights are copied in while the manager is paused between
  decode steps (``swap``), and every row in flight is reset the way transformers resets a row it evicts: its KV cache
  is dropped and its prompt and tokens so far are prefilled again, now with the new weights. So a token sampled after
  the swap saw only the new weights (as a vLLM server recomputes its KV after a push), its behaviour log-prob equals a
  teacher-forced forward of that version, and the row records the index where each version begins.

What transformers' continuous batching lacks, and the static path (``generate_groups``) keeps: processors that read
a row's history (``repetition_penalty``, ``min_new_tokens``, ``no_repeat_ngram_size``, ...; its processors see only
the current token) and beam search. ``generation_modes.continuous_blocker`` names them, and the trainer's
construction refuses them with continuous batching on. The slot loop (``slots.py``) applies the repetition penalty
and ``min_new_tokens`` itself.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...correction.generation_modes import PAGED_REQUIRED
from ...records import RolloutGroup, RolloutTask
from .row_groups import RowGroups, RowsFront, cut_at_eos

PAGE_SIZE = 32  # tokens per KV-cache block, unless the user's settings give page_size


def paged_settings(slots: int, max_context: int, given: dict | None = None) -> dict:
    """ContinuousBatchingConfig keywords for ``slots`` rows of up to ``max_context`` tokens: the user's ``given``
    keywords; a KV cache that holds every row unless they size it (``num_blocks`` or ``max_memory_percent``, in
    transformers' own pages then); and the settings the workers need (``PAGED_REQUIRED``) last."""
    given = dict(given or {})
    sized = {"max_batch_tokens": max(256, 4 * slots)}
    if "num_blocks" not in given and "max_memory_percent" not in given:
        page = given.get("page_size") or given.get("block_size") or PAGE_SIZE  # (block_size: its older name)
        sized.update(page_size=page, num_blocks=slots * (math.ceil(max_context / page) + 1))
    required = {key: needed for key, (needed, _) in PAGED_REQUIRED.items()}
    return {**sized, **given, **required}


def paged_cache_blocker(model_config: Any) -> str | None:
    """Why transformers' paged cache cannot hold this model's layers (its language model's, for a vision-language
    model), or ``None``: it holds full and sliding-window attention, not linear attention's recurrent state."""
    try:
        from transformers.generation.continuous_batching.cache import group_layers_by_attn_type
    except ImportError:  # another layout of transformers: the engine says so itself when it starts
        return None
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    try:
        group_layers_by_attn_type(text)
    except Exception as exc:  # noqa: BLE001 - whatever the paged cache would raise when the engine starts
        kinds = sorted(set(getattr(text, "layer_types", None) or ()))
        return f"its layers are {', '.join(kinds) or 'of a kind'} ({exc})"
    return None


def continuous_slots(enabled: bool, groups_per_call: int, num_generations: int) -> int:
    """Rows a worker decodes at once: the rollout batch in rows with continuous batching, 0 for static batches."""
    return groups_per_call * num_generations if enabled else 0


def versions_of(marks: Sequence[tuple[int, int]], length: int) -> tuple[int, ...]:
    """Each of a row's ``length`` tokens' version: ``marks`` are ``(index of the first token sampled with them,
    version)`` in order; a later mark at the same index replaces an earlier one (weights swapped before a token)."""
    starts = [start for start, _ in marks]
    return tuple(marks[bisect.bisect_right(starts, i) - 1][1] for i in range(length))


def generated_so_far(state) -> int:
    """Tokens a transformers ``RequestState`` has generated, counting those a reset moved into its prompt."""
    moved = len(state.initial_tokens) - state._true_initial_tokens if state._true_initial_tokens else 0
    return moved + len(state.generated_tokens)


@dataclass
class ContinuousRows(RowsFront):
    """Rows waiting for a slot and groups waiting for their rows, around one continuous-batching manager."""

    model: torch.nn.Module
    generation_config: Any
    num_generations: int
    eos_token_ids: Sequence[int]
    slots: int  # rows decoding at once
    max_context: int  # the longest prompt + completion a row may reach (sizes the KV cache)
    current_version: Callable[[], int]
    lane_id: int = 0
    pad_token_id: int = 0  # unused: the paged cache needs no padding (kept for the common interface)
    settings: dict | None = None  # the user's ContinuousBatchingConfig keywords (GRPOConfig's)

    def __post_init__(self) -> None:
        from transformers import ContinuousBatchingConfig

        config = self.generation_config
        self.book = RowGroups(self.num_generations, config.max_new_tokens, self.lane_id)
        settings = ContinuousBatchingConfig(**paged_settings(self.slots, self.max_context, self.settings))
        self._eos = set(self.eos_token_ids)
        self.manager = self.model.init_continuous_batching(
            generation_config=config, continuous_batching_config=settings
        )
        self.manager.start()
        self._budgets: dict[str, int] = {}  # request id -> its token budget
        self._marks: dict[str, list[tuple[int, int]]] = {}  # request id -> (first token index, version), in order

    def submit(self, tasks: Sequence[RolloutTask]) -> None:
        self.book.add(tasks)
        self._fill()

    def _fill(self) -> None:
        for row in self.book.take(self.slots - self.book.active):
            self._marks[row.request] = [(0, self.current_version())]
            self._budgets[row.request] = row.budget
            added = self.manager.add_request(
                list(row.ids), request_id=row.request, max_new_tokens=row.budget, eos_token_id=list(self.eos_token_ids)
            )
            if added is None:
                raise RuntimeError(f"continuous batching refused row {row.request} (its generation loop is stopping)")

    def swap(self, adopt: Callable[[], None]) -> None:
        """Adopt new weights between two decode steps. Every row in flight is reset (its KV cache dropped, its tokens
        so far prefilled again with the new weights), and its next token is the new version's."""
        from transformers.generation.continuous_batching.requests import RequestStatus

        with self.manager.pause():
            adopt()
            version = self.current_version()
            processor = self.manager.batch_processor
            scheduler, cache = processor.scheduler, processor.cache
            counts = {rid: generated_so_far(state) for rid, state in scheduler.waiting_requests.items()}
            for rid, state in list(scheduler.active_requests.items()):
                counts[rid] = generated_so_far(state)
                fresh = state.create_equivalent_initial_request()
                cache.free_blocks(rid, no_cache=True)
                state._status = RequestStatus.FINISHED
                scheduler.finish_request(rid)
                scheduler.add_waiting_request(fresh)
            # after an eviction for lack of cache the scheduler admits no new row until an active one finishes; none
            # is active now, and no row holds cache: without this it would wait forever
            scheduler.block_new_requests = False
            # a row finished before the pause waits in the output queue, all its tokens from the old weights; a row
            # in neither place was added and not yet scheduled: no token yet
            finished = {out.request_id for out in list(self.manager.output_router.output_queue.queue)}
            for rid, marks in self._marks.items():
                if rid not in finished:
                    marks.append((counts.get(rid, 0), version))

    def finished(self, timeout_s: float) -> list[RolloutGroup]:
        """Groups whose last row finished (waits up to ``timeout_s`` for the first result)."""
        done = []
        result = self.manager.get_result(timeout=timeout_s)
        while result is not None:
            if result.error:
                raise RuntimeError(f"continuous batching failed request {result.request_id}: {result.error}")
            if result.is_finished():
                group = self._row_done(result)
                if group is not None:
                    done.append(group)
            result = self.manager.get_result(timeout=0)
        self._fill()
        return done

    def _row_done(self, result) -> RolloutGroup | None:
        tokens = list(result.generated_tokens)
        length = cut_at_eos(tokens, self._eos, self._budgets.pop(result.request_id))
        if len(result.logprobs or []) < length:
            raise RuntimeError(
                f"continuous batching returned {len(tokens)} tokens with {len(result.logprobs or [])} log-probs"
            )
        versions = versions_of(self._marks.pop(result.request_id), length)
        return self.book.row_done(result.request_id, tokens[:length], result.logprobs[:length], versions)

    def close(self) -> None:
        """Stop at once: rows still decoding are not finished (their output would go unused)."""
        self.manager.stop(block=True, timeout=10, hard_stop=True)
