"""The running batch's KV cache: rows left-padded to one length, appended in place.

Without a pool the batch's buffers have rows and columns to spare and are changed in place: a row
that leaves takes the last row's place, a row that joins is written into a free row, and a decode
step appends a column; only running out of rows or columns reallocates (and copies) them. With a
``KVPool`` (the CUDA-graph decode, ``graphs``) the rows live in buffers allocated once for
``max_batch_size`` rows, so that a captured decode step finds them at the same addresses every step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from turnrl.engines.hf.requests import Request

_SPARE_COLUMNS = 64  # the fewest free KV columns left by a reallocation (decode steps append into them)
POOL_COLUMNS = 256  # a pool's columns grow in multiples of this (and graphs are captured per multiple)

KV = tuple[torch.Tensor, torch.Tensor]  # one row's keys and values in one layer, [heads, len, dim]


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer over buffers with room to spare: rows ``[0, rows)`` and columns
    ``[start, end)`` are the cache, every row right-aligned at ``end`` (left-padded). A forward pass
    appends at ``end``; the buffers grow only when their columns run out."""

    def __init__(self, buffers: KV, rows: int, start: int, end: int) -> None:
        super().__init__()
        self._keys_buf, self._values_buf = buffers
        k = buffers[0]
        self.dtype, self.device, self.is_initialized = k.dtype, k.device, True
        self.rows, self.start, self.end = rows, start, end
        self._view()

    @classmethod
    def stacked(cls, rows: Sequence[KV], spare: int = _SPARE_COLUMNS) -> GrowingLayer:
        """Per-row ``(keys, values)`` of shape ``[heads, len, dim]`` stacked, right-aligned."""
        length = max(k.shape[-2] for k, _ in rows)
        k0 = rows[0][0]
        shape = (len(rows), k0.shape[0], length + spare, k0.shape[-1])
        layer = cls((k0.new_zeros(shape), k0.new_zeros(shape)), len(rows), 0, length)
        for b, kv in enumerate(rows):
            layer.write_row(b, kv)
        return layer

    @property
    def capacity(self) -> tuple[int, int]:
        """The buffers' rows and columns."""
        return self._keys_buf.shape[0], self._keys_buf.shape[2]

    def _view(self) -> None:
        self.keys = self._keys_buf[: self.rows, :, self.start : self.end]
        self.values = self._values_buf[: self.rows, :, self.start : self.end]

    def extend_to(self, length: int) -> None:
        """Take columns up to ``length`` as cached (written in the buffers by a captured step)."""
        self.end = length
        self._view()

    def window(self, rows: int, width: int) -> None:
        """Show the first ``rows`` rows and the last ``width`` columns before ``end``."""
        self.rows, self.start = rows, self.end - width
        self._view()

    def write_row(self, b: int, kv: KV) -> None:
        """Write one row's keys and values, ending at ``end``."""
        k, v = kv
        self._keys_buf[b, :, self.end - k.shape[-2] : self.end] = k
        self._values_buf[b, :, self.end - v.shape[-2] : self.end] = v

    def move_row(self, src: int, dst: int) -> None:
        """Copy row ``src``'s columns ``[start, end)`` over row ``dst``'s."""
        for buf in (self._keys_buf, self._values_buf):
            buf[dst, :, self.start : self.end] = buf[src, :, self.start : self.end]

    def reallocate(self, rows: int, end: int, columns: int) -> None:
        """New buffers of ``rows`` rows and ``columns`` columns, the shown rows copied right-aligned
        at ``end`` (their padding zeros: every column is finite, and masked ones weigh 0 x value)."""
        width = self.end - self.start
        for name in ("_keys_buf", "_values_buf"):
            old = getattr(self, name)
            new = old.new_zeros((rows, old.shape[1], columns, old.shape[3]))
            new[: self.rows, :, end - width : end] = old[: self.rows, :, self.start : self.end]
            setattr(self, name, new)
        self.start, self.end = end - width, end
        self._view()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new states and return every cached state."""
        end = self.end + key_states.shape[-2]
        if end > self._keys_buf.shape[2]:
            width = end - self.start
            self.reallocate(self._keys_buf.shape[0], self.end - self.start, width + _spare(width))
            end = self.end + key_states.shape[-2]
        self._keys_buf[: self.rows, :, self.end : end] = key_states
        self._values_buf[: self.rows, :, self.end : end] = value_states
        self.end = end
        self._view()
        assert self.keys is not None and self.values is not None
        return self.keys, self.values


def _spare(width: int) -> int:
    """Free columns to leave after a reallocation for a cache ``width`` wide: a share of it, so that
    reallocations (each a copy of the whole cache) come every so many steps, not every few."""
    return max(_SPARE_COLUMNS, width // 4)


class KVPool:
    """Keys and values for ``rows`` rows in every layer, allocated once and grown (reallocated, with
    ``generation`` counting) only when a row outgrows its columns."""

    def __init__(
        self, layers: int, rows: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device
    ):
        self.layers, self.rows, self.heads, self.dim = layers, rows, heads, dim
        self.dtype, self.device = dtype, device
        self.columns = 0
        self.generation = 0  # reallocations so far: a captured step holds the buffers of one generation
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def reserve(self, columns: int) -> None:
        """Make room for ``columns`` columns per row. Growing reallocates the buffers, emptied:
        the caller writes its rows again (``Batch.rebuild`` does)."""
        if columns <= self.columns:
            return
        columns = max(-(-columns // POOL_COLUMNS) * POOL_COLUMNS, 2 * self.columns)
        self.keys, self.values = [], []  # the old buffers go before the new ones are allocated
        shape = (self.rows, self.heads, columns, self.dim)
        for _ in range(self.layers):  # zeros: a column is finite before it is written (masked columns
            self.keys.append(torch.zeros(shape, dtype=self.dtype, device=self.device))  # weigh 0 x value)
            self.values.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
        self.columns = columns
        self.generation += 1

    def release(self) -> None:
        """Drop the buffers (the engine is closed); a later ``reserve`` allocates them again."""
        self.keys, self.values, self.columns = [], [], 0
        self.generation += 1

    def buffers(self, layer: int, rows: int) -> KV:
        """The first ``rows`` rows of a layer's buffers."""
        return self.keys[layer][:rows], self.values[layer][:rows]


