"""A tokenizer's chat template and its tokenizer, behind three calls: render, encode, decode."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from turnrl.support.errors import describe
from turnrl.types import Message

_PIECEWISE_PROBE = 'Hello world, it\'s 4.\n  Two  spaces;\ttab {"a": [1]} <b> Ünïcode 中文 ok.\n\n'


class ChatTemplateError(ValueError):
    """The tokenizer has no usable chat template, or the template rejected the messages."""


class ChatTemplate:
    """Renders conversations with a tokenizer's chat template and encodes the text.

    Encoding goes straight to the fast tokenizer's Rust backend when there is one (about
    half the cost of the Python wrapper). ``encode(text, literal=True)`` never turns text
    that spells a special token (``<|im_end|>`` in a tool's output) into that token.
    """

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
            raise ChatTemplateError(f"tokenizer {name!r} has no chat template")
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._literal_backend = None
        if self._backend is not None:
            from tokenizers import Tokenizer

            self._literal_backend = Tokenizer.from_str(self._backend.to_str())
            self._literal_backend.encode_special_tokens = True
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        control = {i: str(t.content) for i, t in added.items() if getattr(t, "special", False)}
        # control tokens: the named specials and every added token marked special (<|eot_id|>,
        # <|end|>, <|turn>: not among all_special_tokens), never made from content's text
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", [])) | set(control)
        specials = {t for t in getattr(tokenizer, "all_special_tokens", []) if t} | set(control.values())
        self._control_ids = {text: i for i, text in control.items()}
        # longest first, so a token that contains another (<|im_end|> and <|im|>) is found whole
        spelled = sorted(specials, key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(t) for t in spelled)) if spelled else None

    def render(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None, generation_prompt: bool
    ) -> str:
        """The template's text for ``messages``."""
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=generation_prompt,
                tokenize=False,
                **self.kwargs,
            )
        except Exception as exc:  # jinja raises many kinds
            raise ChatTemplateError(f"chat template failed: {describe(exc)}") from exc
        return str(text)

    def encode(self, text: str, literal: bool = False) -> list[int]:
        """Token ids of ``text``; with ``literal``, special-token spellings stay plain text."""
        if not text:
            return []
        backend = self._literal_backend if literal else self._backend
        if backend is not None:
            return list(backend.encode(text, add_special_tokens=False).ids)
        out = self.tokenizer(text, add_special_tokens=False, split_special_tokens=literal)
        return list(out["input_ids"])

    def special_token_id(self, text: str) -> int | None:
        """The id of the control token spelled exactly ``text``, or None."""
        return self._control_ids.get(text)

    def has_special(self, text: str) -> bool:
        """Whether ``text`` spells any special token."""
        return self._special_re is not None and self._special_re.search(text) is not None

    def special_starts(self, text: str) -> list[int]:
        """Where each special-token spelling in ``text`` starts."""
        return [m.start() for m in self._special_re.finditer(text)] if self._special_re else []

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens included."""
        if self._backend is not None:
            return str(self._backend.decode(list(ids), skip_special_tokens=False))
        return str(
            self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        )

    @functools.cached_property
    def decodes_piecewise(self) -> bool:
        """Whether decoding ids a piece at a time and joining the texts gives the text of decoding
        them at once, at every cut that splits no character (byte-level BPE: yes; a tokenizer that
        drops a piece's leading space: no): a streamed reply is then decoded as it grows, not whole
        at every token."""
        ids = self.encode(_PIECEWISE_PROBE)
        whole = self.decode(ids)
        for cut in range(1, len(ids)):
            head, tail = self.decode(ids[:cut]), self.decode(ids[cut:])
            if "\ufffd" not in head + tail and head + tail != whole:
                return False
        return True

    def encode_protected(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        """Encode a text given as (piece, is_content) pairs; content never becomes a special token.

        When no content piece spells a special token, the whole text is encoded at once, so
        token boundaries match a full render exactly.
        """
        if not any(is_content and self.has_special(p) for p, is_content in pieces):
            return self.encode("".join(p for p, _ in pieces))
        ids: list[int] = []
        buffer = ""
        for piece, is_content in pieces:
            if is_content and self.has_special(piece):
                ids += self.encode(buffer)
                ids += self.encode(piece, literal=True)
                buffer = ""
            else:
                buffer += piece
        return ids + self.encode(buffer)
