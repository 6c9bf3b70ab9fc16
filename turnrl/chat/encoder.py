"""Prompt encoding once, then observations as delta tokens; history is never re-rendered."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from turnrl.chat.check import CheckMode, CheckResult, compare
from turnrl.chat.probe import (
    ASSISTANT_MARK,
    TemplateProbe,
    assistant_message,
    base_messages,
    probe_template,
)
from turnrl.chat.template import ChatTemplate
from turnrl.types import Message

Tools = Sequence[dict[str, Any]] | None


class ChatEncoder:
    """Encodes conversations for one tokenizer; probes its template once per tool list."""

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.template = ChatTemplate(tokenizer, chat_template_kwargs)
        self._probes: dict[str, TemplateProbe] = {}

    def probe(self, tools: Tools = None) -> TemplateProbe:
        """The template's findings for this tool list (cached)."""
        key = json.dumps(tools, sort_keys=True, default=str) if tools else ""
        if key not in self._probes:
            self._probes[key] = probe_template(self.template, tools)
        return self._probes[key]

    def conversation(self, tools: Tools = None) -> ConversationEncoder:
        """An encoder for one trajectory with these tools."""
        return ConversationEncoder(self.template, self.probe(tools), tools)


class ConversationEncoder:
    """Per-trajectory encoding: the prompt once, then one delta per observation."""

    def __init__(self, template: ChatTemplate, probe: TemplateProbe, tools: Tools) -> None:
        self.template = template
        self.probe = probe
        self.tools = list(tools) if tools else None
        self.slow_turns = 0  # observations that needed a re-render of the fixed base

    def encode_prompt(self, messages: Sequence[Message]) -> list[int]:
        """The prompt with its generation prompt, rendered and encoded once."""
        return self.template.encode(self.template.render(messages, self.tools, True))

    def assistant_text(self, token_ids: Sequence[int]) -> tuple[str, str | None]:
        """The model's turn as message content, and the text of its last token.

        A final end-of-turn token (the one the template closes assistant turns with) is not
        part of the content, since the template writes it itself.
        """
        if not token_ids:
            return "", None
        last = self.template.decode(token_ids[-1:])
        if last and self.probe.assistant_close.startswith(last):
            return self.template.decode(token_ids[:-1]), last
        return self.template.decode(token_ids), last

    def _after_model(self, text: str, last_token_text: str | None) -> str:
        """Drop the part of the template's post-assistant text that the model already sampled."""
        if last_token_text and text.startswith(last_token_text):
            return text[len(last_token_text) :]
        return text

    def encode_observation(self, messages: Sequence[Message], last_token_text: str | None) -> list[int]:
        """Delta tokens that follow a model turn: end-of-turn, the messages, the generation prompt.

        ``last_token_text`` is the text of the model's last sampled token: when it is the
        template's end-of-turn token it is not inserted again.
        """
        roles = {m.get("role") for m in messages}
        shape = self.probe.shapes.get(str(next(iter(roles)))) if len(roles) == 1 else None
        contents = [m.get("content") for m in messages]
        if shape is None or not all(isinstance(c, str) for c in contents):
            return self._encode_slow(messages, last_token_text)
        pieces: list[tuple[str, bool]] = [(self._after_model(shape.lead, last_token_text), False)]
        for i, content in enumerate(contents):
            if i:
                pieces.append((shape.between, False))
            pieces.append((str(content), True))
        pieces.append((shape.close, False))
        return self.template.encode_protected(pieces)

    def _encode_slow(self, messages: Sequence[Message], last_token_text: str | None) -> list[int]:
        """Render the fixed base + a placeholder assistant turn + the messages; keep the tail."""
        self.slow_turns += 1
        full = [*base_messages(), assistant_message(ASSISTANT_MARK), *messages]
        tail = self.template.render(full, self.tools, True).split(ASSISTANT_MARK, 1)[1]
        tail = self._after_model(tail, last_token_text)
        pieces: list[tuple[str, bool]] = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, str) and content and content in tail:
                before, tail = tail.split(content, 1)
                pieces += [(before, False), (content, True)]
        pieces.append((tail, False))
        return self.template.encode_protected(pieces)

    def closing_ids(self, last_token_text: str | None) -> list[int]:
        """Tokens the template would put after a final model turn (for the sanity check)."""
        return self.template.encode(self._after_model(self.probe.assistant_close, last_token_text))

    def check(
        self,
        prompt_ids: list[int],
        response_ids: list[int],
        messages: Sequence[Message],
        last_token_text: str | None,
        ends_with_model: bool,
        mode: CheckMode,
        loss_mask: Sequence[int] | None = None,
    ) -> CheckResult:
        """Compare the rollout's tokens with a full re-render of ``messages``."""
        if mode == "disable":
            return CheckResult(mode=mode, ok=True)
        closing = self.closing_ids(last_token_text) if ends_with_model else []
        incremental = prompt_ids + response_ids + closing
        sampled = None
        if loss_mask is not None:
            sampled = [0] * len(prompt_ids) + list(loss_mask) + [0] * len(closing)
        rendered = self.template.render(messages, self.tools, not ends_with_model)
        reference = self.template.encode(rendered)
        return compare(self.template, incremental, reference, mode, self.probe.rewrites_reasoning, sampled)
