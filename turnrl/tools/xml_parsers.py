"""Tool-call formats that write each argument in tags of its own: GLM-4.5/4.6 (``<arg_key>`` /
``<arg_value>``), MiniMax-M2 (``<invoke name>`` / ``<parameter name>``) and DeepSeek-V3.2 (DSML).
A value is decoded as JSON when it parses as JSON, else kept as text (see ``parser_base.value``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from turnrl.tools.parser_base import Found, ToolParser, blocks, make_call, register_parser, snippet, value

_ATTRIBUTE = re.compile(r'([\w-]+)="([^"]*)"')


def elements(text: str, tag: str) -> Iterator[tuple[dict[str, str], str] | str]:
    """The ``<TAG attr="...">inner</TAG>`` elements of ``text`` in order, as (attributes, inner),
    or an error line for an unclosed one. One pass with ``str.find``."""
    opening, closing = f"<{tag}", f"</{tag}>"
    pos = 0
    while (start := text.find(opening, pos)) >= 0:
        head_end = text.find(">", start)
        end = text.find(closing, head_end + 1) if head_end >= 0 else -1
        if end < 0:
            yield f"unclosed <{tag}> tag: {snippet(text[start:])}"
            return
        yield dict(_ATTRIBUTE.findall(text[start + len(opening) : head_end])), text[head_end + 1 : end]
        pos = end + len(closing)


def _tag_pairs(body: str, key_tag: str, value_tag: str) -> tuple[dict[str, Any], str | None]:
    """``<key_tag>K</key_tag><value_tag>V</value_tag>`` pairs in order, or the error."""
    arguments: dict[str, Any] = {}
    pos = 0
    k_open, k_close, v_open, v_close = f"<{key_tag}>", f"</{key_tag}>", f"<{value_tag}>", f"</{value_tag}>"
    while (start := body.find(k_open, pos)) >= 0:
        key_end = body.find(k_close, start)
        v_start = body.find(v_open, key_end) if key_end >= 0 else -1
        v_end = body.find(v_close, v_start) if v_start >= 0 else -1
        if v_end < 0:
            return arguments, f"unclosed {k_open} or {v_open} tag: {snippet(body[start:])}"
        arguments[body[start + len(k_open) : key_end].strip()] = value(body[v_start + len(v_open) : v_end])
        pos = v_end + len(v_close)
    return arguments, None


@register_parser("glm45", "glm4", "glm")
class GlmParser(ToolParser):
    """GLM-4.5 / 4.6: ``<tool_call>NAME`` then ``<arg_key>K</arg_key><arg_value>V</arg_value>``
    pairs, then ``</tool_call>``."""

    def find(self, visible: str) -> tuple[list[Found], str]:
        """Each ``<tool_call>`` block holds one call."""
        return blocks(visible, "<tool_call>", "</tool_call>", self._call)

    @staticmethod
    def _call(body: str, raw: str) -> list[Found]:
        cut = min((i for i in (body.find("\n"), body.find("<arg_key>")) if i >= 0), default=len(body))
        arguments, error = _tag_pairs(body[cut:], "arg_key", "arg_value")
        return [error or make_call(body[:cut], arguments, raw)]


def _invocations(body: str, raw: str, invoke: str, parameter: str, typed: bool = False) -> list[Found]:
    """Calls from ``<INVOKE name="N"><PARAMETER name="K">V</PARAMETER></INVOKE>`` elements. With
    ``typed``, a parameter marked ``string="true"`` is kept as text (DSML)."""
    found: list[Found] = []
    for element in elements(body, invoke):
        if isinstance(element, str):
            found.append(element)
            continue
        attributes, inner = element
        arguments: dict[str, Any] = {}
        for item in elements(inner, parameter):
            if isinstance(item, str):
                found.append(item)
                break
            attrs, text = item
            is_text = typed and attrs.get("string") == "true"
            arguments[attrs.get("name", "")] = text if is_text else value(text)
        else:
            found.append(make_call(attributes.get("name", ""), arguments, raw))
    if not found:
        found.append(f"no <{invoke} name=...> in a tool-call block: {snippet(raw)}")
    return found


@register_parser("minimax_m2", "minimax")
class MiniMaxM2Parser(ToolParser):
    """MiniMax-M2: ``<invoke name="N"><parameter name="K">V</parameter></invoke>`` calls inside
    ``<minimax:tool_call>...</minimax:tool_call>``."""

    def find(self, visible: str) -> tuple[list[Found], str]:
        """Each block holds one or more invocations."""
        return blocks(
            visible,
            "<minimax:tool_call>",
            "</minimax:tool_call>",
            lambda b, r: _invocations(b, r, "invoke", "parameter"),
        )


_DSML = "｜DSML｜"


@register_parser("deepseek_v32", "dsml")
class DeepSeekV32Parser(ToolParser):
    """DeepSeek-V3.2's DSML: ``<｜DSML｜invoke name="N">`` calls with ``<｜DSML｜parameter name="K"
    string="true|false">`` arguments (text, or JSON) inside ``<｜DSML｜function_calls>``."""

    def find(self, visible: str) -> tuple[list[Found], str]:
        """Each ``function_calls`` block holds one or more invocations."""
        return blocks(
            visible,
            f"<{_DSML}function_calls>",
            f"</{_DSML}function_calls>",
            lambda b, r: _invocations(b, r, f"{_DSML}invoke", f"{_DSML}parameter", typed=True),
        )
