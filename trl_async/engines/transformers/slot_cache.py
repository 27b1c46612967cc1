"""The slot loop's KV cache: one buffer per layer, (slots, heads, capacity, dim), whose rows are slots and whose
columns are shared positions in time, left-padded per row.

A decode step writes one column into every layer in place (``_Columns.update``), where ``DynamicCache`` would copy
the whole cache to append it. A joining row is written into a free slot's row. The whole buffer is copied only when
its shape changes (``relaid``): more slots, a context wider than the used columns, or no room left (then the leading
columns no row uses any more are cut off).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

ROOM = 32  # free columns after a re-layout: one full copy per ROOM decode steps at most


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


def first_used(mask: torch.Tensor) -> int:
    """The first column any row uses (the mask's width when none does)."""
    used = mask.any(0).nonzero()
    return int(used[0]) if len(used) else mask.size(1)


class _Columns(DynamicLayer):
    """A cache layer with room to grow: a step's keys and values are written in place after the used columns."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, width: int) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.buffers, self.width = (keys, values), width
        self.keys, self.values = keys[:, :, :width], values[:, :, :width]

    @property
    def capacity(self) -> int:
        return self.buffers[0].size(2)

    def update(self, key_states, value_states, *args, **kwargs):
        end = self.width + key_states.size(-2)
        if end > self.capacity:  # the loop re-lays the cache out before this; a model calling twice still works
            room = max(end, 2 * self.capacity) - self.capacity
            self.buffers = tuple(
                torch.cat([b, b.new_zeros(*b.shape[:2], room, b.size(3))], dim=2) for b in self.buffers
            )
        keys, values = self.buffers
        keys[:, :, self.width : end] = key_states
        values[:, :, self.width : end] = value_states
        self.width = end
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]
        return self.keys, self.values

    def _reshaped(self, *args, **kwargs):
        raise NotImplementedError("a slot cache layer changes shape only through slot_cache.relaid")

    crop = batch_select_indices = batch_repeat_interleave = reorder_cache = _reshaped

    def put(self, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A slot's row: ``keys``/``values`` (heads, w, dim) right-aligned at the used width, zeros before them."""
        w = keys.size(1)
        for buffer, new in zip(self.buffers, (keys, values), strict=True):
            buffer[row, :, : self.width - w] = 0
            buffer[row, :, self.width - w : self.width] = new


def columns_cache(layers: list[tuple[torch.Tensor, torch.Tensor]], width: int | None = None, room: int = ROOM):
    """A ``DynamicCache`` of ``_Columns`` layers from per-layer (keys, values) of shape (rows, heads, w, dim), each
    right-aligned at ``width`` (default w) with ``room`` free columns after it."""
    from transformers import DynamicCache

    out = []
    for keys, values in layers:
        w = keys.size(2)
        width = w if width is None else width
        buffers = []
        for t in (keys, values):
            buffer = t.new_zeros(t.size(0), t.size(1), width + room, t.size(3))
            buffer[:, :, width - w : width] = t
            buffers.append(buffer)
        out.append(_Columns(*buffers, width))
    cache = DynamicCache()
    cache.layers = out
    return cache


def relaid(cache, keep: torch.Tensor, start: int, extra_rows: int, width: int, room: int = ROOM):
    """A new cache of the rows ``keep`` (their columns from ``start`` on, right-aligned at ``width``) and
    ``extra_rows`` empty rows after them, with ``room`` free columns."""
    layers = []
    for layer in cache.layers:
        kept = [t[keep, :, start:] for t in (layer.keys, layer.values)]
        if extra_rows:
            kept = [torch.cat([t, t.new_zeros(extra_rows, *t.shape[1:])]) for t in kept]
        layers.append(tuple(kept))
    return columns_cache(layers, width, room)
