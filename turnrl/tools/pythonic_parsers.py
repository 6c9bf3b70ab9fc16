"""Tool-call formats written as call expressions: pythonic lists ``[name(a=1, b="x")]`` (Llama 3.2 /
4 pythonic, LFM2 between ``<|tool_call_start|>`` and ``<|tool_call_end|>``) and Gemma 4's
``<|tool_call>call:NAME{key:value,...}<tool_call|>`` with strings between ``<|"|>`` marks.
"""

from __future__ import annotations

import ast
from typing import Any

from turnrl.support import python_ast
from turnrl.tools.parser_base import Found, ToolParser, blocks, loads, make_call, register_parser, snippet

_MAX_CHARS = 200_000  # longer call lists are refused rather than handed to the Python parser


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


def pythonic_calls(text: str, raw: str) -> list[Found]:
    """Calls from ``[f(a=1), g(b="x")]``: keyword arguments only, each a Python literal."""
    if len(text) > _MAX_CHARS:
        return [f"a pythonic tool-call list of {len(text)} characters is too long"]
    try:
        tree = python_ast.parse_expression(text.strip())
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        return [f"invalid pythonic tool calls ({type(e).__name__}): {snippet(raw)}"]
    if not isinstance(tree, ast.List):
        return [f"pythonic tool calls must be a list: {snippet(raw)}"]
    found: list[Found] = []
    for node in tree.elts:
        name = _dotted(node.func) if isinstance(node, ast.Call) else None
        if not isinstance(node, ast.Call) or name is None:
            found.append(f"not a call in a pythonic tool-call list: {snippet(ast.unparse(node))}")
            continue
        if node.args:
            found.append(f"tool call '{name}' has positional arguments; only keywords name them")
            continue
        try:
            arguments = {str(k.arg): ast.literal_eval(k.value) for k in node.keywords}
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            found.append(
                f"the arguments of tool call '{name}' are not literals: {snippet(ast.unparse(node))}"
            )
            continue
        found.append(make_call(name, arguments, raw))
    return found


@register_parser("pythonic", "llama3_pythonic", "llama4_pythonic")
class PythonicParser(ToolParser):
    """A turn that is a Python list of calls, ``[get_weather(city="Paris"), ...]``."""

    def find(self, visible: str) -> tuple[list[Found], str]:
        """The whole turn is a call list when it starts with ``[`` and ends with ``)]``."""
        text = visible.strip()
        if not (text.startswith("[") and text.endswith(")]")):
            return [], visible
        return pythonic_calls(text, text), ""


@register_parser("lfm2")
class Lfm2Parser(ToolParser):
    """LFM2: a pythonic call list between ``<|tool_call_start|>`` and ``<|tool_call_end|>``."""

    def find(self, visible: str) -> tuple[list[Found], str]:
        """Each block holds a call list."""
        return blocks(visible, "<|tool_call_start|>", "<|tool_call_end|>", pythonic_calls)


_QUOTE = '<|"|>'


class _GemmaReader:
    """Reads Gemma 4's argument syntax: ``{key:value,...}``, ``[a,b]``, ``<|"|>text<|"|>``, and bare
    numbers, booleans and null. Recursion is bounded by Python's limit (an error, not a crash)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def skip(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def value(self) -> Any:
        self.skip()
        text, pos = self.text, self.pos
        if text.startswith(_QUOTE, pos):
            end = text.find(_QUOTE, pos + len(_QUOTE))
            if end < 0:
                raise ValueError('unclosed <|"|> string')
            self.pos = end + len(_QUOTE)
            return text[pos + len(_QUOTE) : end]
        if text.startswith("{", pos):
            return self.mapping()
        if text.startswith("[", pos):
            return self.sequence()
        end = pos
        while end < len(text) and text[end] not in ",}]":
            end += 1
        self.pos = end
        word = text[pos:end].strip()
        decoded, error = loads(word)
        return word if error else decoded

    def mapping(self) -> dict[str, Any]:
        self.pos += 1  # {
        out: dict[str, Any] = {}
        while True:
            self.skip()
            if self.text.startswith("}", self.pos):
                self.pos += 1
                return out
            if self.text.startswith(_QUOTE, self.pos):
                key = str(self.value())
            else:
                colon = self.text.find(":", self.pos)
                if colon < 0:
                    raise ValueError("a key without ':'")
                key, self.pos = self.text[self.pos : colon].strip(), colon
            self.skip()
            if not self.text.startswith(":", self.pos):
                raise ValueError(f"expected ':' after key {key!r}")
            self.pos += 1
            out[key] = self.value()
            self.after_item("}")

    def sequence(self) -> list[Any]:
        self.pos += 1  # [
        out: list[Any] = []
        while True:
            self.skip()
            if self.text.startswith("]", self.pos):
                self.pos += 1
                return out
            out.append(self.value())
            self.after_item("]")

    def after_item(self, closing: str) -> None:
        self.skip()
        if self.text.startswith(",", self.pos):
            self.pos += 1
        elif not self.text.startswith(closing, self.pos):
            raise ValueError(f"expected ',' or {closing!r}")


@register_parser("gemma4", "gemma")
class Gemma4Parser(ToolParser):
    """Gemma 4: ``<|tool_call>call:NAME{key:value,...}<tool_call|>``; reasoning in ``<|channel>``
    ... ``<channel|>``; the ``<|tool_response>`` a call turn ends with is not content."""

    reasoning = ("<|channel>", "<channel|>")

    def find(self, visible: str) -> tuple[list[Found], str]:
        """Each block holds one call."""
        found, content = blocks(visible, "<|tool_call>", "<tool_call|>", self._call)
        return found, content.replace("<|tool_response>", "")

    @staticmethod
    def _call(body: str, raw: str) -> list[Found]:
        name, brace, _ = body.removeprefix("call:").partition("{")
        if not body.startswith("call:") or not brace:
            return [f"a Gemma tool call must read call:NAME{{...}}: {snippet(raw)}"]
        reader = _GemmaReader(body)
        reader.pos = body.index("{")
        try:
            arguments = reader.mapping()
        except (ValueError, RecursionError) as e:
            return [f"invalid arguments in tool call '{name.strip()}': {e}"]
        return [make_call(name, arguments, raw)]
