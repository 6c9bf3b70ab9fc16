"""Branch detection on a corpus of rewritten agent histories: what the gateway does with each, and
what re-rendering or refusing would do instead.

A tool agent runs ``--turns`` calls through the gateway (in process, Qwen3's real chat template and
tokenizer, the hermes tool parser; a scripted engine answers with a reasoning block and a tool
call). Its next request is then sent in many forms. Some mean the same as what the gateway gave
(the client re-serialized it: arguments re-encoded, ids renamed, whitespace trimmed, reasoning
dropped, text as parts, ``content`` null or empty); some are real rewrites (compaction, truncation,
an edited tool result, a retry, a subagent). For each form:
- gateway: whether the call extended the session's branch (only the new messages encoded) or
  started a branch, and why, and whether every branch stays token-exact;
- re-render: whether rendering the client's messages with the chat template gives back the tokens
  the model conditioned on and sampled (what a re-tokenizing proxy would train on);
- refuse: a proxy that refuses (drops the rollout) whenever the re-rendered prefix differs.

    .venv/bin/python bench/branch_detection.py [--turns 8]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
from collections.abc import Callable
from typing import Any

from transformers import AutoTokenizer

from turnrl.chat.encoder import ChatEncoder
from turnrl.engines.scripted import ScriptedEngine
from turnrl.gateway import GatewayConfig, openai_chat
from turnrl.gateway.messages import template_message
from turnrl.gateway.server import Gateway
from turnrl.models import qwen3_tokenizer_dir
from turnrl.tools.parsers import get_parser

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "A stored value.",
          "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}}]  # fmt: skip
REPLY = (
    "<think>\nI need the value of {key}.\n</think>\n\n"
    '<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{key}", "depth": 2}}}}\n</tool_call>'
)
START = [
    {"role": "system", "content": "You look values up, one call per turn."},
    {"role": "user", "content": "Look up k0, k1, k2 and so on."},
]

Rewrite = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def assistants(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in messages if m["role"] == "assistant"]


def each_assistant(change: Callable[[dict[str, Any]], None]) -> Rewrite:
    def rewrite(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = copy.deepcopy(messages)
        for m in assistants(out):
            change(m)
        return out

    return rewrite


def reencode(m: dict[str, Any]) -> None:
    for call in m.get("tool_calls") or ():
        call["function"]["arguments"] = json.dumps(
            json.loads(call["function"]["arguments"]), indent=2, sort_keys=True
        )


def rename_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls") or ():
            call["id"] = "renamed-" + call["id"]
        if m["role"] == "tool":
            m["tool_call_id"] = "renamed-" + m["tool_call_id"]
    return out


SAME: dict[str, Rewrite] = {
    "as given": lambda ms: ms,
    "arguments re-encoded": each_assistant(reencode),
    "call ids renamed": rename_ids,
    "reasoning dropped": each_assistant(lambda m: m.pop("reasoning_content", None)),
    "content null -> empty": each_assistant(lambda m: m.update(content=m.get("content") or "")),
    "text as parts": lambda ms: [
        {**m, "content": [{"type": "text", "text": m["content"]}]}
        if isinstance(m.get("content"), str) and m["content"]
        else m
        for m in ms
    ],
    "whitespace trimmed": lambda ms: [
        {**m, "content": m["content"].strip()} if isinstance(m.get("content"), str) else m for m in ms
    ],
}
REWRITES: dict[str, Rewrite] = {
    "compaction": lambda ms: [ms[0], {"role": "user", "content": "Summary: k0 to k5 are looked up. Go on."}],
    "truncation": lambda ms: ms[:-3],
    "edited tool result": lambda ms: [*ms[:-3], {**ms[-3], "content": "edited"}, *ms[-2:]],
    "subagent": lambda ms: [{"role": "system", "content": "You write titles."}, ms[1]],
}


def as_template(message: dict[str, Any]) -> Any:
    """A client message as a re-rendering proxy gives it to the chat template (reasoning included)."""
    out = dict(template_message(message, "message"))
    if message.get("reasoning_content"):
        out["reasoning_content"] = message["reasoning_content"]
    return out


def reply_for(prompt: list[int], sampling: Any) -> str:
    return REPLY.format(key=f"k{len(prompt) % 97}")


async def run(turns: int) -> list[tuple[str, str, str, bool]]:
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    encoder = ChatEncoder(tokenizer)
    config = GatewayConfig(model="qwen3", max_session_tokens=10**6)
    rows = []
    for label, rewrite in [*SAME.items(), *REWRITES.items(), ("retry", lambda ms: ms)]:
        gateway = Gateway(ScriptedEngine(tokenizer, reply_for), encoder, get_parser("hermes"), config)
        messages = [dict(m) for m in START]
        for _ in range(turns):
            done = await gateway.answer("s", openai_chat.read_request({"messages": messages, "tools": TOOLS}))
            reply = openai_chat.response(done)["choices"][0]["message"]
            call = reply["tool_calls"][0]
            messages = [*messages, reply, {"role": "tool", "tool_call_id": call["id"], "content": "42"}]
        branch = gateway.sessions["s"].branches[0]
        held = list(branch.sequence)  # what the model conditioned on and sampled, up to the last reply
        sent = rewrite(json.loads(json.dumps(messages))) if label != "retry" else messages[:-2]
        rendered = encoder.conversation(TOOLS).prompt([as_template(m) for m in sent]).ids
        tools = None if label == "subagent" else TOOLS
        await gateway.answer("s", openai_chat.read_request({"messages": sent, "tools": tools}))
        session = gateway.sessions["s"]
        last = session.branches[-1]
        outcome = "extended" if len(session.branches) == 1 else f"{last.reason} ({last.shared_tokens} kept)"
        # the tokens the gateway keeps exactly: all of them when it extends; the shared prefix when it forks
        kept = len(held) if len(session.branches) == 1 else last.shared_tokens
        render_exact = rendered[:kept] == held[:kept]
        rows.append(("same meaning" if label in SAME else "rewrite", label, outcome, render_exact))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=8)
    args = parser.parse_args()
    rows = asyncio.run(run(args.turns))
    print(f"{'kind':<14}{'the next request':<24}{'gateway':<30}{'re-render':<11}refusal")
    for kind, label, outcome, exact in rows:
        verdict = f"{'exact' if exact else 'WRONG':<11}{'keeps' if exact else 'drops'}"
        print(f"{kind:<14}{label:<24}{outcome:<30}{verdict}")
    same = [r for r in rows if r[0] == "same meaning"]
    print(
        f"same meaning: the gateway extends {sum(r[2] == 'extended' for r in same)}/{len(same)} exactly; "
        f"re-rendering gives the sampled tokens for {sum(r[3] for r in same)}/{len(same)} "
        f"(refusal drops {sum(not r[3] for r in same)}/{len(same)})"
    )
    print("re-render and refusal: over the tokens the gateway keeps (the whole branch, or the fork's prefix)")


if __name__ == "__main__":
    main()
