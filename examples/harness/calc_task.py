"""The task of ``calc_agent.py`` under ``turnrl train``: questions (``dataset``), the score of a
run from the answer the agent wrote (``reward``), and ideal replies for a warm start
(``demonstration``)."""

from __future__ import annotations

import random
import re
from typing import Any

OPS = {"add": ("plus", lambda a, b: a + b), "multiply": ("times", lambda a, b: a * b)}
_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def dataset(size: int = 64, seed: int = 0) -> list[dict[str, Any]]:
    """``size`` questions on two-digit numbers, half sums, half products."""
    rng = random.Random(seed)
    rows = []
    for i in range(size):
        op = ("add", "multiply")[i % 2]
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        question = f"What is {a} {OPS[op][0]} {b}?"
        rows.append({"id": f"calc-{seed}-{i}", "prompt": question, "metadata": {"op": op, "a": a, "b": b}})
    return rows


def expected(sample: Any) -> int:
    meta = sample.metadata
    return int(OPS[meta["op"]][1](meta["a"], meta["b"]))


def reward(sample: Any, result: Any) -> float:
    """1.0 when answer.txt holds the right number as <answer>N</answer>, else 0.0."""
    path = result.folder / "answer.txt"
    found = _ANSWER.findall(path.read_text(encoding="utf-8")) if path.exists() else []
    return float(bool(found) and int(found[-1]) == expected(sample))


def demonstration(sample: Any) -> list[str]:
    """The two ideal replies: the tool call, then the answer."""
    meta = sample.metadata
    arguments = f'{{"a": {meta["a"]}, "b": {meta["b"]}}}'
    call = f'<tool_call>{{"name": "{meta["op"]}", "arguments": {arguments}}}</tool_call>'
    return [call, f"<answer>{expected(sample)}</answer>"]
