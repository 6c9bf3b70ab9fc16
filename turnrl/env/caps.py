"""Caps on what an env or a tool hands back: long texts keep their start and end, the cut said between."""

from __future__ import annotations

from typing import Any, cast

from turnrl.types import Message


def cap_text(text: str, limit: int | None) -> str:
    """``text`` within ``limit`` characters: its start and its end, the cut said in the middle."""
    if limit is None or len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    note = f"\n[... {len(text) - limit} characters cut: the output had {len(text)}, {limit} are shown ...]\n"
    return text[:head] + note + (text[-tail:] if tail else "")


def _cap_part(part: Any, limit: int) -> Any:
    if isinstance(part, dict) and isinstance(part.get("text"), str) and len(part["text"]) > limit:
        return {**part, "text": cap_text(part["text"], limit)}
    return part


def cap_messages(messages: list[Message], limit: int | None) -> tuple[list[Message], int]:
    """The messages with every text longer than ``limit`` cut by ``cap_text``; how many texts were cut."""
    if limit is None:
        return messages, 0
    out: list[Message] = []
    cut = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str) and len(content) > limit:
            message = cast(Message, {**message, "content": cap_text(content, limit)})
            cut += 1
        elif isinstance(content, list):
            parts = [_cap_part(p, limit) for p in content]
            changed = sum(1 for new, old in zip(parts, content, strict=True) if new is not old)
            if changed:
                message = cast(Message, {**message, "content": parts})
                cut += changed
        out.append(message)
    return out, cut
