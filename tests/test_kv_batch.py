"""The embedded engine's running batch keeps every row's keys and values exact while rows leave, join
and grow by a column a step, changing its buffers in place (no copy of the whole cache per change),
and its buffers stay within a bound of what the rows hold."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from turnrl.engines.hf.kv import KV, Batch, GrowingLayer

LAYERS, HEADS, DIM = 3, 2, 4


@dataclass(eq=False)
class Row:
    """What the batch reads of a request."""

    prompt_ids: list[int]
    rope_delta: int = 0
    token_ids: list[int] = field(default_factory=lambda: [1])
    cancelled: bool = False


def fresh(n: int) -> list[KV]:
    return [(torch.randn(HEADS, n, DIM), torch.randn(HEADS, n, DIM)) for _ in range(LAYERS)]


def check(batch: Batch, truth: dict[Row, list[KV]]) -> None:
    assert sorted(map(id, batch.requests)) == sorted(map(id, truth))
    for b, request in enumerate(batch.requests):
        assert batch.lengths[b] == truth[request][0][0].shape[-2]
        for layer in range(LAYERS):
            k, v = batch.row(layer, b)
            assert torch.equal(k, truth[request][layer][0]) and torch.equal(v, truth[request][layer][1])
    assert batch.cache is not None
    for layer in batch.cache.layers:
        assert isinstance(layer, GrowingLayer)
        assert layer.keys is not None and layer.keys.shape[0] == len(batch)
        assert layer.keys.shape[-2] == max(batch.lengths) and torch.isfinite(layer.keys).all()


def step(batch: Batch, truth: dict[Row, list[KV]]) -> None:
    """A decode step: every layer appends one column for every row."""
    assert batch.cache is not None
    for layer_index, layer in enumerate(batch.cache.layers):
        k, v = torch.randn(len(batch), HEADS, 1, DIM), torch.randn(len(batch), HEADS, 1, DIM)
        layer.update(k, v)
        for b, request in enumerate(batch.requests):
            old_k, old_v = truth[request][layer_index]
            truth[request][layer_index] = (torch.cat([old_k, k[b]], -2), torch.cat([old_v, v[b]], -2))
    batch.lengths = [n + 1 for n in batch.lengths]


@pytest.mark.parametrize("seed", range(4))
def test_rows_that_leave_join_and_grow_keep_their_exact_kv(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    batch, truth = Batch(), {}
    widest = 0
    for _ in range(300):
        action = rng.random()
        if action < 0.25 or not batch.requests:  # 1-5 rows join, some longer than any before
            joining = []
            for _ in range(rng.randint(1, 5)):
                row = Row([0] * rng.randint(1, 120 if rng.random() < 0.8 else 400))
                kv = fresh(len(row.prompt_ids))
                truth[row] = [(k.clone(), v.clone()) for k, v in kv]
                joining.append((row, kv))
            keep = [rng.random() < 0.8 for _ in batch.requests]
        elif action < 0.45:
            keep, joining = [rng.random() < 0.7 for _ in batch.requests], []
        else:
            keep, joining = [True] * len(batch), []
        for request, kept in zip(list(batch.requests), keep, strict=True):
            if not kept:
                del truth[request]
        batch.rebuild(keep, joining)
        if not batch.requests:
            assert batch.cache is None
            continue
        step(batch, truth)
        check(batch, truth)
        widest = max(widest, max(batch.lengths))
        assert batch.cache is not None
        layer = batch.cache.layers[0]
        assert isinstance(layer, GrowingLayer)
        rows, columns = layer.capacity
        assert rows <= 2 * max(len(batch), 64) and columns <= 2 * widest + 200, (rows, columns, widest)


def test_a_step_that_leaves_and_joins_copies_no_whole_cache() -> None:
    batch, truth = Batch(), {}
    first = [(Row([0] * 50), fresh(50)) for _ in range(8)]
    for row, kv in first:
        truth[row] = kv
    batch.rebuild([], first)
    assert batch.cache is not None
    buffers = [layer._keys_buf for layer in batch.cache.layers]  # type: ignore[attr-defined]
    for _ in range(10):
        step(batch, truth)
    joining = (Row([0] * 20), fresh(20))
    truth[joining[0]] = joining[1]
    del truth[batch.requests[2]]
    batch.rebuild([b != 2 for b in range(8)], [joining])
    check(batch, truth)
    after = [layer._keys_buf for layer in batch.cache.layers]  # type: ignore[attr-defined]
    assert all(a is b for a, b in zip(after, buffers, strict=True))  # the same buffers, changed in place
