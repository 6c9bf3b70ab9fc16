"""What every tool-call parser shares: the registry, the base class, reasoning removal, JSON helpers.

Every parser ignores calls written inside the reasoning (for ``<think>`` models: ``<think>...</think>``,
everything before a lone ``</think>``, everything after an unclosed ``<think>``; a family with other
tags names them) and never raises on malformed calls, JSON nested too deeply included: each one
becomes a line in ``errors``. Parsing is one pass over the text, so a model repeating a tag thousands
of times costs milliseconds (tests/test_parser_fuzz.py).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from turnrl.support import python_ast
from turnrl.tools.base import ParseResult, ToolCall

Found = ToolCall | str
"""A parsed call, or the error line of a malformed one."""

THINK = ("<think>", "</think>")


def segments(text: str, opening: str, closing: str) -> Iterator[tuple[str, str | None, bool]]:
    """``text`` cut at its ``opening...closing`` blocks, in order: (the text before a block, the
    block's inside, whether it is closed); the last item has no block (None). An unclosed block
    runs to the end. One pass with ``str.find``: a regex would rescan the tail from every
    unclosed opening tag."""
    pos = 0
    while (start := text.find(opening, pos)) >= 0:
        end = text.find(closing, start + len(opening))
        if end < 0:
            yield text[pos:start], text[start + len(opening) :], False
            return
        yield text[pos:start], text[start + len(opening) : end], True
        pos = end + len(closing)
    yield text[pos:], None, True


def split_reasoning(text: str, tags: tuple[str, str] = THINK) -> tuple[str, str]:
    """``text`` as (visible, reasoning): ``open...close`` blocks, text before a lone ``close`` and an
    unclosed ``open`` with all that follows are reasoning. Linear in the text."""
    opening, closing = tags
    kept: list[str] = []
    thought: list[str] = []
    for before, inside, _ in segments(text, opening, closing):
        kept.append(before)
        if inside is not None:
            thought.append(inside)
    visible = "".join(kept)
    if closing in visible:
        before, visible = visible.rsplit(closing, 1)
        thought.insert(0, before)
    return visible, "\n".join(t.strip() for t in thought if t.strip())


def strip_reasoning(text: str, tags: tuple[str, str] = THINK) -> str:
    """``text`` without its reasoning (see ``split_reasoning``)."""
    return split_reasoning(text, tags)[0]


def loads(text: str) -> tuple[Any, str | None]:
    """``json.loads``, or the error: malformed JSON, or JSON nested too deeply to decode."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, str(e)
    except RecursionError:
        return None, "nested too deeply"


def value(text: str) -> Any:
    """A parameter value written as text in an XML-like format: JSON when it parses as JSON
    (``42``, ``true``, ``[1, 2]``), a Python literal when it is one (Seed-OSS writes
    ``{'a': True}``), else the text itself."""
    decoded, error = loads(text)
    if not error:
        return decoded
    if text[:1] in "{[(" and len(text) < 100_000:
        try:
            return python_ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            pass
    return text


class ToolParser(ABC):
    """Finds the tool calls in one model turn."""

    name: ClassVar[str] = ""
    reasoning: ClassVar[tuple[str, str] | None] = THINK  # the family's reasoning tags

    def parse(self, text: str) -> ParseResult:
        """Parse ``text``; calls get ids ``call00000``, ``call00001``... in text order (nine letters
        and digits: the ids every template accepts, Mistral's included)."""
        visible, reasoning = split_reasoning(text, self.reasoning) if self.reasoning else (text, "")
        found, content = self.find(visible)
        calls = [f for f in found if isinstance(f, ToolCall)]
        for i, call in enumerate(calls):
            call.id = call_id(i)
        errors = [f for f in found if isinstance(f, str)]
        return ParseResult(calls=calls, errors=errors, content=content.strip(), reasoning=reasoning)

    @abstractmethod
    def find(self, visible: str) -> tuple[list[Found], str]:
        """Return the calls and errors in text order, and the text outside the calls."""


def call_id(index: int) -> str:
    """The id of a turn's ``index``-th call."""
    return f"call{index:05d}"


PARSERS: dict[str, type[ToolParser]] = {}
"""Parser classes by name, aliases included."""


def register_parser(*names: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator: register a parser under one or more names."""

    def register(cls: type[ToolParser]) -> type[ToolParser]:
        cls.name = cls.name or names[0]
        for name in names:
            PARSERS[name] = cls
        return cls

    return register


def get_parser(name: str) -> ToolParser:
    """A new parser of the format ``name`` (see ``PARSERS``; ``turnrl.tools.parsers`` registers them all)."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool parser '{name}'; available: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


def blocks(
    visible: str,
    opening: str,
    closing: str,
    parse_block: Callable[[str, str], list[Found]],
    required: bool = True,
) -> tuple[list[Found], str]:
    """Split ``visible`` on ``opening...closing`` blocks; an unclosed last block is an error (or, when
    the closing tag is not ``required``, runs to the end)."""
    found: list[Found] = []
    content: list[str] = []
    for before, inside, closed in segments(visible, opening, closing):
        content.append(before)
        if inside is None:
            break
        raw = opening + inside + (closing if closed else "")
        if closed or not required:
            found.extend(parse_block(inside, raw))
        else:
            found.append(f"unclosed {opening} tag: {snippet(raw)}")
    return found, "".join(content)


def call_from_object(
    obj: Any,
    raw: str,
    where: str,
    name_key: str = "name",
    argument_keys: tuple[str, ...] = ("arguments", "parameters"),
) -> Found:
    """A ToolCall from ``{"name": ..., "arguments"|"parameters": {...} or a JSON string}``."""
    if not isinstance(obj, dict):
        return f"{where} must hold a JSON object, got {type(obj).__name__}: {snippet(raw)}"
    name = obj.get(name_key)
    if not isinstance(name, str) or not name.strip():
        return f'{where} has no "{name_key}": {snippet(raw)}'
    arguments = next((obj[k] for k in argument_keys if k in obj), None)
    return make_call(name, arguments, raw)


def make_call(name: str, arguments: Any, raw: str) -> Found:
    """A ToolCall, or the error: arguments must be a JSON object (or a string holding one)."""
    name = name.strip()
    if not name:
        return f"a tool call has no name: {snippet(raw)}"
    if isinstance(arguments, str):
        arguments, error = loads(arguments) if arguments.strip() else ({}, None)
        if error:
            return f"invalid JSON in the arguments of tool call '{name}': {error}"
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return f"the arguments of tool call '{name}' must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(name=name, arguments=arguments, id="", raw=raw)


def json_list(body: str, raw: str, where: str, **keys: Any) -> list[Found]:
    """Calls from a JSON array of call objects (or one object)."""
    obj, error = loads(body.strip())
    if error:
        return [f"invalid JSON in {where}: {error}"]
    items = obj if isinstance(obj, list) else [obj]
    return [call_from_object(item, raw, where, **keys) for item in items]


def snippet(text: str, limit: int = 120) -> str:
    """``text`` on one line, cut to ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
