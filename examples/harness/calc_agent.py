"""A calculator agent on the plain ``openai`` SDK, knowing nothing of turnrl: two tools (``add``,
``multiply``), a loop that runs the model's tool calls until it answers, and the answer written to
``answer.txt`` in its working folder. OPENAI_BASE_URL and OPENAI_API_KEY come from the
environment, as for every OpenAI client; under ``turnrl train`` they point at turnrl's gateway.

    python calc_agent.py "What is 37 plus 45?"
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from openai import OpenAI

SYSTEM = (  # written for a small model: the tool-call format spelled out
    "You are a calculator. Use a tool for every sum or product, exactly like this:\n"
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>\n'
    "The tools are add and multiply. Then reply with the result as <answer>number</answer>."
)


def tool(name: str, description: str) -> dict:
    numbers = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": numbers}}


TOOLS = [tool("add", "The sum a + b."), tool("multiply", "The product a * b.")]
FUNCTIONS = {"add": lambda a, b: a + b, "multiply": lambda a, b: a * b}


def run_tool(name: str, arguments: str) -> str:
    """The tool's result, or an error the model can read. The arguments are made numbers first: a
    model may send "12" for 12, and "ab" * 99999999 would be a 200 MB string."""
    try:
        args = json.loads(arguments)
        value = FUNCTIONS[name](float(args["a"]), float(args["b"]))
    except (KeyError, TypeError, ValueError) as exc:
        return f"error: {exc!r}"
    return str(int(value)) if value.is_integer() else str(value)


def main() -> None:
    client = OpenAI()
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": sys.argv[1]}]
    answer = ""
    for _ in range(4):
        reply = client.chat.completions.create(model="calc", messages=messages, tools=TOOLS, max_tokens=40)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            answer = message.content or ""
            break
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    Path("answer.txt").write_text(answer, encoding="utf-8")


if __name__ == "__main__":
    main()
