"""Key lookup: a two-turn tool task small models can learn on a CPU.

Each row hides a few secret codes behind a ``lookup(key)`` tool and asks for one of them. A
successful episode takes two model turns: a tool call (``<tool_call>{"name": "lookup",
"arguments": {"key": "apple"}}</tool_call>``), then, after the tool's answer, the code as
``<answer>4821</answer>``. The codes are random, so the answer cannot be right without the call.
Reward: 1.0 for the right code, else 0.0. ``demonstration(sample)`` gives the two ideal turns
(for a supervised warm-start).
"""

from __future__ import annotations

import random
import re
from typing import Any

from turnrl.env.builtin.math_tools import last_model_text
from turnrl.env.tool_env import ToolEnv
from turnrl.tools import FunctionTool, strip_reasoning
from turnrl.types import Message, Sample, Trajectory

SYSTEM_PROMPT = (
    "You find secret codes with the lookup tool. First call it, exactly like this:\n"
    '<tool_call>{"name": "lookup", "arguments": {"key": "the key"}}</tool_call>\n'
    "Then reply with the code it returns as <answer>code</answer>."
)
WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "maple",
    "ocean",
    "candle",
    "rocket",
    "garden",
    "violet",
    "silver",
    "falcon",
    "harbor",
    "meadow",
    "pepper",
    "summit",
    "lantern",
    "copper",
    "willow",
]
_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


def lookup_tool(table: dict[str, str]) -> FunctionTool:
    """The ``lookup`` tool over one row's table."""

    def lookup(key: str) -> str:
        """Look up the secret code stored under a key.

        Args:
            key: The key, e.g. "apple".
        """
        code = table.get(key.strip().strip("'\"").lower())
        if code is None:
            raise ValueError(f"no code under {key!r}")
        return code

    return FunctionTool(lookup)


def answer_of(text: str) -> str | None:
    """The last ``<answer>...</answer>`` of the visible text, or None."""
    found = _ANSWER.findall(strip_reasoning(text))
    return str(found[-1]) if found else None


class KeyLookupEnv(ToolEnv):
    """Call ``lookup`` with the asked key, then answer with the code it returns."""

    def __init__(self, sample: Sample, parser: str = "hermes") -> None:
        self.table: dict[str, str] = dict(sample.metadata["table"])
        self.key = str(sample.metadata["key"])
        super().__init__(sample, [lookup_tool(self.table)], parser=parser)

    async def score(self, trajectory: Trajectory) -> float:
        """1.0 when the last model turn's ``<answer>`` is the asked key's code."""
        return float(answer_of(last_model_text(trajectory)) == self.table[self.key])

    @staticmethod
    def dataset(size: int = 64, keys: int = 4, seed: int = 0) -> list[dict[str, Any]]:
        """``size`` rows, each with ``keys`` random keys and codes, asking for one of them."""
        rng = random.Random(seed)
        return [_row(rng, i, keys, seed) for i in range(size)]


def _row(rng: random.Random, index: int, keys: int, seed: int) -> dict[str, Any]:
    table = {word: str(rng.randint(1000, 9999)) for word in rng.sample(WORDS, keys)}
    key = rng.choice(sorted(table))
    prompt: list[Message] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"What is the secret code of '{key}'?"},
    ]
    return {
        "id": f"lookup/{seed}/{index}",
        "prompt": prompt,
        "data_source": "key_lookup",
        "table": table,
        "key": key,
    }


def demonstration(sample: Sample) -> list[str]:
    """The two ideal model turns of ``sample``: the tool call, then the answer."""
    key = sample.metadata["key"]
    call = f'<tool_call>{{"name": "lookup", "arguments": {{"key": "{key}"}}}}</tool_call>'
    return [call, f"<answer>{sample.metadata['table'][key]}</answer>"]
