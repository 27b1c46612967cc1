"""Continuous batching with a plain KV cache: a fixed number of slots, a finished row's slot refilled at once.

Every row decodes in one batch over one cache (``slot_cache.py``) whose rows are slots and whose columns are shared
steps in time, each row left-padded. Between two decode steps:

- **A row leaves** when it samples an EOS or reaches its budget; its slot stays in the batch, masked out, until a
  waiting row takes it.
- **Rows join** in one batched prefill of their contexts, and each is written into a free slot, right-aligned at the
  cache's used width. Each row's positions count its own tokens only, so padding changes no position and no
  attention score.
- **New weights** (``swap``) are followed by a prefill of every row's tokens so far with them: a token sampled after a
  swap saw only the new weights, as a vLLM server recomputes its KV after a push.

Each token's behaviour log-prob is taken from the scores it was sampled from, after the same processors the trainer
rebuilds (``sampling.processed_logps``): the stop tokens held back before ``min_new_tokens`` (counted per row), the
repetition penalty over the row's own context (never its padding), then the warpers. Each token records the version
of the forward that produced its logits.

transformers' own continuous batching (``continuous.py``, a paged cache) is the engine on a GPU. On a CPU its paged
attention and scheduling cost more per decode step than they save. This loop keeps ``generate``'s model forward and
writes each step's keys and values in place. What it does not cover, and ``continuous_engine`` sends to the paged
engine: models whose cache is not one full attention layer type throughout (sliding windows, linear attention,
shared KV), and runs that configure the paged engine (``transformers_continuous_batching_config``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...correction.sampling import SamplingSettings, processors, settings_of
from ...records import RolloutGroup, RolloutTask
from .decoding import left_padded, split_sampling_warpers
from .row_groups import RowGroups, RowsFront, WaitingRow
from .slot_cache import ROOM, columns_cache, first_used, left_pad, positions, relaid


def slot_loop_blocker(model_config: Any) -> str | None:
    """Why the slot loop cannot hold this model's cache (then transformers' paged engine does), or ``None``."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    try:
        layers = DynamicCache(config=model_config).layers
    except Exception as exc:  # noqa: BLE001 - any config the cache cannot lay out
        return f"its cache layout is unknown ({exc})"
    kinds = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    return f"its cache has {', '.join(kinds)} layers" if kinds else None


def continuous_engine(device: str | torch.device, model_config: Any, paged_settings: dict | None = None) -> type:
    """The continuous loop a worker runs: this slot loop on a CPU, where transformers' paged engine decodes no faster
    than a static batch, unless the model's cache does not fit it or the user configured the paged engine
    (``paged_settings``, GRPOConfig's ``transformers_continuous_batching_config``); transformers' paged engine
    otherwise."""
    if torch.device(device).type == "cpu" and not paged_settings and slot_loop_blocker(model_config) is None:
        return SlotRows
    from .continuous import ContinuousRows

    return ContinuousRows


@dataclass
class _Joining:
    rows: list
    ids: torch.Tensor
    mask: torch.Tensor
    first: torch.Tensor  # each row's first token, from its prefill
    kv: list  # per layer (keys, values): (rows, heads, width, dim)


@dataclass
class _Row:
    request: str
    budget: int
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    versions: list = field(default_factory=list)


