"""Tool-call parsers: find the calls in a model turn's text. One registry, one class per format.

Every parser ignores calls written inside the reasoning (``<think>...</think>``, everything before a
lone ``</think>``, everything after an unclosed ``<think>``; a reasoning tag inside a call's
arguments counts as one too, so such a call is not run) and never raises on malformed calls, JSON
nested too deeply included: each one becomes a line in ``errors``. Parsing is one pass over the
text, so a model repeating a tag thousands of times costs milliseconds (tests/test_parser_fuzz.py).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from turnrl.tools.base import ParseResult, ToolCall

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION_TAG = re.compile(r"<function=([^>\n]*)(>|\n|\Z)")
_PARAMETER_TAG = re.compile(r"<parameter=([^>\n]*)(>|\n|\Z)")
_PYTHON_TAG = "<|python_tag|>"
_LLAMA_END_TOKENS = ("<|eom_id|>", "<|eot_id|>")

Found = ToolCall | str
"""A parsed call, or the error line of a malformed one."""


def strip_reasoning(text: str) -> str:
    """Remove the reasoning: ``<think>...</think>`` blocks, text before a lone ``</think>``, and an
    unclosed ``<think>`` with all that follows. Linear in the text (a model repeating ``<think>``
    thousands of times costs one pass)."""
    kept: list[str] = []
    pos = 0
    while True:
        start = text.find("<think>", pos)
        if start < 0:
            kept.append(text[pos:])
            break
        kept.append(text[pos:start])
        end = text.find("</think>", start + len("<think>"))
        if end < 0:  # unclosed: the rest is reasoning
            break
        pos = end + len("</think>")
    visible = "".join(kept)
    if "</think>" in visible:
        visible = visible.rsplit("</think>", 1)[1]
    return visible


def _loads(text: str) -> tuple[Any, str | None]:
    """``json.loads``, or the error: malformed JSON, or JSON nested too deeply to decode."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, str(e)
    except RecursionError:
        return None, "nested too deeply"


class ToolParser(ABC):
    """Finds the tool calls in one model turn."""

    name: ClassVar[str] = ""

    def parse(self, text: str) -> ParseResult:
        """Parse ``text``; calls get ids ``call_0``, ``call_1``... in text order."""
        found, content = self.find(strip_reasoning(text))
        calls = [f for f in found if isinstance(f, ToolCall)]
        for i, call in enumerate(calls):
            call.id = f"call_{i}"
        errors = [f for f in found if isinstance(f, str)]
        return ParseResult(calls=calls, errors=errors, content=content.strip())

    @abstractmethod
    def find(self, visible: str) -> tuple[list[Found], str]:
        """Return the calls and errors in text order, and the text outside the calls."""


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
    """A new parser of the format ``name`` (see ``PARSERS``)."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool parser '{name}'; available: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


def _tagged_blocks(visible: str, parse_block: Callable[[str, str], list[Found]]) -> tuple[list[Found], str]:
    """Split ``visible`` on ``<tool_call>...</tool_call>`` blocks; an unclosed last block is an error.
    One pass with ``str.find``: a regex would rescan the tail from every unclosed ``<tool_call>``."""
    found: list[Found] = []
    content: list[str] = []
    pos = 0
    while True:
        start = visible.find(_OPEN, pos)
        if start < 0:
            content.append(visible[pos:])
            break
        content.append(visible[pos:start])
        end = visible.find(_CLOSE, start + len(_OPEN))
        if end < 0:
            found.append(f"unclosed <tool_call> tag: {_snippet(visible[start:])}")
            break
        found.extend(parse_block(visible[start + len(_OPEN) : end], visible[start : end + len(_CLOSE)]))
        pos = end + len(_CLOSE)
    return found, "".join(content)


def _call_from_object(obj: Any, raw: str, where: str) -> Found:
    """A ToolCall from ``{"name": ..., "arguments"|"parameters": {...} or a JSON string}``."""
    if not isinstance(obj, dict):
        return f"{where} must hold a JSON object, got {type(obj).__name__}: {_snippet(raw)}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return f'{where} has no "name": {_snippet(raw)}'
    arguments = obj.get("arguments", obj.get("parameters"))
    if isinstance(arguments, str):
        arguments, error = _loads(arguments) if arguments.strip() else ({}, None)
        if error:
            return f"invalid JSON in the arguments of tool call '{name}': {error}"
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return f"the arguments of tool call '{name}' must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(name=name.strip(), arguments=arguments, id="", raw=raw)


def _snippet(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@register_parser("hermes", "qwen", "qwen3", "qwen2_5")
class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5, Qwen3)."""

    def find(self, visible: str) -> tuple[list[Found], str]:
        """Each ``<tool_call>`` block holds one JSON call."""
        return _tagged_blocks(visible, self._parse_block)

    @staticmethod
    def _parse_block(body: str, raw: str) -> list[Found]:
        obj, error = _loads(body)
        if error:
            return [f"invalid JSON in <tool_call>: {error}"]
        return [_call_from_object(obj, raw, "<tool_call>")]


