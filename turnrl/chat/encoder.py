"""Prompt encoding once, then observations as delta tokens; history is never re-rendered."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from turnrl.chat.check import CheckMode, CheckResult, compare, render_diff
from turnrl.chat.probe import TemplateProbe, Tools, probe_template, render_after_turn, string_arguments
from turnrl.chat.template import ChatTemplate, ChatTemplateError
from turnrl.types import Message
from turnrl.vision.content import has_images, is_image_part, normalize_images, text_parts

if TYPE_CHECKING:
    from turnrl.vision.processor import ImageInput, VisionProcessor


class NoVisionError(ValueError):
    """Messages carry images but the model has no image processor."""


@dataclass
class Encoded:
    """Token ids for some messages, with the images they hold (already expanded in ``ids``)."""

    ids: list[int]
    messages: list[Message]  # the messages as encoded: image parts hold PIL images
    images: list[ImageInput] = field(default_factory=list)  # in order of appearance
    inputs: dict[str, Any] = field(default_factory=dict)  # processor outputs for training (per turn)


class ChatEncoder:
    """Encodes conversations for one tokenizer; probes its template once per tool list."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template_kwargs: dict[str, Any] | None = None,
        vision: VisionProcessor | None = None,
    ) -> None:
        self.template = ChatTemplate(tokenizer, chat_template_kwargs)
        self.vision = vision  # the image processor of a vision-language model
        self._probes: dict[str, TemplateProbe] = {}

    def probe(self, tools: Tools = None) -> TemplateProbe:
        """The template's findings for this tool list (cached)."""
        key = json.dumps(tools, sort_keys=True, default=str) if tools else ""
        if key not in self._probes:
            self._probes[key] = probe_template(self.template, tools)
        return self._probes[key]

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template puts a request's tools into the prompt at all (SmolLM2's, for
        one, renders none: tools given to it never reach the model)."""
        asked: list[Message] = [{"role": "user", "content": "Hi."}]
        tool = {"type": "function", "function": {"name": "probe_tool_x7", "parameters": {"type": "object"}}}
        return self.template.render(asked, [tool], True) != self.template.render(asked, None, True)

    def conversation(self, tools: Tools = None) -> ConversationEncoder:
        """An encoder for one trajectory with these tools."""
        return ConversationEncoder(self.template, self.probe(tools), tools, self.vision)


class ConversationEncoder:
    """Per-trajectory encoding: the prompt once, then one delta per observation.

    Images: each image part renders as the template's placeholder (one image token), and the
    placeholder is then expanded to the image's token count. Only new images are processed;
    their training inputs come back per turn in ``Encoded.inputs``.
    """

    def __init__(
        self,
        template: ChatTemplate,
        probe: TemplateProbe,
        tools: Tools,
        vision: VisionProcessor | None = None,
    ) -> None:
        self.template = template
        self.probe = probe
        self.tools = list(tools) if tools else None
        self.vision = vision
        self.slow_turns = 0  # observations that needed a re-render of the fixed base

    def encode_prompt(self, messages: Sequence[Message]) -> list[int]:
        """The prompt with its generation prompt, rendered and encoded once."""
        return self.prompt(messages).ids

    def prompt(self, messages: Sequence[Message]) -> Encoded:
        """The prompt with its generation prompt and its images, rendered and encoded once."""
        messages, raw = self._normalize(messages)
        ids = self._encode_rendered(self.template.render(messages, self.tools, True), messages)
        return self._with_images(ids, messages, raw)

    def _encode_rendered(self, text: str, messages: Sequence[Message]) -> list[int]:
        """Encode a rendered conversation; message contents that spell control tokens stay text.
        Without such content (the usual case) this is one tokenizer call on the whole text."""
        contents = [c for m in messages for c in text_parts(m.get("content"))]
        if not any(self.template.has_special(c) for c in contents):
            return self.template.encode(text)
        return self.template.encode_protected(_content_pieces(text, contents))

    def observation(self, messages: Sequence[Message], last_token_text: str | None) -> Encoded:
        """Delta tokens of observation messages (see ``encode_observation``) and their images."""
        messages, raw = self._normalize(messages)
        return self._with_images(self.encode_observation(messages, last_token_text), messages, raw)

    def _normalize(self, messages: Sequence[Message]) -> tuple[list[Message], list[Any]]:
        if not has_images(messages):
            return list(messages), []
        if self.vision is None:
            raise NoVisionError("the messages hold images but the model has no image processor")
        return normalize_images(messages)

    def _with_images(self, ids: list[int], messages: list[Message], raw: list[Any]) -> Encoded:
        if self.vision is None:
            return Encoded(ids, messages)
        features = self.vision.features(raw)
        return Encoded(self.vision.expand(ids, features.images), messages, features.images, features.inputs)

    def assistant_text(self, token_ids: Sequence[int]) -> tuple[str, str | None]:
        """The model's turn as message content, and the text of its last token.

        A final end-of-turn token (the one the template closes assistant turns with) is not
        part of the content, since the template writes it itself; nor is a reply prefix.
        """
        if not token_ids:
            return "", None
        last = self.template.decode(token_ids[-1:])
        if last and self.probe.assistant_close.startswith(last):
            return self._content(self.template.decode(token_ids[:-1])), last
        return self._content(self.template.decode(token_ids)), last

    def streamed_text(self, text: str) -> str:
        """The content so far of a turn still being sampled, from the text of its tokens so far: as
        ``assistant_text``, with a tail that may yet become the end of turn, or a reply prefix not yet
        complete, held back."""
        prefix = self.probe.reply_prefix
        if prefix and prefix.startswith(text):
            return ""
        text = self._content(text)
        close = self.probe.assistant_close
        for size in range(min(len(close), len(text)), 0, -1):
            if close.startswith(text[-size:]):
                return text[:-size]
        return text

    def _content(self, text: str) -> str:
        """Sampled text as message content: without the prefix the template writes itself before an
        assistant's content (``probe.reply_prefix``, Functionary's recipient line)."""
        prefix = self.probe.reply_prefix
        return text[len(prefix) :] if prefix and text.startswith(prefix) else text

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
        role = str(next(iter(roles))) if len(roles) == 1 else ""
        shape = self.probe.shapes.get(role)
        contents = [m.get("content") for m in messages]
        placeholder = self.probe.image_placeholders.get(role)
        if shape is None or not all(isinstance(c, str) or placeholder is not None for c in contents):
            return self._encode_slow(messages, last_token_text)
        pieces: list[tuple[str, bool]] = [(self._after_model(shape.lead, last_token_text), False)]
        for i, content in enumerate(contents):
            if i:
                pieces.append((shape.between, False))
            if isinstance(content, str):
                pieces.append((content, True))
                continue
            for part in content or []:
                if is_image_part(part):
                    pieces.append((str(placeholder), False))
                elif isinstance(part, dict) and "text" in part:
                    pieces.append((str(part["text"]), True))
        pieces.append((shape.close, False))
        return self._encode_after(pieces, last_token_text)

    def _encode_slow(self, messages: Sequence[Message], last_token_text: str | None) -> list[int]:
        """Render the fixed base + the model turn (the calls of these tool results, or a placeholder)
        + the messages; keep what follows the model turn."""
        self.slow_turns += 1
        tools_only = all(m.get("role") == "tool" for m in messages)
        close = self.probe.turn_close("tool") if tools_only else None
        tail = render_after_turn(self.template, self.tools, self.probe.base, messages, True, close)
        tail = self._after_model(tail, last_token_text)
        contents = [c for m in messages for c in text_parts(m.get("content"))]
        return self._encode_after(_content_pieces(tail, contents), last_token_text)

    def _encode_after(self, pieces: list[tuple[str, bool]], last_token_text: str | None) -> list[int]:
        """Encode a delta that follows the model's last token. After a control token the delta is
        encoded with that token in front, then the token dropped: SentencePiece tokenizers start the
        text after a control token with a word-boundary piece (``<|end|>`` + ``▁\n`` in Phi-3), which
        a delta encoded alone would lack; elsewhere the result is the same as encoding it alone."""
        lead = self.template.special_token_id(last_token_text) if last_token_text else None
        if lead is not None and pieces and not pieces[0][1]:
            ids = self.template.encode_protected([(str(last_token_text) + pieces[0][0], False), *pieces[1:]])
            if ids[:1] == [lead]:
                return ids[1:]
        return self.template.encode_protected(pieces)

    def closing_ids(self, last_token_text: str | None) -> list[int]:
        """Tokens the template would put after a final model turn (for the sanity check)."""
        return self.template.encode(self._after_model(self.probe.assistant_close, last_token_text))

    def inference_context(self, messages: Sequence[Message], images: Sequence[ImageInput] = ()) -> list[int]:
        """``messages`` as a chat server renders them for the next model turn: the whole history
        re-rendered with the generation prompt (model turns as the model wrote them; from their
        ``tool_calls`` where the template needs those), content spelling control tokens kept as
        text, each image placeholder expanded to its image's tokens (``images``: the images of
        ``messages`` in order, as the rollout processed them). Raises ChatTemplateError when the
        template cannot render them, ImageTokenError when the render does not show every image."""
        if has_images(messages) and self.vision is None:
            raise NoVisionError("the messages hold images but the model has no image processor")
        as_written = [_without_calls(m) for m in messages]
        try:
            ids = self._encode_rendered(self.template.render(as_written, self.tools, True), as_written)
        except ChatTemplateError:
            if not _has_calls(messages):
                raise
            as_called = [string_arguments(_as_called(m)) if m.get("tool_calls") else m for m in messages]
            ids = self._encode_rendered(self.template.render(as_called, self.tools, True), as_called)
        return ids if self.vision is None else self.vision.expand(ids, images)

    def check(
        self,
        prompt_ids: list[int],
        response_ids: list[int],
        messages: Sequence[Message],
        *,
        last_token_text: str | None = None,
        ends_with_model: bool = True,
        mode: CheckMode = "strict",
        loss_mask: Sequence[int] | None = None,
        images: Sequence[ImageInput] = (),
    ) -> CheckResult:
        """Compare the rollout's tokens with a full re-render of ``messages``. ``last_token_text``:
        the last model turn's final token as text (``assistant_text`` gives it); ``ends_with_model``:
        the sequence ends with a model turn (no observation after it).

        Model turns re-render as the text the model wrote. When that fails (a template that
        renders a tool result only after a structured call raises, or drops it) and the turns
        hold ``tool_calls``, they re-render as the calls the template writes itself: then a
        difference that lies wholly in sampled tokens is the template's own spelling of the
        model's turn, expected; what is checked is every token around them."""
        if mode == "disable":
            return CheckResult(mode=mode, ok=True)
        closing = self.closing_ids(last_token_text) if ends_with_model else []
        incremental = prompt_ids + response_ids + closing
        sampled = None
        if loss_mask is not None:
            sampled = [0] * len(prompt_ids) + list(loss_mask) + [0] * len(closing)
        as_written = [_without_calls(m) for m in messages]
        try:
            result = self._compare(incremental, as_written, ends_with_model, mode, sampled, images)
        except ChatTemplateError:
            if not _has_calls(messages) or sampled is None:
                raise
        else:
            if result.ok or not _has_calls(messages) or sampled is None:
                return result
        as_called = [_as_called(m) for m in messages]
        try:
            return self._compare(incremental, as_called, ends_with_model, mode, sampled, images)
        except ChatTemplateError:  # a template that takes call arguments only as JSON text
            as_called = [string_arguments(m) if m.get("tool_calls") else m for m in as_called]
            return self._compare(incremental, as_called, ends_with_model, mode, sampled, images)

    def _compare(
        self,
        incremental: list[int],
        messages: list[Message],
        ends_with_model: bool,
        mode: CheckMode,
        sampled: list[int] | None,
        images: Sequence[ImageInput],
    ) -> CheckResult:
        rendered = self.template.render(messages, self.tools, not ends_with_model)
        reference = self.template.encode(rendered)
        if self.vision is not None:
            reference = self.vision.expand(reference, images)
        result = compare(self.template, incremental, reference, mode, self.probe.rewrites_reasoning, sampled)
        if not result.ok and sampled is not None and self.vision is None:
            self._mark_history_rewrites(result, incremental, sampled, messages)
        return result

    def _mark_history_rewrites(
        self, result: CheckResult, incremental: list[int], sampled: list[int], messages: list[Message]
    ) -> None:
        """Mark as expected (``history_rewrite``) each difference inside the prompt or an
        observation delta that is exactly what the template rendered at that point of the
        conversation, token for token, right after the model's last token: a template that
        renders a message otherwise once more follows (Hermes-3 closes the last tool result
        without its newline, Mistral moves the system prompt to the last user turn, MiniMax's
        generation prompt opens a <think> that history never shows) rewrites history, and the
        rollout keeps what the engine saw."""
        runs = _observation_runs(sampled)  # the prompt, then the delta before each later model turn
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"][-len(runs) :]
        if len(turns) != len(runs):
            return
        for hunk in result.hunks:
            k = next((k for k, (a, b) in enumerate(runs) if a <= hunk.start < b), None)
            if hunk.expected or k is None:
                continue
            try:
                live = self.template.render(messages[: turns[k]], self.tools, True)
            except ChatTemplateError:
                continue
            start, end = runs[k]  # with the model's last token: the delta must start where it ends
            tail = incremental[max(start - 1, 0) : end]
            if self.template.encode(live)[-len(tail) :] == tail:
                hunk.kind, hunk.expected = "history_rewrite", True
        result.ok = result.mismatches == 0
        result.diff = render_diff(self.template, incremental, result)