@dataclass
class SlotRows(RowsFront):
    """Rows decoding in ``slots`` slots of one left-padded batch; the same interface as ``ContinuousRows``."""

    model: torch.nn.Module
    generation_config: Any
    num_generations: int
    eos_token_ids: Sequence[int]
    slots: int
    max_context: int  # unused: the cache grows with the rows (kept for the common interface)
    current_version: Callable[[], int]
    lane_id: int = 0
    pad_token_id: int = 0
    room: int = ROOM  # free columns after each re-layout of the cache

    def __post_init__(self) -> None:
        self.book = RowGroups(self.num_generations, self.generation_config.max_new_tokens, self.lane_id)
        self.device = next(self.model.parameters()).device
        _, self.warpers = split_sampling_warpers(self.generation_config, self.device)
        self.do_sample = bool(self.generation_config.do_sample)
        sampler = settings_of("transformers", self.generation_config.to_dict())
        if not self.do_sample and sampler.repetition_penalty != 1.0:  # greedy: generate applies the penalty alone
            only = SamplingSettings("transformers", repetition_penalty=sampler.repetition_penalty)
            self.warpers = processors(only, self.device)
        self.penalised = sampler.repetition_penalty != 1.0  # the warpers read each row's context
        self.min_new_tokens, self.stop_ids = sampler.min_new_tokens, list(sampler.stop_ids)
        # the cache's keyword: ``cache`` from transformers 5.25 on, ``past_key_values`` before
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.eos = set(self.eos_token_ids)
        self.rows: list[_Row | None] = []  # per slot of the batch: its row, or None (free)
        self.past = None  # the cache (slot_cache.py): per layer (slots, heads, columns, dim)
        self.ids = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # the tokens whose KV is cached
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self.last = torch.zeros(0, dtype=torch.long, device=self.device)  # each row's newest token, not yet cached

    def submit(self, tasks: Sequence[RolloutTask]) -> None:
        self.book.add(tasks)

    def finished(self, timeout_s: float = 0.0) -> list[RolloutGroup]:
        """Decode one step, refill the slots that frees, and return the groups whose last row finished."""
        del timeout_s  # one step per call: the worker polls its pipe between steps
        groups = []
        with torch.no_grad():
            if self.live:
                self._decode()
            while True:  # rows that join sample their first token in their prefill: some may be done at once
                done = [i for i, row in enumerate(self.rows) if row is not None and self._is_done(row)]
                for i in done:
                    row, self.rows[i] = self.rows[i], None
                    self.mask[i] = 0
                    group = self.book.row_done(row.request, row.tokens, row.logprobs, row.versions)
                    if group is not None:
                        groups.append(group)
                joining = self.book.take(self.slots - len(self.live))
                if joining:
                    self._place(self._prefill_rows(joining))
                elif not done:
                    break
            live = len(self.live)
            if not self.book.waiting and len(self.rows) > live and 2 * live <= len(self.rows):
                self._relay(extra_rows=0)  # a tail, half the slots free: stop decoding them
        return groups

    @property
    def live(self) -> list[int]:
        return [i for i, row in enumerate(self.rows) if row is not None]

    def swap(self, adopt: Callable[[], None]) -> None:
        """Adopt new weights between two decode steps, and rebuild every row's cache with them."""
        adopt()
        if self.live:
            with torch.no_grad():
                self._relay(extra_rows=0)  # free slots have no tokens to prefill
                past = self._prefill(self.ids, self.mask)[1]
            self.past = columns_cache([(layer.keys, layer.values) for layer in past.layers], room=self.room)

    def close(self) -> None:
        self.rows, self.past = [], None

    # ---- the loop ----------------------------------------------------------------------------------------------
    def _is_done(self, row: _Row) -> bool:
        return len(row.tokens) >= row.budget or row.tokens[-1] in self.eos

    def _forward(self, ids, mask, pos, past):
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
            **{self._cache_arg: past},
        )  # fmt: skip
        return out.logits[:, -1], out[self._cache_arg]

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor):
        from transformers import DynamicCache

        return self._forward(ids, mask, positions(mask), DynamicCache())

    def _decode(self) -> None:
        if self.mask.size(1) >= self.past.layers[0].capacity:  # no room: re-lay out, keeping free slots rows wait for
            self._relay(extra_rows=len(self.rows) - len(self.live) if self.book.waiting else 0)
        mask = torch.cat([self.mask, torch.ones_like(self.last)[:, None]], dim=1)
        pos = self.mask.sum(-1, keepdim=True)
        logits, self.past = self._forward(self.last[:, None], mask, pos, self.past)
        live = self.live  # (free slots decode too: no other row attends to them, and they are never sampled)
        self.ids, self.mask = torch.cat([self.ids, self.last[:, None]], dim=1), mask
        index = torch.tensor(live, dtype=torch.long, device=self.device)
        seen = (self.ids[index], self.mask[index]) if self.penalised else None
        self.last[index] = self._sample(logits[index], [self.rows[i] for i in live], seen)

    def _prefill_rows(self, joining: list[WaitingRow]) -> _Joining:
        """The joining rows' contexts, left-padded among themselves and prefilled; their first token sampled."""
        ids, mask = (t.to(self.device) for t in left_padded([r.ids for r in joining], self.pad_token_id))
        logits, past = self._prefill(ids, mask)
        rows = [_Row(r.request, r.budget) for r in joining]
        first = self._sample(logits, rows, (ids, mask) if self.penalised else None)
        return _Joining(rows, ids, mask, first, [(layer.keys, layer.values) for layer in past.layers])

    def _place(self, joining: _Joining) -> None:
        """Write the joining rows into free slots (more slots, or a wider cache, when they do not fit)."""
        if self.past is None:
            self.rows = list(joining.rows)
            self.ids, self.mask, self.last = joining.ids, joining.mask, joining.first
            self.past = columns_cache(joining.kv, room=self.room)
            return
        free = [i for i, row in enumerate(self.rows) if row is None]
        width = joining.ids.size(1)
        if len(free) < len(joining.rows) or width > self.mask.size(1):  # (the new layout drops the free slots)
            self._relay(extra_rows=len(joining.rows), width=width)
            free = [i for i, row in enumerate(self.rows) if row is None]
        used = self.mask.size(1)
        for i, (slot, row) in enumerate(zip(free[: len(joining.rows)], joining.rows, strict=True)):
            self.rows[slot] = row
            self.ids[slot], self.mask[slot] = left_pad(joining.ids[i], used, 0), left_pad(joining.mask[i], used, 0)
            self.last[slot] = joining.first[i]
            for layer, (keys, values) in zip(self.past.layers, joining.kv, strict=True):
                layer.put(slot, keys[i], values[i])

    def _relay(self, extra_rows: int, width: int = 0) -> None:
        """Copy the cache into a new layout: the live rows only, the columns none of them uses cut off, at least
        ``width`` columns wide, ``extra_rows`` free slots after them, and room to decode."""
        live = self.live
        if not live and not extra_rows:  # nothing decoding: the next rows start a new cache
            self.rows, self.past = [], None
            self.ids, self.mask, self.last = self.ids[:0, :0], self.mask[:0, :0], self.last[:0]
            return
        index = torch.tensor(live, dtype=torch.long, device=self.device)
        mask = self.mask[index]
        start = first_used(mask)
        width = max(mask.size(1) - start, width)
        self.past = relaid(self.past, index, start, extra_rows, width, self.room)
        self.rows = [self.rows[i] for i in live] + [None] * extra_rows
        pad = torch.zeros(extra_rows, width, dtype=torch.long, device=self.device)
        self.ids = torch.cat([left_pad(self.ids[index, start:], width, 1), pad])
        self.mask = torch.cat([left_pad(mask[:, start:], width, 1), pad])
        self.last = torch.cat([self.last[index], pad[:, 0] + self.pad_token_id])

    def _sample(self, logits: torch.Tensor, rows: list[_Row], seen=None) -> torch.Tensor:
        """Sample each row's next token from the processed scores; record it with its log-prob and version. ``seen``:
        ``(ids, mask)`` of what each row has seen, for the repetition penalty."""
        scores = logits.float()
        if self.min_new_tokens and self.stop_ids:
            early = torch.tensor([len(row.tokens) < self.min_new_tokens for row in rows], device=self.device)
            stop = torch.zeros(scores.size(-1), dtype=torch.bool, device=self.device)
            stop[[i for i in self.stop_ids if i < scores.size(-1)]] = True
            scores = scores.masked_fill(early[:, None] & stop[None, :], -torch.inf)
        history = None
        if seen is not None:  # padding and free columns: an id past the vocabulary, which the penalty skips
            ids, mask = seen
            history = torch.where(mask.bool(), ids, torch.full_like(ids, scores.size(-1)))
        scores = self.warpers(history, scores)
        logprobs = torch.log_softmax(scores, dim=-1)
        if self.do_sample:
            tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            tokens = scores.argmax(dim=-1)
        taken = logprobs.gather(-1, tokens[:, None]).squeeze(-1).tolist()
        version = self.current_version()
        for row, token, logprob in zip(rows, tokens.tolist(), taken, strict=True):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.versions.append(version)
        return tokens
