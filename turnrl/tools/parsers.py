"""Tool-call parsers: find the calls in a model turn's text, one class per family format.

The registry and the shared rules (reasoning ignored, malformed calls become error lines, one pass
over the text) are in ``parser_base``; ``json_parsers``, ``xml_parsers`` and ``pythonic_parsers``
hold the other families' formats. ``parser_for_template`` names the format a chat template renders.
"""

from __future__ import annotations

import json
import re
from typing import Any

from turnrl.tools import json_parsers, pythonic_parsers, xml_parsers
from turnrl.tools.base import ToolCall
from turnrl.tools.parser_base import (
    PARSERS,
    Found,
    ToolParser,
    blocks,
    call_from_object,
    get_parser,
    loads,
    make_call,
    register_parser,
    snippet,
    split_reasoning,
    strip_reasoning,
    value,
)

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION_TAG = re.compile(r"<function=([^>\n]*)(>|\n|\Z)")
_PARAMETER_TAG = re.compile(r"<parameter=([^>\n]*)(>|\n|\Z)")
_PYTHON_TAG = "<|python_tag|>"
_LLAMA_END_TOKENS = ("<|eom_id|>", "<|eot_id|>")


@register_parser("hermes", "qwen", "qwen3", "qwen2_5")
class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5, Qwen3)."""

    def find(self, visible: str) -> tuple[list[Found], str]:
        """Each ``<tool_call>`` block holds one JSON call."""
        return blocks(visible, _OPEN, _CLOSE, self._parse_block)

    @staticmethod
    def _parse_block(body: str, raw: str) -> list[Found]:
        obj, error = loads(body)
        if error:
            return [f"invalid JSON in <tool_call>: {error}"]
        return [call_from_object(obj, raw, "<tool_call>")]


@register_parser("qwen3_coder", "qwen3_xml")
class Qwen3CoderParser(ToolParser):
    """``<tool_call><function=NAME><parameter=P>VALUE</parameter></function></tool_call>`` (Qwen3-Coder).

    Values are JSON-decoded when they parse as JSON (``42``, ``true``, ``[1, 2]``), else kept as text.
    """

    def find(self, visible: str) -> tuple[list[Found], str]:
        """Each ``<tool_call>`` block holds one or more ``<function=...>`` blocks."""
        return blocks(visible, _OPEN, _CLOSE, self._parse_block)

    def _parse_block(self, body: str, raw: str) -> list[Found]:
        functions = _function_blocks(body)
        if not functions:
            if "<function=" in body:
                return [f"unclosed <function=...> tag in <tool_call>: {snippet(body)}"]
            return [f"no <function=NAME> in <tool_call>: {snippet(body)}"]
        return [self._call(name.strip(), inner, raw) for name, inner in functions]

    @staticmethod
    def _call(name: str, body: str, raw: str) -> Found:
        if not name:
            return f"<function=> has no name: {snippet(raw)}"
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
    """A parameter value: the text between the tags less one newline each side, decoded (``value``)."""
    return value(text.removeprefix("\n").removesuffix("\n"))


@register_parser("seed_oss", "seed")
class SeedOssParser(Qwen3CoderParser):
    """Seed-OSS: Qwen3-Coder's ``<function=NAME><parameter=P>`` calls inside
    ``<seed:tool_call>...</seed:tool_call>``, reasoning in ``<seed:think>``."""

    reasoning = ("<seed:think>", "</seed:think>")

    def find(self, visible: str) -> tuple[list[Found], str]:
        """Each ``<seed:tool_call>`` block holds one or more ``<function=...>`` blocks."""
        return blocks(visible, "<seed:tool_call>", "</seed:tool_call>", self._parse_block)


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
            found.append(call_from_object(obj, body[pos:end], "tool call"))
            pos = end


MARKERS = [
    ("<|tool_call>call:", "gemma4"),
    ("<minimax:tool_call>", "minimax_m2"),
    ("DSML", "deepseek_v32"),
    ("tool▁calls▁begin", "deepseek_v3"),
    ("<|tool_calls_section_begin|>", "kimi_k2"),
    ("<|channel|>commentary", "harmony"),
    ("<seed:tool_call>", "seed_oss"),
    ("<arg_key>", "glm45"),
    ("<function=", "qwen3_coder"),
    ("[TOOL_CALLS]", "mistral"),
    ("<TOOLCALL>", "nemotron"),
    ("<|tool_call|>", "granite"),
    ("<|START_ACTION|>", "command_r"),
    ("<|tool_list_start|>", "lfm2"),
    (">>>", "functionary"),
    ("<tool_call>", "hermes"),
    ("<|start_header_id|>ipython", "llama3_json"),
]
"""A text only one family's template holds, and that family's call format; the first found wins."""


def parser_for_template(template: str) -> str | None:
    """The name of the tool-call format a chat template's source renders, or None when it names
    none of the known ones (a template without tools)."""
    return next((name for marker, name in MARKERS if marker in template), None)


__all__ = [
    "PARSERS",
    "HermesParser",
    "Llama3JsonParser",
    "Qwen3CoderParser",
    "SeedOssParser",
    "ToolCall",
    "ToolParser",
    "get_parser",
    "json_parsers",
    "make_call",
    "parser_for_template",
    "pythonic_parsers",
    "register_parser",
    "split_reasoning",
    "strip_reasoning",
    "xml_parsers",
]
