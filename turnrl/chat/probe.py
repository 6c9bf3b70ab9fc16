"""Learn how a chat template renders observations, by rendering marked probe conversations.

A template's quirks are data, not code paths: the probe finds, for each observation role,
the text the template puts before, between and after message contents when they follow an
assistant turn (end-of-turn token, separators, role headers, the generation prompt), and
checks that this shape does not depend on the content or on the number of messages. Roles
whose shape is stable take the fast path (string concatenation and one tokenizer call per
turn); the others fall back to rendering a fixed base conversation each turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from turnrl.chat.template import ChatTemplate, ChatTemplateError
from turnrl.types import Message

ASSISTANT_MARK = "ASSISTANT-MARK-q7"
REASONING_MARK = "REASONING-MARK-q7"
CALL_MARK = "CALL-MARK-q7"
BASE_SYSTEM = "You are a helpful assistant."
BASE_USER = "I am a user."


Tools = Sequence[dict[str, Any]] | None
"""A tool list as templates take it (None: no tools)."""


def _mark(i: int) -> str:
    return f"OBS-MARK-{i}-q7"


def base_messages(system: bool = True) -> list[Message]:
    """The fixed conversation that observations are rendered after (without the system message
    for templates that refuse one, Gemma's)."""
    user: Message = {"role": "user", "content": BASE_USER}
    return [{"role": "system", "content": BASE_SYSTEM}, user] if system else [user]


def assistant_message(content: str) -> Message:
    """An assistant message holding ``content``."""
    return {"role": "assistant", "content": content}


def observation_message(role: str, content: str, index: int = 0) -> Message:
    """A message of ``role`` as an env would send it (tool messages get a name and call id)."""
    if role == "tool":
        return {"role": "tool", "content": content, "name": "probe", "tool_call_id": call_id(index)}
    return {"role": role, "content": content}


def call_id(index: int) -> str:
    """A tool call id every template accepts: Mistral's demand 9 letters or digits."""
    return f"call{index:05d}"


@dataclass
class RoleShape:
    """How a run of consecutive messages of one role renders after an assistant turn."""

    role: str  # the chat role
    lead: str  # text from the end of the assistant content to the first message content
    between: str  # text between two consecutive contents
    close: str  # text after the last content, generation prompt included


@dataclass
class TemplateProbe:
    """What the probe found out about a template (for one tool list)."""

    assistant_close: str  # text after an assistant message's content when it ends the conversation
    shapes: dict[str, RoleShape] = field(default_factory=dict)  # fast-path roles
    slow_roles: dict[str, str] = field(default_factory=dict)  # role -> why it needs the slow path
    drops_past_reasoning: bool = False  # earlier turns' <think> blocks vanish from later renders
    injects_empty_think: bool = False  # the last assistant turn gets a <think></think> it never wrote
    generation_prompt: str = ""  # what add_generation_prompt appends
    image_placeholders: dict[str, str] = field(default_factory=dict)  # role -> text one image part renders as
    base: list[Message] = field(default_factory=base_messages)  # the fixed conversation observations follow

    def prompt(self, messages: Sequence[Message]) -> list[Message]:
        """``messages`` without their system message when the template has no system role."""
        return list(messages) if len(self.base) > 1 else [m for m in messages if m.get("role") != "system"]

    reply_prefix: str = ""  # what a model writes before its content (Functionary's recipient "all\n")
    native_calls: bool = False  # tool results render after the assistant turn that called them

    def turn_close(self, role: str) -> str | None:
        """``render_after_turn``'s ``close`` for observations of ``role``: tool results follow the
        turn that called them, when the template renders them so."""
        return self.assistant_close if role == "tool" and self.native_calls else None

    @property
    def rewrites_reasoning(self) -> bool:
        """Whether re-renders differ from the rollout in <think> blocks by design."""
        return self.drops_past_reasoning or self.injects_empty_think or "<think>" in self.generation_prompt

    def report(self) -> list[str]:
        """Human-readable findings, one per line."""
        lines = [f"assistant turn ends with {self.assistant_close!r}"]
        lines.append(f"generation prompt: {self.generation_prompt!r}")
        for role, shape in self.shapes.items():
            lines.append(
                f"role {role!r}: fast path; lead {shape.lead!r}, between {shape.between!r}, "
                f"close {shape.close!r}"
            )
        for role, why in self.slow_roles.items():
            lines.append(f"role {role!r}: slow path (re-render of a fixed base each turn): {why}")
        for role, text in self.image_placeholders.items():
            lines.append(f"role {role!r}: an image part renders as {text!r}")
        if self.drops_past_reasoning:
            lines.append("drops the reasoning of earlier turns from later renders (rollout keeps it)")
        if self.injects_empty_think:
            lines.append("adds an empty <think></think> block to a final assistant turn that had none")
        if not self.native_calls:
            lines.append("tool results: rendered after a plain assistant turn (not after a tool-call turn)")
        return lines


def _tail_after(text: str, mark: str) -> str:
    if text.count(mark) != 1:
        raise ChatTemplateError(f"the template rendered the probe marker {mark!r} {text.count(mark)} times")
    return text.split(mark, 1)[1]


def call_turn(observation: Sequence[Message]) -> Message:
    """The assistant turn that asked for ``observation``'s tool messages: one call per message, with
    its name and id, marked arguments, and no text (what the model wrote is already in the tokens)."""
    calls = [
        {
            "id": m.get("tool_call_id", call_id(i)),
            "type": "function",
            "function": {"name": m.get("name") or "probe", "arguments": {"probe": CALL_MARK}},
        }
        for i, m in enumerate(observation)
        if m.get("role") == "tool"
    ]
    return {"role": "assistant", "content": "", "tool_calls": calls}


def turn_end(tpl: ChatTemplate, rendered: str, close: str) -> int:
    """Where the model's part of a final assistant turn ends in ``rendered``: before the template's
    close of a plain turn, or before the part of it that follows a control token (Command-R closes
    a call with ``<|END_ACTION|>`` where it closes text with ``<|END_RESPONSE|>``), else before the
    turn's last control token (gpt-oss ends a call with ``<|call|>``, Gemma 4 with
    ``<|tool_response>``: the model samples it and stops)."""
    if rendered.endswith(close):
        return len(rendered) - len(close)
    for start in tpl.special_starts(close):
        if start and rendered.endswith(close[start:]):
            return len(rendered) - len(close) + start
    starts = tpl.special_starts(rendered)
    return starts[-1] if starts else len(rendered)


def string_arguments(message: Message) -> Message:
    """``message`` with its calls' arguments as JSON strings (the OpenAI wire form), for templates
    that take no mapping (Functionary)."""
    calls = [
        dict(c, function=dict(c["function"], arguments=json.dumps(c["function"]["arguments"])))
        if not isinstance(c["function"]["arguments"], str)
        else c
        for c in message.get("tool_calls") or []
    ]
    return cast(Message, dict(message, tool_calls=calls))


def model_turn(
    tpl: ChatTemplate, tools: Tools, base: Sequence[Message], message: Message, close: str
) -> tuple[str, str]:
    """What a model of the family writes for the assistant ``message`` (tool calls included), and
    the template's text after it (the turn's end, whose first token the model samples to stop):
    the template's render of ``message`` after the generation prompt (or after the turn's header
    as history renders it, for a prompt that history does not repeat). Call arguments that the
    template cannot take as a mapping are given as a JSON string (Functionary)."""
    try:
        full = tpl.render([*base, message], tools, False)
    except ChatTemplateError:
        if not message.get("tool_calls"):
            raise
        message = string_arguments(message)
        full = tpl.render([*base, message], tools, False)
    prompt = tpl.render(base, tools, True)
    if not full.startswith(prompt):
        marked = tpl.render([*base, assistant_message(ASSISTANT_MARK)], tools, False)
        header = marked.split(ASSISTANT_MARK, 1)[0]
        prompt = header if full.startswith(header) else tpl.render(base, tools, False)
    end = turn_end(tpl, full, close)
    return full[len(prompt) : end], full[end:]


def render_after_turn(
    tpl: ChatTemplate,
    tools: Tools,
    base: Sequence[Message],
    observation: Sequence[Message],
    generation_prompt: bool,
    close: str | None = None,
) -> str:
    """The template's text after a model turn and before, through and after ``observation``.

    With ``close`` (the template's close of a final plain assistant turn), the model turn is the
    one that called the observation's tools (``call_turn``), and the text starts where that turn's
    model part ends: templates that render a tool result only after its call (Gemma 4, gpt-oss) or
    close a call turn with a token of their own are seen as a rollout sees them. Without, the model
    turn is a plain marked message.
    """
    if close is None:
        messages = [*base, assistant_message(ASSISTANT_MARK), *observation]
        return _tail_after(tpl.render(messages, tools, generation_prompt), ASSISTANT_MARK)
    turn = call_turn(observation)
    try:
        alone = tpl.render([*base, turn], tools, False)
    except ChatTemplateError:  # a template that takes arguments only as a JSON string (Functionary)
        turn = string_arguments(turn)
        alone = tpl.render([*base, turn], tools, False)
    full = tpl.render([*base, turn, *observation], tools, generation_prompt)
    end = turn_end(tpl, alone, close)
    # the model part ends the same way in both renders, counted from the last call's arguments
    # (before them a template may rewrite a final turn: Qwen3 adds an empty <think> block)
    mark, at = alone.rfind(CALL_MARK, 0, end), full.rfind(CALL_MARK)
    if mark >= 0 and at >= 0 and full.startswith(alone[mark:end], at):
        return full[at + end - mark :]
    if mark < 0 and full.startswith(alone[:end]):  # a template that does not render the calls
        return full[end:]
    raise ChatTemplateError("the template renders a tool-call turn differently when its results follow")


def _probe_role(
    tpl: ChatTemplate, tools: Tools, role: str, base: list[Message], close: str | None
) -> RoleShape | str:
    """The role's shape, or the reason it has none (``close``: see ``render_after_turn``)."""

    def render(obs: list[Message]) -> str:
        return render_after_turn(tpl, tools, base, obs, True, close)

    try:
        tails = [render([observation_message(role, _mark(i), i) for i in range(k)]) for k in (1, 2, 3)]
        odd = "\n  " + _mark(0) + " \n"
        odd_tail = render([observation_message(role, odd)])
        other = cast(
            Message, dict(observation_message(role, _mark(0)), name="other", tool_call_id=call_id(9))
        )
        other_tail = render([other])
    except ChatTemplateError as exc:
        return str(exc)
    first = tails[0]
    if first.count(_mark(0)) != 1:
        return "content is not rendered verbatim"
    lead, after = first.split(_mark(0))
    second = tails[1][len(lead) + len(_mark(0)) :]
    if not tails[1].startswith(lead + _mark(0)) or _mark(1) not in second:
        return "the first message renders differently when another follows"
    between = second.split(_mark(1))[0]
    shape = RoleShape(role, lead, between, after)
    for k, tail in enumerate(tails, start=1):
        if tail != _assemble(shape, [_mark(i) for i in range(k)]):
            return f"{k} consecutive messages do not render as lead/between/close"
    if odd_tail != _assemble(shape, [odd]):
        return "content is trimmed or escaped by the template"
    if role == "tool" and other_tail != first:
        return "rendering depends on the tool name or call id"
    return shape


def _assemble(shape: RoleShape, contents: Sequence[str]) -> str:
    return shape.lead + shape.between.join(contents) + shape.close


def _probe_reasoning(tpl: ChatTemplate, tools: Tools, base: list[Message]) -> tuple[bool, bool]:
    thought = f"<think>\n{REASONING_MARK}\n</think>\n\n{ASSISTANT_MARK}"
    try:
        later = tpl.render(
            [*base, assistant_message(thought), {"role": "user", "content": _mark(0)}],
            tools,
            False,
        )
        final = tpl.render([*base, assistant_message(ASSISTANT_MARK)], tools, False)
    except ChatTemplateError:
        return False, False
    drops = REASONING_MARK not in later
    injects = "<think>" in final.split(BASE_USER, 1)[-1]
    return drops, injects


def probe_template(tpl: ChatTemplate, tools: Tools = None) -> TemplateProbe:
    """Probe ``tpl`` with ``tools`` in the system prompt."""
    base = base_messages()
    try:
        closing = render_after_turn(tpl, tools, base, [], False)
    except ChatTemplateError:  # a template without a system role (Gemma's raises on one)
        base = base_messages(system=False)
        closing = render_after_turn(tpl, tools, base, [], False)
    prompt, history = tpl.render(base, tools, True), tpl.render(base, tools, False)
    generation_prompt = prompt[len(history) :] if prompt.startswith(history) else ""
    probe = TemplateProbe(assistant_close=closing, generation_prompt=generation_prompt, base=base)
    probe.native_calls = _renders_results_after_calls(tpl, tools, base, closing)
    for role in ("tool", "user"):
        close = probe.turn_close(role)
        shape = _probe_role(tpl, tools, role, base, close)
        if isinstance(shape, RoleShape):
            probe.shapes[role] = shape
        else:
            probe.slow_roles[role] = shape
        placeholder = _probe_image(tpl, tools, role, base, close)
        if placeholder is not None:
            probe.image_placeholders[role] = placeholder
    probe.drops_past_reasoning, probe.injects_empty_think = _probe_reasoning(tpl, tools, base)
    probe.reply_prefix = _reply_prefix(tpl, tools, base)
    return probe


def _reply_prefix(tpl: ChatTemplate, tools: Tools, base: list[Message]) -> str:
    """Text a template puts between its generation prompt and an assistant message's content,
    which a model of the family therefore samples itself; <think> blocks are the reasoning probe's."""
    prompt = tpl.render(base, tools, True)
    full = tpl.render([*base, assistant_message(ASSISTANT_MARK)], tools, False)
    if not full.startswith(prompt) or ASSISTANT_MARK not in full:
        return ""
    prefix = full[len(prompt) : full.index(ASSISTANT_MARK)]
    return "" if "<think>" in prefix else prefix


def _renders_results_after_calls(tpl: ChatTemplate, tools: Tools, base: list[Message], close: str) -> bool:
    """Whether the template renders a tool result after the turn that called it, as it comes."""
    try:
        tails = [
            render_after_turn(
                tpl, tools, base, [observation_message("tool", _mark(i), i) for i in range(k)], True, close
            )
            for k in (1, 2)
        ]
    except ChatTemplateError:  # Llama 3.x renders one call per turn only
        return False
    return all(tail.count(_mark(0)) == 1 for tail in tails)


def _probe_image(
    tpl: ChatTemplate, tools: Tools, role: str, base: list[Message], close: str | None
) -> str | None:
    """The text an image part renders as in a ``role`` message, when list content renders like the
    same text as a string (so the fast path can flatten it); None when the template has no images."""
    parts = [{"type": "text", "text": _mark(0)}, {"type": "image"}, {"type": "text", "text": _mark(1)}]
    try:
        listed = render_after_turn(
            tpl, tools, base, [cast(Message, dict(observation_message(role, ""), content=parts))], True, close
        )
    except ChatTemplateError:
        return None
    if listed.count(_mark(0)) != 1 or listed.count(_mark(1)) != 1:
        return None
    placeholder = listed.split(_mark(0), 1)[1].split(_mark(1), 1)[0]
    flat = render_after_turn(
        tpl, tools, base, [observation_message(role, _mark(0) + placeholder + _mark(1))], True, close
    )
    return placeholder if placeholder and flat == listed else None