def _observation_runs(sampled: Sequence[int]) -> list[tuple[int, int]]:
    """The [start, end) token ranges that precede each model turn: the prompt, then the deltas
    between model turns (runs of 0 in ``sampled`` that a model token follows)."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, s in enumerate(sampled):
        if s and start is not None:
            runs.append((start, i))
            start = None
        elif not s and start is None:
            start = i
    return runs


def _has_calls(messages: Sequence[Message]) -> bool:
    return any(m.get("tool_calls") for m in messages)


def _without_calls(message: Message) -> Message:
    """A model turn as the model wrote it: its text, calls included, and no structured calls."""
    return cast(Message, {k: v for k, v in message.items() if k != "tool_calls"})


def _as_called(message: Message) -> Message:
    """A model turn with calls as a chat API would hand it back: the calls, no text of its own."""
    return cast(Message, dict(message, content="")) if message.get("tool_calls") else message


def _content_pieces(text: str, contents: Sequence[str]) -> list[tuple[str, bool]]:
    """``text`` as (piece, is_content) pairs: each of ``contents``, in order, found where the
    template rendered it (see ``_as_rendered``); a content not found stays part of the structure."""
    pieces: list[tuple[str, bool]] = []
    for content in contents:
        rendered = _as_rendered(content, text)
        if rendered:
            before, text = text.split(rendered, 1)
            pieces += [(before, False), (rendered, True)]
    pieces.append((text, False))
    return pieces


def _as_rendered(content: str, tail: str) -> str | None:
    """How ``content`` appears in a rendered ``tail``: verbatim, or as a JSON string's inside
    (templates that ``tojson`` a tool result, Llama 3.x's), so that control-token spellings in it
    stay text on the slow path too; None when it is not found."""
    if not content:
        return None
    for form in (content, json.dumps(content)[1:-1], json.dumps(content, ensure_ascii=False)[1:-1]):
        if form in tail:
            return form
    return None
