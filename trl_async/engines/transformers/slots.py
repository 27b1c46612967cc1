"""Continuous batching with a plain KV cache: a fixed number of slots, a finished row's slot refilled at once.

The batch is one ``DynamicCache`` whose rows are left-padded to a common width. Between two decode steps:

- **A row leaves** when it samples an EOS or reaches its budget: its cache row is dropped, and the leading columns
  that no remaining row uses are cut off, so the width stays that of the oldest row in flight, as in a static batch.
- **Rows join** in one batched prefill of their contexts; their cache is left-padded to the batch's width (or the
  batch to theirs) and stacked under it. Each row's positions count its own tokens only, so padding changes no
  position and no attention score.
- **New weights** (``swap``) are followed by a prefill of every row's tokens so far with them: a token sampled after a
  swap saw only the new weights, as a vLLM server recomputes its KV after a push.

Each token's behaviour log-prob is taken from the scores it was sampled from, after the same warpers the trainer
rebuilds (``sampling.processors``), and each token records the version of the forward that produced its logits.

transformers' own continuous batching (``continuous.py``, a paged cache) is the engine on a GPU. On a CPU its paged
attention and scheduling cost more per decode step than they save: a static ``generate`` batch decodes as fast. This
loop keeps ``generate``'s per-step cost (the same model forward, the same cache) and adds only the slot refill.
What it does not cover, and ``continuous_engine`` sends to the paged engine: models whose cache is not one full
attention layer type throughout (sliding windows, linear attention, shared KV).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...records import RolloutGroup, RolloutTask
from .row_groups import RowGroups, WaitingRow
from .worker import split_sampling_warpers


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


def continuous_engine(device: str | torch.device, model_config: Any) -> type:
    """The continuous loop a worker runs: this slot loop on a CPU, where transformers' paged engine decodes no faster
    than a static batch, unless the model's cache does not fit it; transformers' paged engine otherwise."""
    if torch.device(device).type == "cpu" and slot_loop_blocker(model_config) is None:
        return SlotRows
    from .continuous import ContinuousRows

    return ContinuousRows


def left_pad(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``tensor`` widened to ``width`` along ``dim`` with zeros in front."""
    missing = width - tensor.size(dim)
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Each column's position in its row's own tokens (padding: 0), for a left-padded ``mask``."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


@dataclass
class _Row:
    request: str
    budget: int
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    versions: list = field(default_factory=list)


@dataclass
class SlotRows:
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

    def __post_init__(self) -> None:
        self.book = RowGroups(self.num_generations, self.generation_config.max_new_tokens, self.lane_id)
        self.device = next(self.model.parameters()).device
        _, self.warpers = split_sampling_warpers(self.generation_config, self.device)
        self.do_sample = bool(self.generation_config.do_sample)
        # the cache's keyword: ``cache`` from transformers 5.25 on, ``past_key_values`` before
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.eos = set(self.eos_token_ids)
        self.rows: list[_Row] = []  # in the batch's row order
        self.past = None  # DynamicCache of every row: per layer (rows, heads, width, dim)
        self.ids = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # the tokens whose KV is cached
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self.last = torch.zeros(0, dtype=torch.long, device=self.device)  # each row's newest token, not yet cached

    # the interface the worker's loop uses (``serve_continuously``)
    @property
    def busy(self) -> bool:
        return self.book.busy

    @property
    def active(self) -> int:
        return self.book.active

    @property
    def waiting(self):
        return self.book.waiting

    @property
    def occupancy(self):
        return self.book.occupancy

    def submit(self, tasks: Sequence[RolloutTask]) -> None:
        self.book.add(tasks)

    def finished(self, timeout_s: float = 0.0) -> list[RolloutGroup]:
        """Decode one step, refill the slots that frees, and return the groups whose last row finished."""
        del timeout_s  # one step per call: the worker polls its pipe between steps
        groups = []
        with torch.no_grad():
            if self.rows:
                self._decode()
                groups += self._retire()
            joining = self.book.take(self.slots - len(self.rows))
            if joining:  # their first token comes from their prefill: they decode from the next step on
                self._join(joining)
                groups += self._retire()
        return groups

    def swap(self, adopt: Callable[[], None]) -> None:
        """Adopt new weights between two decode steps, and rebuild every row's cache with them."""
        adopt()
        if self.rows:
            with torch.no_grad():
                self.past = self._prefill(self.ids, self.mask)[1]

    def close(self) -> None:
        self.rows, self.past = [], None

    # ---- the loop ----------------------------------------------------------------------------------------------
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
        mask = torch.cat([self.mask, torch.ones_like(self.last)[:, None]], dim=1)
        pos = self.mask.sum(-1, keepdim=True)
        logits, self.past = self._forward(self.last[:, None], mask, pos, self.past)
        self.ids, self.mask = torch.cat([self.ids, self.last[:, None]], dim=1), mask
        self.last = self._sample(logits, self.rows)

    def _join(self, joining: list[WaitingRow]) -> None:
        """Prefill the joining rows and stack them under the batch; their first token is sampled from the prefill."""
        width = max(len(r.ids) for r in joining)
        ids = torch.full((len(joining), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(joining), width), dtype=torch.long)
        for i, row in enumerate(joining):
            ids[i, width - len(row.ids) :] = torch.tensor(row.ids)
            mask[i, width - len(row.ids) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        logits, past = self._prefill(ids, mask)
        new = [_Row(r.request, r.budget) for r in joining]
        first = self._sample(logits, new)
        if self.rows:  # stack under the running batch, both left-padded to the wider one
            width = max(width, self.ids.size(1))
            for old, layer in zip(self.past.layers, past.layers, strict=True):
                layer.keys = torch.cat([left_pad(old.keys, width, 2), left_pad(layer.keys, width, 2)])
                layer.values = torch.cat([left_pad(old.values, width, 2), left_pad(layer.values, width, 2)])
            ids = torch.cat([left_pad(self.ids, width, 1), left_pad(ids, width, 1)])
            mask = torch.cat([left_pad(self.mask, width, 1), left_pad(mask, width, 1)])
            first = torch.cat([self.last, first])
        self.rows += new
        self.past, self.ids, self.mask, self.last = past, ids, mask, first

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """Sample each row's next token from the processed scores; record it with its log-prob and version."""
        scores = self.warpers(None, logits.float())
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

    def _retire(self) -> list[RolloutGroup]:
        """Rows that sampled an EOS or reached their budget leave; the columns no row uses any more are cut off."""
        done = [i for i, row in enumerate(self.rows) if len(row.tokens) >= row.budget or row.tokens[-1] in self.eos]
        if not done:
            return []
        groups = []
        for i in done:
            row = self.rows[i]
            group = self.book.row_done(row.request, row.tokens, row.logprobs, row.versions)
            if group is not None:
                groups.append(group)
        keep = [i for i in range(len(self.rows)) if i not in set(done)]
        self.rows = [self.rows[i] for i in keep]
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        ids, mask = self.ids[index], self.mask[index]
        used = mask.any(0).nonzero()
        start = int(used[0]) if len(used) else mask.size(1)
        self.ids, self.mask, self.last = ids[:, start:], mask[:, start:], self.last[index]
        for layer in self.past.layers:
            layer.keys, layer.values = layer.keys[index, :, start:], layer.values[index, :, start:]
        return groups
