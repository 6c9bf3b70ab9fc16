"""The embedded engine's running batch: what one change of its rows costs (one row leaves, one
joins), by batch size and context length, with SmolLM2-135M's KV shape (30 layers x 3 heads x 64)
in float32. A change happens whenever a turn ends or a request arrives, so agents whose turns end
at different times change the batch about twice per turn.

    .venv/bin/python bench/kv_batch.py [--rows 32] [--contexts 256 2048] [--changes 20]
"""

from __future__ import annotations

import argparse
import random
import time
from types import SimpleNamespace
from typing import Any

import torch

from turnrl.engines.hf.kv import KV, Batch

LAYERS, HEADS, DIM = 30, 3, 64


def request(n: int) -> Any:
    """What the batch reads of a request: its prompt's length and its position shift."""
    return SimpleNamespace(prompt_ids=[0] * n, rope_delta=0)


def kv(n: int) -> list[KV]:
    return [(torch.randn(HEADS, n, DIM), torch.randn(HEADS, n, DIM)) for _ in range(LAYERS)]


def per_change_ms(rows: int, context: int, changes: int) -> float:
    rng = random.Random(0)
    batch = Batch()
    lengths = [rng.randint(context // 2, context) for _ in range(rows)]
    batch.rebuild([], [(request(n), kv(n)) for n in lengths])
    joining = [(request(context // 2), kv(context // 2)) for _ in range(changes)]
    start = time.perf_counter()
    for i in range(changes):
        keep = [b != i % len(batch) for b in range(len(batch))]
        batch.rebuild(keep, [joining[i]])
    return (time.perf_counter() - start) / changes * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--changes", type=int, default=20)
    args = parser.parse_args()
    for context in args.contexts:
        ms = per_change_ms(args.rows, context, args.changes)
        print(f"{args.rows} rows of {context // 2}-{context} tokens: {ms:.1f} ms per change")


if __name__ == "__main__":
    main()
