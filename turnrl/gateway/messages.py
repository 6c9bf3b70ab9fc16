"""API messages into chat-template messages, and what makes two messages the same.

Clients echo the gateway's replies back re-serialized in their own way: arguments re-encoded as
JSON with other spacing or key order, whitespace trimmed, reasoning dropped, call ids renamed, text
given as a list of parts. ``same`` treats all of these as the same message, so an echoed reply
stands for the exact tokens the model sampled; only a real edit makes two messages differ.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, cast

from turnrl.tools.base import ToolCall
from turnrl.types import Message


class BadMessage(ValueError):
    """A message the gateway cannot read (its text says which and why)."""


def _text_and_images(content: Any, where: str) -> tuple[str, list[str]]:
    """The text of a message's content (parts joined) and its image URLs, in order."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise BadMessage(f"{where}.content is {type(content).__name__}, expected text or a list of parts")
    texts: list[str] = []
    images: list[str] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("text", "input_text", "output_text"):
            texts.append(str(part.get("text", "")))
        elif kind == "image_url":
            url = part.get("image_url")
            url = str(url.get("url") if isinstance(url, Mapping) else url)
            if not url.startswith("data:image/"):
                raise BadMessage(
                    f"{where}.content[{i}] is an image at {url[:60]!r}; send images inline as "
                    "data:image/...;base64 URLs (the gateway fetches nothing and reads no files)"
                )
            images.append(url)
        else:
            raise BadMessage(
                f"{where}.content[{i}] has type {kind!r}; this endpoint reads text and image_url"
            )
    return "".join(texts), images


def _arguments(raw: Any) -> Any:
    """A call's arguments as data (a JSON string decoded; text that is not JSON kept as text)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def template_message(message: Mapping[str, Any], where: str) -> Message:
    """An OpenAI chat message as the chat template reads it (``developer`` as ``system``; a call's
    arguments as data; text parts joined; images as image parts)."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise BadMessage(f"{where} must be an object with a role")
    role = "system" if message["role"] == "developer" else message["role"]
    if role not in ("system", "user", "assistant", "tool"):
        raise BadMessage(f"{where}.role is {role!r}; expected system, developer, user, assistant or tool")
    text, images = _text_and_images(message.get("content"), where)
    out: dict[str, Any] = {"role": role}
    if images:
        out["content"] = [{"type": "image", "image": url} for url in images] + [
            {"type": "text", "text": text}
        ]
    else:
        out["content"] = text
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = [
            _template_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(message["tool_calls"])
        ]
    if role == "tool":
        out["tool_call_id"] = str(message.get("tool_call_id") or "")
        if message.get("name"):
            out["name"] = str(message["name"])
    return cast(Message, out)


def _template_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise BadMessage(f"{where} must have a function with a name")
    return {
        "id": str(call.get("id") or ""),
        "type": "function",
        "function": {"name": function["name"], "arguments": _arguments(function.get("arguments", "{}"))},
    }


def check_call_ids(messages: Sequence[Mapping[str, Any]], start: int = 0) -> None:
    """Refuse a tool result (from ``messages[start]`` on) that answers a call the assistant message
    before it did not make (by its id). Earlier messages were checked by earlier calls."""
    made: set[str] = set()
    first = start
    while first > 0 and messages[first - 1].get("role") == "tool":  # the calls the first results answer
        first -= 1
    for i in range(max(first - 1, 0), len(messages)):
        message = messages[i]
        if not isinstance(message, Mapping):
            continue
        if message.get("role") == "assistant":
            made = {
                str(c["id"])
                for c in message.get("tool_calls") or ()
                if isinstance(c, Mapping) and c.get("id")
            }
        answered = message.get("tool_call_id") if message.get("role") == "tool" else None
        if i >= start and answered and str(answered) not in made:
            raise BadMessage(
                f"messages[{i}] answers tool call {answered!r}, which the assistant before it did not make"
            )


def key(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a message means, for comparison: its role, its text without surrounding whitespace,
    its images, and its calls (names and decoded arguments). Ids and reasoning are left out."""
    role = "system" if message.get("role") == "developer" else message.get("role")
    content = message.get("content")
    if isinstance(content, list) and any(
        isinstance(p, Mapping) and p.get("type") == "image" for p in content
    ):
        text = "".join(str(p.get("text", "")) for p in content if p.get("type") == "text")
        images = [str(p.get("image")) for p in content if p.get("type") == "image"]
    else:
        text, images = _text_and_images(content, "message")
    calls = tuple(
        (c["function"]["name"], json.dumps(_arguments(c["function"].get("arguments")), sort_keys=True))
        for c in message.get("tool_calls") or ()
    )
    return (role, text.strip(), tuple(images), calls)


def same_message(x: Mapping[str, Any], y: Mapping[str, Any]) -> bool:
    """Whether two messages mean the same. Equal data is the same at once (a client re-sends its own
    earlier messages as they were: one dict comparison); only others are compared by ``key``."""
    return x == y or key(x) == key(y)


def same(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> bool:
    """Whether two message lists mean the same, message by message."""
    if len(a) != len(b):
        return False
    last = len(a) - 1  # a client re-sends its earlier messages as they were: all but the reply compare equal
    if last >= 0 and a[:last] == b[:last]:
        return same_message(a[last], b[last])
    return all(same_message(x, y) for x, y in zip(a, b, strict=True))


def first_difference(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> int:
    """The index of the first message that differs (the shorter length when one extends the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if not same_message(x, y):
            return i
    return min(len(a), len(b))


def reply_message(
    content: str, reasoning: str, calls: Sequence[ToolCall], call_ids: Sequence[str]
) -> dict[str, Any]:
    """The model's reply as an OpenAI chat message (what the client gets, and echoes back)."""
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)},
            }
            for call, call_id in zip(calls, call_ids, strict=True)
        ]
    return message


def sampled_message(text: str, calls: Sequence[ToolCall], call_ids: Sequence[str]) -> Message:
    """The model's reply as the rollout records it: the sampled text as content, with its calls."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c, i in zip(calls, call_ids, strict=True)
        ]
    return cast(Message, message)
