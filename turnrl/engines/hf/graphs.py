"""Decode steps replayed from CUDA graphs (GPU): one captured step per (rows, columns) bucket.

On a GPU a decode step of a small model is bound by launches, not arithmetic: a 28-layer model
runs some 400 kernels a step, each issued from Python. Here a step's work is captured once per
bucket as a CUDA graph and replayed, one launch a step. A graph needs its tensors at fixed
addresses and shapes, so:

- the KV cache lives in a ``KVPool`` allocated once for ``max_batch_size`` rows (the running
  batch's rows are its first rows, left-padded as before, ``kv``); when a row outgrows the pool's
  columns the pool is reallocated, larger, and the graphs are captured again;
- a step runs on ``rows`` rows (the batch's size rounded up to a bucket: 1, 2, 4, 8, then multiples
  of 8) and ``columns`` columns (its width plus the new token, rounded up to the pool's multiple of
  256); the rows past the batch compute on a dummy token and are dropped;
- its inputs (each row's token, position and first real column, and the column the new token goes
  to) are copied into one fixed tensor, and the step builds its attention mask from them: a row
  sees its real columns up to the new one;
- its output, the logits of each row, is the graph's fixed tensor, read before the next replay.

The first step of a bucket runs eagerly (it is the warm-up capture needs, and its result is that
step's), then the bucket is captured. Sampling stays outside, unchanged. The arithmetic is the
model's own modules (norms, projections, rotary positions, SiLU-gated MLP) around
``scaled_dot_product_attention`` over the masked columns: masked columns weigh exactly 0.

It serves the text models ``fused`` serves (Llama, Mistral, Qwen2, Qwen3). Without a GPU (and
under ``turnrl.support.fake_cuda``) the same static step runs eagerly, which is how CPU tests
check it. A capture that fails leaves the engine on that eager static step, with one warning.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from turnrl.engines.hf.fused import _rotate
from turnrl.engines.hf.kv import POOL_COLUMNS, Batch, GrowingLayer, KVPool

log = logging.getLogger(__name__)


def row_bucket(rows: int, most: int) -> int:
    """The rows a step for ``rows`` running rows computes: 1, 2, 4, 8, then multiples of 8 (at most
    ``most``)."""
    bucket = 1 << max(rows - 1, 0).bit_length() if rows <= 8 else -(-rows // 8) * 8
    return min(bucket, most)


class GraphedDecode:
    """The decode step of one model over a ``KVPool``, captured per bucket when ``capture``."""

    def __init__(self, model: Any, max_rows: int, *, capture: bool) -> None:
        inner, cfg = model.model, model.config
        self._model = model
        self._capture = capture
        self._heads, self._groups = cfg.num_attention_heads, cfg.num_key_value_heads
        self._dim = inner.layers[0].self_attn.head_dim
        weight = inner.embed_tokens.weight
        self.pool = KVPool(len(inner.layers), max_rows, self._groups, self._dim, weight.dtype, weight.device)
        self._max_rows = max_rows
        # per row: token, position, first real column; then the new token's column
        self._inputs = torch.zeros(3 * max_rows + 1, dtype=torch.long, device=weight.device)
        self._columns = torch.arange(0, dtype=torch.long, device=weight.device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._generation = -1  # the pool generation the graphs were captured on
        self._memory: Any = None  # the graphs' shared memory pool
        self.captured = 0  # graphs captured since start (progress and tests)

    def reset(self) -> None:
        """Drop the captured graphs (after a weight update: captured again on next use), and their
        memory pool with them: a pool whose graphs are all gone is released, and capturing into its
        handle again fails inside the allocator."""
        self._graphs.clear()
        self._memory = None

    def decode(self, batch: Batch) -> torch.Tensor:
        """One decode step for every row of ``batch`` (which must use ``self.pool``): the logits
        ``[B, V]`` of its next tokens; its cache then holds one column more."""
        assert batch.cache is not None and batch.pool is self.pool
        width = max(batch.lengths)
        if width + 1 > self.pool.columns:
            batch.rebuild([True] * len(batch), [])  # grows the pool and writes the rows again
        count, mr = len(batch), self._max_rows
        rows = row_bucket(count, mr)
        columns = min(-(-(width + 1) // POOL_COLUMNS) * POOL_COLUMNS, self.pool.columns)
        values = [0] * (3 * mr + 1)
        for b, (n, delta, request) in enumerate(
            zip(batch.lengths, batch.deltas, batch.requests, strict=True)
        ):
            values[b], values[mr + b], values[2 * mr + b] = request.token_ids[-1], n + delta, width - n
        for b in range(count, rows):  # dummy rows see only their own new column
            values[2 * mr + b] = width
        values[3 * mr] = width
        self._inputs.copy_(torch.tensor(values, dtype=torch.long), non_blocking=False)
        logits = self._run(rows, columns)[:count]
        for layer in batch.cache.layers:
            assert isinstance(layer, GrowingLayer)
            layer.extend_to(width + 1)
        return logits

    def _run(self, rows: int, columns: int) -> torch.Tensor:
        """The step on a bucket: replayed when captured, else run (and captured when it can be)."""
        if self._generation != self.pool.generation:
            self.reset()
            self._generation = self.pool.generation
        if self._columns.numel() < self.pool.columns:
            self._columns = torch.arange(self.pool.columns, dtype=torch.long, device=self._inputs.device)
        graph = self._graphs.get((rows, columns))
        if graph is not None:
            graph[0].replay()
            return graph[1]
        if not self._capture:
            return self._step(rows, columns)
        device = self._inputs.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # the warm-up capture needs, and this step's result
            logits = self._step(rows, columns)
        torch.cuda.current_stream(device).wait_stream(side)
        logits.record_stream(torch.cuda.current_stream(device))
        try:
            if self._memory is None:
                self._memory = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._memory, capture_error_mode="thread_local"):
                out = self._step(rows, columns)  # the KV column it writes is the one just written
            self._graphs[(rows, columns)] = (g, out)
            self.captured += 1
        except RuntimeError as err:
            log.warning("CUDA graph capture failed; decoding without graphs: %s", err)
            self._capture = False
            self.reset()
        return logits

    def _step(self, rows: int, columns: int) -> torch.Tensor:
        """The decode step on the first ``rows`` rows and ``columns`` columns, from ``_inputs``."""
        inner, mr = self._model.model, self._max_rows
        heads, groups, dim = self._heads, self._groups, self._dim
        ids, positions = self._inputs[:rows], self._inputs[mr : mr + rows]
        starts, column = self._inputs[2 * mr : 2 * mr + rows], self._inputs[3 * mr : 3 * mr + 1]
        cols = self._columns[:columns]
        mask = ((cols[None, :] >= starts[:, None]) & (cols[None, :] <= column))[:, None, None, :]
        hidden = inner.embed_tokens(ids[:, None])
        cos, sin = (t[:, None] for t in inner.rotary_emb(hidden, positions[:, None]))
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(rows, 1, heads, dim)
            k = attn.k_proj(x).view(rows, 1, groups, dim)
            v = attn.v_proj(x).view(rows, 1, groups, dim).transpose(1, 2)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = _rotate(q.transpose(1, 2), cos, sin)
            k = _rotate(k.transpose(1, 2), cos, sin)
            keys = self.pool.keys[i][:rows, :, :columns]
            values = self.pool.values[i][:rows, :, :columns]
            keys.index_copy_(2, column, k)
            values.index_copy_(2, column, v)
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=attn.scaling, enable_gqa=groups != heads
            )
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(rows, 1, heads * dim))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits: torch.Tensor = self._model.lm_head(inner.norm(hidden[:, -1]))
        return logits