class Batch:
    """The running rows: their requests, real lengths and one left-padded KV cache (in a ``pool``'s
    buffers when one is given)."""

    def __init__(self, pool: KVPool | None = None) -> None:
        self.requests: list[Request] = []
        self.lengths: list[int] = []  # real tokens in the cache, per row
        self.deltas: list[int] = []  # per row: position shift after images (multimodal RoPE)
        self.cache: Cache | None = None
        self.pool = pool

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_layers(self) -> int:
        """Layers of the cache (0 when empty)."""
        return len(self.cache.layers) if self.cache is not None else 0

    def row(self, layer: int, b: int) -> KV:
        """Row ``b``'s unpadded keys and values for one layer: copies, since the buffers' rows and
        columns are written over once the row leaves."""
        assert self.cache is not None
        keys, values = layer_kv(self.cache, layer)
        n, width = self.lengths[b], keys.shape[-2]
        return keys[b, :, width - n :].clone(), values[b, :, width - n :].clone()

    def rebuild(self, keep: list[bool], new: list[tuple[Request, list[KV]]]) -> None:
        """Drop rows where ``keep`` is False and add prefilled requests (with their KV per layer).
        Without a pool the rows may change order (a row that leaves takes the last one's place)."""
        if not any(keep) and not new:
            self.requests, self.lengths, self.deltas, self.cache = [], [], [], None
            return
        if self.pool is None:
            self._rebuild_in_place(keep, new)
            return
        requests = [r for r, kept in zip(self.requests, keep, strict=True) if kept] + [r for r, _ in new]
        num_layers = len(self.cache.layers) if self.cache is not None else len(new[0][1])
        old_width = max(self.lengths, default=0)
        self.lengths = [n for n, kept in zip(self.lengths, keep, strict=True) if kept]
        self.lengths += [len(r.prompt_ids) for r, _ in new]
        self.deltas = [r.rope_delta for r in requests]
        layers = self._rebuild_in_pool(self.pool, keep, new, old_width, num_layers)
        self.requests, self.cache = requests, Cache(layers=layers)

    def _rebuild_in_place(self, keep: list[bool], new: list[tuple[Request, list[KV]]]) -> None:
        """``rebuild`` in the batch's own buffers: each row that leaves gets the last row moved into
        its place, the new rows are written after the rest; only a lack of rows or of columns on the
        left (a new row longer than the cache's end) reallocates."""
        layers: list[GrowingLayer] = []
        if self.cache is not None:
            layers = [layer for layer in self.cache.layers if isinstance(layer, GrowingLayer)]
            for b in reversed(range(len(keep))):  # rows after ``b`` are kept ones by now
                if keep[b]:
                    continue
                last = len(self.requests) - 1
                if b != last:
                    for layer in layers:
                        layer.move_row(last, b)
                    self.requests[b], self.lengths[b], self.deltas[b] = (
                        self.requests[last],
                        self.lengths[last],
                        self.deltas[last],
                    )
                del self.requests[last], self.lengths[last], self.deltas[last]
        kept = len(self.requests)
        self.requests += [r for r, _ in new]
        self.lengths += [len(r.prompt_ids) for r, _ in new]
        self.deltas += [r.rope_delta for r, _ in new]
        rows, width = len(self.requests), max(self.lengths)
        if not layers:  # the first rows: buffers of their own
            count = len(new[0][1])
            stacked: list[Any] = [GrowingLayer.stacked([kv[i] for _, kv in new]) for i in range(count)]
            self.cache = Cache(layers=stacked)
            return
        capacity_rows, capacity_columns = layers[0].capacity
        longest_new = max((len(r.prompt_ids) for r, _ in new), default=0)
        if rows > capacity_rows or longest_new > layers[0].end:
            end = max(layers[0].end, longest_new)
            grown = max(rows, 2 * capacity_rows) if rows > capacity_rows else capacity_rows
            for layer in layers:
                layer.window(kept, max(self.lengths[:kept], default=0))  # copy only the kept rows
                layer.reallocate(grown, end, max(capacity_columns, end + _spare(width)))
        for layer_index, layer in enumerate(layers):
            layer.window(rows, width)
            for b, (_, kv) in enumerate(new, start=kept):
                layer.write_row(b, kv[layer_index])

    def _rebuild_in_pool(
        self, pool: KVPool, keep: list[bool], new: list[tuple[Request, list[KV]]], old_width: int, layers: int
    ) -> list[Any]:
        """``rebuild`` in the pool's buffers: the kept rows gathered in one copy per layer and
        shifted to the new width, the new rows written after them (``self.lengths`` already new)."""
        width, kept = max(self.lengths), len(self.lengths) - len(new)
        index = torch.tensor([b for b, k in enumerate(keep) if k], dtype=torch.long, device=pool.device)

        def gather(layer: int) -> KV:
            assert self.cache is not None
            keys, values = layer_kv(self.cache, layer)
            return keys.index_select(0, index), values.index_select(0, index)

        gathered = None
        if kept and width + 1 > pool.columns:  # the pool grows: take the rows out first
            gathered = [gather(layer) for layer in range(layers)]
        pool.reserve(width + 1)  # the next step writes one column more
        out: list[Any] = []
        for layer in range(layers):
            buffers = pool.buffers(layer, len(self.lengths))
            if kept:
                rows = gathered[layer] if gathered is not None else gather(layer)
                for buf, old in zip(buffers, rows, strict=True):
                    if width >= old_width:
                        buf[:kept, :, width - old_width : width] = old
                    else:  # the longest rows left: only the last ``width`` columns hold kept tokens
                        buf[:kept, :, :width] = old[:, :, old_width - width :]
            grown = GrowingLayer(buffers, len(self.lengths), 0, width)
            for b, (_, kv) in enumerate(new, start=kept):
                grown.write_row(b, kv[layer])
            out.append(grown)
        return out

    def step_inputs(self, device: torch.device) -> dict[str, torch.Tensor | None]:
        """Model inputs for one decode step: each row's last token at its own position."""
        width = max(self.lengths)
        mask = None
        if min(self.lengths) < width:
            cols = torch.arange(width + 1, device=device)
            starts = torch.tensor([width - n for n in self.lengths], device=device)
            mask = (cols[None, :] >= starts[:, None]).long()
        return {
            "input_ids": torch.tensor([[r.token_ids[-1]] for r in self.requests], device=device),
            "position_ids": torch.tensor(
                [[n + d] for n, d in zip(self.lengths, self.deltas, strict=True)], device=device
            ),
            "attention_mask": mask,
        }


def layer_kv(cache: Cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's cached keys and values, ``[batch, heads, len, dim]``."""
    cache_layer = cache.layers[layer]
    assert isinstance(cache_layer, DynamicLayer)
    assert cache_layer.keys is not None and cache_layer.values is not None
    return cache_layer.keys, cache_layer.values


def first_row(cache: Cache, layer: int) -> KV:
    """The keys and values of a single-row cache, without the batch axis."""
    keys, values = layer_kv(cache, layer)
    return keys[0], values[0]
