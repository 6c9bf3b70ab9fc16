"""A tool agent written with the plain ``openai`` SDK, knowing nothing of turnrl.

It answers one question (its first argument) with a ``lookup`` tool over ``codes.json`` in its
working folder, calling the model until it answers without a tool call (at most 4 calls), and
writes that answer to ``answer.txt``. The client reads OPENAI_BASE_URL and OPENAI_API_KEY from the
environment, as every OpenAI client does; under ``turnrl train`` they point at turnrl's gateway.

    python lookup_agent.py "What is the secret code of 'apple'?"
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from openai import OpenAI

SYSTEM = (  # written for a small model: the tool-call format spelled out
    "You find secret codes with the lookup tool. First call it, exactly like this:\n"
    '<tool_call>{"name": "lookup", "arguments": {"key": "the key"}}</tool_call>\n'
    "Then reply with the code it returns as <answer>code</answer>."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up the secret code stored under a key.",
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string", "description": 'The key, e.g. "apple".'}},
                "required": ["key"],
            },
        },
    }
]


def lookup(key: str) -> str:
    """The code under ``key`` in codes.json, or an error the model can read."""
    codes = json.loads(Path("codes.json").read_text(encoding="utf-8"))
    return str(codes.get(str(key).strip().strip("'\"").lower(), f"error: no code under {key!r}"))


def main() -> None:
    client = OpenAI()
    model = os.environ.get("OPENAI_MODEL", "lookup-agent")
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": sys.argv[1]}]
    answer = ""
    for _ in range(4):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=40)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            answer = message.content or ""
            break
        for call in message.tool_calls:
            try:
                result = lookup(**json.loads(call.function.arguments))
            except (TypeError, ValueError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    Path("answer.txt").write_text(answer, encoding="utf-8")


if __name__ == "__main__":
    main()
