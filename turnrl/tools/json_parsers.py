"""Tool-call formats whose arguments are JSON: Mistral, DeepSeek V3/R1, Kimi K2, gpt-oss (harmony),
Nemotron, Granite 3, Command-R and Functionary. Each parses what its family's chat template renders
for an assistant turn with ``tool_calls`` (tests/test_parsers.py renders them with the real templates).
"""

from __future__ import annotations

import json
import re
from abc import abstractmethod
from typing import Any, ClassVar

from turnrl.tools.parser_base import (
    Found,
    ToolParser,
    blocks,
    call_from_object,
    json_list,
    make_call,
    register_parser,
    snippet,
)


def decode_prefix(text: str) -> tuple[Any, int, str | None]:
    """The JSON value at the start of ``text`` (after blanks), where it ends, or the error."""
    start = len(text) - len(text.lstrip())
    try:
        obj, end = json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError as e:
        return None, len(text), str(e)
    except RecursionError:
        return None, len(text), "nested too deeply"
    return obj, end, None


@register_parser("mistral", "devstral", "magistral")
class MistralParser(ToolParser):
    """``[TOOL_CALLS]`` followed by a JSON array of calls (Mistral-Nemo, v0.3), by
    ``NAME[CALL_ID]ID[ARGS]{...}`` (Mistral-Small 3.2) or by ``NAME[ARGS]{...}`` (Devstral,
    Magistral); each call of the last two has its own ``[TOOL_CALLS]``."""

    def find(self, visible: str) -> tuple[list[Found], str]:
        """Each ``[TOOL_CALLS]`` starts one call (or an array of them); text after the JSON is content."""
        content, *segments = visible.split("[TOOL_CALLS]")
        found: list[Found] = []
        rest: list[str] = []
        for segment in segments:
            raw = "[TOOL_CALLS]" + segment
            if segment.lstrip()[:1] in ("[", "{"):
                obj, end, error = decode_prefix(segment)
                if error:
                    found.append(f"invalid JSON after [TOOL_CALLS]: {error}")
                    continue
                items = obj if isinstance(obj, list) else [obj]
                found += [call_from_object(item, raw, "[TOOL_CALLS]") for item in items]
            elif "[ARGS]" in segment:
                head, arguments = segment.split("[ARGS]", 1)
                obj, end, error = decode_prefix(arguments)
                name = head.split("[CALL_ID]", 1)[0]
                if error:
                    found.append(f"invalid JSON in the arguments of tool call '{name.strip()}': {error}")
                    continue
                found.append(make_call(name, obj, raw))
                segment = arguments
            else:
                found.append(f"[TOOL_CALLS] without [ARGS] or a JSON array: {snippet(raw)}")
                continue
            rest.append(segment[end:])
        return found, content + "".join(rest)


class SectionParser(ToolParser):
    """Calls in a section (``section`` tags, which an end of turn may also close), each between
    ``call`` tags with the function's name, a ``separator``, then its JSON arguments."""

    section: ClassVar[tuple[str, str]]
    call: ClassVar[tuple[str, str]]
    separator: ClassVar[str]

    def find(self, visible: str) -> tuple[list[Found], str]:
        """The calls of every section; text outside sections is content."""
        return blocks(visible, *self.section, self._section, required=False)

    def _section(self, body: str, raw: str) -> list[Found]:
        found, _ = blocks(body, *self.call, self._call)
        return found

    def _call(self, body: str, raw: str) -> list[Found]:
        if self.separator not in body:
            return [f"no {self.separator} in a tool call: {snippet(raw)}"]
        head, arguments = body.split(self.separator, 1)
        name, arguments = self.name_and_arguments(head, arguments)
        return [make_call(name, arguments.strip(), raw)]

    @abstractmethod
    def name_and_arguments(self, head: str, arguments: str) -> tuple[str, str]:
        """The function's name and its arguments' JSON, from the text around the separator."""


