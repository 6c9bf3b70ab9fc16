"""The running batch's KV cache: rows left-padded to one length, appended in place.

By default each rebuild allocates the batch's buffers afresh. With a ``KVPool`` (the CUDA-graph
decode, ``graphs``) the rows live in buffers allocated once for ``max_batch_size`` rows, so that a
captured decode step finds them at the same addresses every step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from turnrl.engines.hf.requests import Request

_SPARE_COLUMNS = 64  # free KV columns kept after a rebuild, so decode steps rarely reallocate
POOL_COLUMNS = 256  # a pool's columns grow in multiples of this (and graphs are captured per multiple)

KV = tuple[torch.Tensor, torch.Tensor]  # one row's keys and values in one layer, [heads, len, dim]


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer that appends into spare room instead of concatenating."""

    def __init__(self, rows: Sequence[KV], spare: int = _SPARE_COLUMNS) -> None:
        """Stack per-row ``(keys, values)`` of shape ``[heads, len, dim]``, right-aligned (left-padded)."""
        super().__init__()
        length = max(k.shape[-2] for k, _ in rows)
        k0 = rows[0][0]
        shape = (len(rows), k0.shape[0], length + spare, k0.shape[-1])
        self._keys_buf, self._values_buf = k0.new_zeros(shape), k0.new_zeros(shape)
        for b, (k, v) in enumerate(rows):
            self._keys_buf[b, :, length - k.shape[-2] : length] = k
            self._values_buf[b, :, length - v.shape[-2] : length] = v
        self.dtype, self.device, self.is_initialized = k0.dtype, k0.device, True
        self._set_length(length)

    @classmethod
    def over(cls, buffers: KV, length: int) -> GrowingLayer:
        """A layer over buffers already written (a pool's), holding ``length`` columns."""
        layer = cls.__new__(cls)
        DynamicLayer.__init__(layer)
        layer._keys_buf, layer._values_buf = buffers
        k = buffers[0]
        layer.dtype, layer.device, layer.is_initialized = k.dtype, k.device, True
        layer._set_length(length)
        return layer

    def _set_length(self, length: int) -> None:
        """Point keys/values at the first ``length`` columns of the buffers."""
        self._length = length
        self.keys = self._keys_buf[:, :, :length]
        self.values = self._values_buf[:, :, :length]

    def extend_to(self, length: int) -> None:
        """Take columns up to ``length`` as cached (written in the buffers by a captured step)."""
        self._set_length(length)

    def _grow(self, needed: int) -> None:
        """Reallocate the buffers with at least ``needed`` columns."""
        for name in ("_keys_buf", "_values_buf"):
            old = getattr(self, name)
            shape = (*old.shape[:2], max(needed, 2 * old.shape[2]), old.shape[3])
            new = old.new_empty(shape)  # columns past the length are written before they are read
            new[:, :, : self._length] = old[:, :, : self._length]
            setattr(self, name, new)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new states and return every cached state."""
        end = self._length + key_states.shape[-2]
        if end > self._keys_buf.shape[2]:
            self._grow(end)
        self._keys_buf[:, :, self._length : end] = key_states
        self._values_buf[:, :, self._length : end] = value_states
        self._set_length(end)
        assert self.keys is not None and self.values is not None
        return self.keys, self.values


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

    def _rows(self, layer: int) -> list[KV]:
        """Every row's unpadded keys and values for one layer."""
        return [self.row(layer, b) for b in range(len(self.lengths))] if self.cache is not None else []

    @property
    def num_layers(self) -> int:
        """Layers of the cache (0 when empty)."""
        return len(self.cache.layers) if self.cache is not None else 0

    def row(self, layer: int, b: int) -> KV:
        """Row ``b``'s unpadded keys and values for one layer (copies when pooled: the pool's
        columns are written over once the row leaves)."""
        assert self.cache is not None
        keys, values = layer_kv(self.cache, layer)
        n, width = self.lengths[b], keys.shape[-2]
        k, v = keys[b, :, width - n :], values[b, :, width - n :]
        return (k.clone(), v.clone()) if self.pool is not None else (k, v)

    def rebuild(self, keep: list[bool], new: list[tuple[Request, list[KV]]]) -> None:
        """Drop rows where ``keep`` is False, append prefilled requests (with their KV per layer),
        and re-pad the cache."""
        requests = [r for r, kept in zip(self.requests, keep, strict=True) if kept] + [r for r, _ in new]
        if not requests:
            self.requests, self.lengths, self.deltas, self.cache = [], [], [], None
            return
        num_layers = len(self.cache.layers) if self.cache is not None else len(new[0][1])
        old_width = max(self.lengths, default=0)
        old_rows = [] if self.pool is not None else [self._rows(layer) for layer in range(num_layers)]
        self.lengths = [n for n, kept in zip(self.lengths, keep, strict=True) if kept]
        self.lengths += [len(r.prompt_ids) for r, _ in new]
        self.deltas = [r.rope_delta for r in requests]
        layers: list[Any] = []
        if self.pool is None:  # views of the old buffers, copied into new ones
            for layer, rows in enumerate(old_rows):
                old = [row for row, k in zip(rows, keep, strict=True) if k]
                layers.append(GrowingLayer(old + [kv[layer] for _, kv in new]))
        else:
            layers = self._rebuild_in_pool(self.pool, keep, new, old_width, num_layers)
        self.requests, self.cache = requests, Cache(layers=layers)

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
            for b, (_, kv) in enumerate(new, start=kept):
                k, v = kv[layer]
                buffers[0][b, :, width - k.shape[-2] : width] = k
                buffers[1][b, :, width - v.shape[-2] : width] = v
            out.append(GrowingLayer.over(buffers, width))
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
