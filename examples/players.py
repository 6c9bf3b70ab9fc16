"""Scripted players for `engine.kind: scripted`: play an env from the CLI before any model can.

Each is `policy(messages, images, sample) -> the turn's text`; the config names it as
`players:NAME` (the config's own folder is importable).
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any


def bisect(messages: list[dict[str, Any]], images: list[Any], sample: Any) -> str:
    """guess_number: halve the range after every "Higher." / "Lower."."""
    lo, hi = 1, int(sample.metadata.get("hi", 20))
    for said, answer in itertools.pairwise(messages):
        if said["role"] == "assistant" and answer["role"] == "user":
            guess = int(re.findall(r"\[(\d+)\]", said["content"])[-1])
            if answer["content"].startswith("Higher"):
                lo = guess + 1
            elif answer["content"].startswith("Lower"):
                hi = guess - 1
    return f"[{(lo + hi) // 2}]"


def searcher(messages: list[dict[str, Any]], images: list[Any], sample: Any) -> str:
    """search_qa: search the question's description, then answer with the best hit's module."""
    last = messages[-1]
    if last["role"] != "tool":
        described = str(last["content"]).split('described as: "')[-1].rsplit('"', 1)[0]
        call = json.dumps({"name": "search", "arguments": {"query": described}})
        return f"<tool_call>\n{call}\n</tool_call>"
    found = re.findall(r"\[1\] (\w+)\.", str(last["content"]))
    return f"<answer>{found[0] if found else 'unknown'}</answer>"


def vault_opener(messages: list[dict[str, Any]], images: list[Any], sample: Any) -> str:
    """openenv_vault: peek every slot in one turn, then open the vault with what they hold."""
    seen = [str(m["content"]) for m in messages if m["role"] == "tool"]
    digits = [m.group(1) for text in seen if (m := re.search(r"holds (\d)", text))]
    if not digits:
        calls = [json.dumps({"name": "peek", "arguments": {"slot": slot}}) for slot in range(3)]
        return "\n".join(f"<tool_call>\n{call}\n</tool_call>" for call in calls)
    call = json.dumps({"name": "open_vault", "arguments": {"code": "".join(digits)}})
    return f"<tool_call>\n{call}\n</tool_call>"