_FENCE = re.compile(r"^\s*```(?:json)?\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)


@register_parser("deepseek_v3", "deepseek_v31", "deepseek_r1", "deepseek")
class DeepSeekParser(SectionParser):
    """DeepSeek's ``<｜tool▁calls▁begin｜>`` section of ``<｜tool▁call▁begin｜>`` calls: V3.1's
    ``NAME<｜tool▁sep｜>{...}`` and V3 / R1's ``function<｜tool▁sep｜>NAME`` + a fenced JSON block."""

    section = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    call = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")
    separator = "<｜tool▁sep｜>"

    def name_and_arguments(self, head: str, arguments: str) -> tuple[str, str]:
        """V3 / R1 write ``function``, then the name on its own line and fenced JSON."""
        if head.strip() != "function":
            return head, arguments
        name, _, arguments = arguments.partition("\n")
        fenced = _FENCE.match(arguments)
        return name, fenced.group(1) if fenced else arguments


@register_parser("kimi_k2", "kimi")
class KimiK2Parser(SectionParser):
    """Kimi K2: ``<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}
    <|tool_call_end|>`` calls in a ``<|tool_calls_section_begin|>`` section."""

    section = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    call = ("<|tool_call_begin|>", "<|tool_call_end|>")
    separator = "<|tool_call_argument_begin|>"

    def name_and_arguments(self, head: str, arguments: str) -> tuple[str, str]:
        """The name without its ``functions.`` prefix and ``:INDEX`` suffix."""
        name = head.strip().removeprefix("functions.")
        stem, _, index = name.rpartition(":")
        return (stem if stem and index.isdigit() else name), arguments


_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")


@register_parser("harmony", "gpt_oss", "openai")
class HarmonyParser(ToolParser):
    """gpt-oss's harmony messages: a call is a message to ``functions.NAME`` (in its header, as the
    model writes it, ``<|channel|>commentary to=functions.NAME <|constrain|>json``, or as the
    template renders it, ``to=functions.NAME<|channel|>commentary json``) with JSON after
    ``<|message|>``; the ``analysis`` channel is reasoning; ``final`` and ``commentary`` text is content."""

    reasoning = None  # the analysis channel, read message by message

    def find(self, visible: str) -> tuple[list[Found], str]:
        """Read the turn message by message (``<|start|>`` separates them)."""
        found: list[Found] = []
        content: list[str] = []
        for message in visible.split("<|start|>"):
            if "<|message|>" not in message:
                content.append(message)
                continue
            header, body = message.split("<|message|>", 1)
            for end in _HARMONY_ENDS:
                body = body.split(end, 1)[0]
            recipient = _RECIPIENT.search(header)
            channel = _CHANNEL.search(header)
            if recipient:
                found.append(make_call(recipient.group(1), body.strip(), "<|start|>" + message))
            elif not channel or channel.group(1) != "analysis":
                content.append(body)
        return found, "".join(content)


@register_parser("nemotron", "nemotron_json")
class NemotronParser(ToolParser):
    """Nemotron: a JSON array of ``{"name", "arguments"}`` in ``<TOOLCALL>...</TOOLCALL>``."""

    def find(self, visible: str) -> tuple[list[Found], str]:
        """Each block holds an array of calls."""
        return blocks(visible, "<TOOLCALL>", "</TOOLCALL>", lambda b, r: json_list(b, r, "<TOOLCALL>"))


@register_parser("granite", "granite3")
class GraniteParser(ToolParser):
    """Granite 3.x: ``<|tool_call|>`` then a JSON array of ``{"name", "arguments"}``."""

    def find(self, visible: str) -> tuple[list[Found], str]:
        """The array after each ``<|tool_call|>``; text after it is content."""
        content, *segments = visible.split("<|tool_call|>")
        found: list[Found] = []
        for segment in segments:
            obj, end, error = decode_prefix(segment)
            if error:
                found.append(f"invalid JSON after <|tool_call|>: {error}")
                continue
            items = obj if isinstance(obj, list) else [obj]
            found += [
                call_from_object(item, "<|tool_call|>" + segment[:end], "<|tool_call|>") for item in items
            ]
            content += segment[end:]
        return found, content


@register_parser("command_r", "command_r7b", "cohere")
class CommandRParser(ToolParser):
    """Command-R7B: ``<|START_ACTION|>`` a JSON array of ``{"tool_call_id", "tool_name",
    "parameters"}`` ``<|END_ACTION|>``; reasoning between ``<|START_THINKING|>`` and
    ``<|END_THINKING|>``; the answer between ``<|START_RESPONSE|>`` and ``<|END_RESPONSE|>``."""

    reasoning = ("<|START_THINKING|>", "<|END_THINKING|>")

    def find(self, visible: str) -> tuple[list[Found], str]:
        """Each action block holds an array of calls."""
        found, content = blocks(visible, "<|START_ACTION|>", "<|END_ACTION|>", self._action)
        return found, content.replace("<|START_RESPONSE|>", "").replace("<|END_RESPONSE|>", "")

    @staticmethod
    def _action(body: str, raw: str) -> list[Found]:
        return json_list(body, raw, "<|START_ACTION|>", name_key="tool_name", argument_keys=("parameters",))


_RECIPIENT_LINE = re.compile(r"[A-Za-z_][\w.\-]*")


@register_parser("functionary", "functionary_v3")
class FunctionaryParser(ToolParser):
    """Functionary v3.2: ``>>>RECIPIENT\\n`` then text for ``all`` or JSON arguments for a function.
    The first recipient line may be in the generation prompt (``>>>``) and ``all\\n`` in the
    template's own prefix, so a turn may start with either."""

    def find(self, visible: str) -> tuple[list[Found], str]:
        """Each ``>>>`` starts a message to a recipient."""
        found: list[Found] = []
        content: list[str] = []
        for i, segment in enumerate(visible.split(">>>")):
            recipient, newline, body = segment.partition("\n")
            if recipient.strip() == "all" and newline:
                content.append(body)
            elif newline and _RECIPIENT_LINE.fullmatch(recipient.strip()) and body.lstrip().startswith("{"):
                found.append(make_call(recipient, body.strip(), ">>>" + segment))
            elif i == 0:
                content.append(segment)
            elif segment.strip():
                found.append(f"no recipient line after >>>: {snippet(segment)}")
        return found, "".join(content)
