"""The running batch's KV cache: rows left-padded to one length, appended in place."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from turnrl.engines.hf.requests import Request

_SPARE_COLUMNS = 64  # free KV columns kept after a rebuild, so decode steps rarely reallocate

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

    def _set_length(self, length: int) -> None:
        """Point keys/values at the first ``length`` columns of the buffers."""
        self._length = length
        self.keys = self._keys_buf[:, :, :length]
        self.values = self._values_buf[:, :, :length]

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


class Batch:
    """The running rows: their requests, real lengths and one left-padded KV cache."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.lengths: list[int] = []  # real tokens in the cache, per row
        self.deltas: list[int] = []  # per row: position shift after images (multimodal RoPE)
        self.cache: Cache | None = None

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
        """Row ``b``'s unpadded keys and values for one layer."""
        assert self.cache is not None
        keys, values = layer_kv(self.cache, layer)
        n, width = self.lengths[b], keys.shape[-2]
        return keys[b, :, width - n :], values[b, :, width - n :]

    def rebuild(self, keep: list[bool], new: list[tuple[Request, list[KV]]]) -> None:
        """Drop rows where ``keep`` is False, append prefilled requests (with their KV per layer),
        and re-pad the cache."""
        requests = [r for r, kept in zip(self.requests, keep, strict=True) if kept] + [r for r, _ in new]
        if not requests:
            self.requests, self.lengths, self.deltas, self.cache = [], [], [], None
            return
        num_layers = len(self.cache.layers) if self.cache is not None else len(new[0][1])
        layers: list[Any] = []
        for layer in range(num_layers):
            old = [row for row, kept in zip(self._rows(layer), keep, strict=True) if kept]
            layers.append(GrowingLayer(old + [rows[layer] for _, rows in new]))
        self.lengths = [n for n, kept in zip(self.lengths, keep, strict=True) if kept]
        self.lengths += [len(r.prompt_ids) for r, _ in new]
        self.deltas = [r.rope_delta for r in requests]
        self.requests, self.cache = requests, Cache(layers=layers)

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