@register_parser("qwen3_coder", "qwen3_xml")
class Qwen3CoderParser(ToolParser):
    """``<tool_call><function=NAME><parameter=P>VALUE</parameter></function></tool_call>`` (Qwen3-Coder).

    Values are JSON-decoded when they parse as JSON (``42``, ``true``, ``[1, 2]``), else kept as text.
    """

    def find(self, visible: str) -> tuple[list[Found], str]:
        """Each ``<tool_call>`` block holds one or more ``<function=...>`` blocks."""
        return _tagged_blocks(visible, self._parse_block)

    def _parse_block(self, body: str, raw: str) -> list[Found]:
        functions = _function_blocks(body)
        if not functions:
            if "<function=" in body:
                return [f"unclosed <function=...> tag in <tool_call>: {_snippet(body)}"]
            return [f"no <function=NAME> in <tool_call>: {_snippet(body)}"]
        return [self._call(name.strip(), inner, raw) for name, inner in functions]

    @staticmethod
    def _call(name: str, body: str, raw: str) -> Found:
        if not name:
            return f"<function=> has no name: {_snippet(raw)}"
        return ToolCall(name=name, arguments=_parameters(body), id="", raw=raw)


def _tag_at(tag: re.Pattern[str], text: str, start: int) -> tuple[str | None, int]:
    """The name of the ``<tag=NAME>`` at ``start`` and the index after it; (None, where to look
    next) when a newline or the end comes before its ``>`` (no such tag starts before that)."""
    m = tag.match(text, start)
    assert m is not None  # the pattern matches wherever a tag's opening text is
    if m.group(2) == ">":
        return m.group(1), m.end()
    return None, (m.end() if m.group(2) else len(text))


def _function_blocks(body: str) -> list[tuple[str, str]]:
    """The ``<function=NAME>...</function>`` blocks of a call body as (name, inner text), in order;
    one pass (a regex would rescan the rest from every unclosed tag)."""
    blocks: list[tuple[str, str]] = []
    pos = 0
    while (start := body.find("<function=", pos)) >= 0:
        name, pos = _tag_at(_FUNCTION_TAG, body, start)
        if name is None:
            continue
        end = body.find("</function>", pos)
        if end < 0:
            break
        blocks.append((name, body[pos:end]))
        pos = end + len("</function>")
    return blocks


def _parameters(body: str) -> dict[str, Any]:
    """``<parameter=P>VALUE</parameter>`` pairs; a value also ends at the next ``<parameter=`` or at
    the end. One pass: each value's closing tag is looked for only up to the next parameter."""
    arguments: dict[str, Any] = {}
    pos = 0
    while (start := body.find("<parameter=", pos)) >= 0:
        name, pos = _tag_at(_PARAMETER_TAG, body, start)
        if name is None:
            continue
        following = body.find("<parameter=", pos)
        limit = following if following >= 0 else len(body)
        close = body.find("</parameter>", pos, limit)
        end = close if close >= 0 else limit
        arguments[name.strip()] = _xml_value(body[pos:end])
        pos = end + len("</parameter>") if close >= 0 else end
    return arguments


def _xml_value(text: str) -> Any:
    """A parameter value: the text between the tags less one newline each side, JSON-decoded if it can be."""
    text = text.removeprefix("\n").removesuffix("\n")
    value, error = _loads(text)
    return text if error else value


@register_parser("llama3_json", "llama3", "llama")
class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``,
    several separated by ``;``. Text is a call when it starts with ``{`` or holds ``<|python_tag|>``."""

    def find(self, visible: str) -> tuple[list[Found], str]:
        """Decode the JSON objects one after another."""
        for token in _LLAMA_END_TOKENS:
            visible = visible.replace(token, "")
        if _PYTHON_TAG in visible:
            content, body = visible.split(_PYTHON_TAG, 1)
        elif visible.lstrip().startswith("{"):
            content, body = "", visible
        else:
            return [], visible
        found, rest = self._decode_all(body)
        return found, content + rest

    @staticmethod
    def _decode_all(body: str) -> tuple[list[Found], str]:
        decoder = json.JSONDecoder()
        found: list[Found] = []
        pos = 0
        while True:
            while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
                pos += 1
            if pos >= len(body) or body[pos] != "{":
                return found, body[pos:]
            try:
                obj, end = decoder.raw_decode(body, pos)
            except (json.JSONDecodeError, RecursionError) as e:
                reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
                found.append(f"invalid JSON in tool call: {reason}")
                return found, ""
            found.append(_call_from_object(obj, body[pos:end], "tool call"))
            pos = end
