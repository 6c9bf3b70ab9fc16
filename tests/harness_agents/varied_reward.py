"""A reward that varies with what a random model said (the parity of the answer's length), so a
group's runs differ and a training step has something to learn from."""

from __future__ import annotations

from typing import Any


def reward(sample: Any, result: Any) -> float:
    path = result.folder / "answer.txt"
    return float(len(path.read_text(encoding="utf-8")) % 2) if path.exists() else 0.0
