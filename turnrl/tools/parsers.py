"""Tool-call parsers: find the calls in a model turn's text. One registry, one class per format.

Every parser ignores calls written inside the reasoning (``<think>...</think>``, or everything before a
lone ``</think>``) and never raises on malformed calls: each one becomes a line in ``errors``.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from turnrl.tools.base import ParseResult, ToolCall

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION_BLOCK = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_LLAMA_END_TOKENS = ("<|eom_id|>", "<|eot_id|>")

Found = ToolCall | str
"""A parsed call, or the error line of a malformed one."""


def strip_reasoning(text: str) -> str:
    """Remove the reasoning: ``<think>...</think>`` blocks, text before a lone ``</think>``, and an
    unclosed ``<think>`` with all that follows."""
    visible = _THINK_BLOCK.sub("", text)
    if "</think>" in visible:
        visible = visible.rsplit("</think>", 1)[1]
    if "<think>" in visible:
        visible = visible.split("<think>", 1)[0]
    return visible


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
    """Split ``visible`` on ``<tool_call>...</tool_call>`` blocks; an unclosed last block is an error."""
    found: list[Found] = []
    content: list[str] = []
    pos = 0
    for match in _TOOL_CALL_BLOCK.finditer(visible):
        content.append(visible[pos : match.start()])
        found.extend(parse_block(match.group(1), match.group(0)))
        pos = match.end()
    tail = visible[pos:]
    if "<tool_call>" in tail:
        tail, unclosed = tail.split("<tool_call>", 1)
        found.append(f"unclosed <tool_call> tag: {_snippet('<tool_call>' + unclosed)}")
    content.append(tail)
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
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return f"invalid JSON in the arguments of tool call '{name}': {e}"
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
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return [f"invalid JSON in <tool_call>: {e}"]
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
        functions = list(_FUNCTION_BLOCK.finditer(body))
        if not functions:
            if "<function=" in body:
                return [f"unclosed <function=...> tag in <tool_call>: {_snippet(body)}"]
            return [f"no <function=NAME> in <tool_call>: {_snippet(body)}"]
        return [self._call(m.group(1).strip(), m.group(2), raw) for m in functions]

    @staticmethod
    def _call(name: str, body: str, raw: str) -> Found:
        if not name:
            return f"<function=> has no name: {_snippet(raw)}"
        arguments = {m.group(1).strip(): _xml_value(m.group(2)) for m in _PARAMETER.finditer(body)}
        return ToolCall(name=name, arguments=arguments, id="", raw=raw)


def _xml_value(text: str) -> Any:
    """A parameter value: the text between the tags less one newline each side, JSON-decoded if it can be."""
    text = text.removeprefix("\n").removesuffix("\n")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


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
            except json.JSONDecodeError as e:
                found.append(f"invalid JSON in tool call: {e}")
                return found, ""
            found.append(_call_from_object(obj, body[pos:end], "tool call"))
            pos = end
