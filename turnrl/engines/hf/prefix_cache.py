"""KV kept between the turns of a session, so a later turn prefills only its new tokens."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from turnrl.engines.hf.kv import KV
from turnrl.engines.hf.requests import Request


@dataclass
class _SessionKV:
    """The KV cache a finished generation leaves: its tokens and, per layer, keys and values."""

    tokens: list[int]  # prompt + sampled tokens but the last (whose KV was never computed)
    rows: list[KV]  # per layer: [heads, len(tokens), dim]


class PrefixCache:
    """Per-session KV, least recently used first out, within ``max_tokens`` tokens in all.

    Text-only requests with a session are kept; a request whose prompt extends its session's
    last prompt and sample reuses that KV. A weight update must ``clear`` it (the KV was computed
    with the old weights). Used by the worker thread only.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._sessions: OrderedDict[str, _SessionKV] = OrderedDict()
        self._tokens = 0
        self.stats = {"hits": 0, "reused_tokens": 0, "prefilled_tokens": 0}

    def take(self, request: Request) -> list[KV]:
        """The session's kept KV (per layer, ``[heads, len, dim]``) when the prompt extends its
        tokens, else none. The session's entry is taken out either way (the request's own KV
        replaces it)."""
        saved = self._sessions.pop(request.session, None) if request.session is not None else None
        if saved is None:
            return []
        self._tokens -= len(saved.tokens)
        n = len(saved.tokens)
        if request.images or n >= len(request.prompt_ids) or request.prompt_ids[:n] != saved.tokens:
            return []
        self.stats["hits"] += 1
        self.stats["reused_tokens"] += n
        return saved.rows

    def keeps(self, request: Request) -> bool:
        """Whether a finished request's KV is kept for its session's next turn (text-only ones)."""
        return request.session is not None and not request.images and self.max_tokens > 0

    def remember(self, request: Request, rows: list[KV]) -> None:
        """Keep a finished request's KV (per layer, unpadded) for its session's next turn."""
        assert request.session is not None
        tokens = request.prompt_ids + request.token_ids[:-1]
        if not rows or rows[0][0].shape[-2] != len(tokens) or len(tokens) > self.max_tokens:
            return
        old = self._sessions.pop(request.session, None)
        self._tokens -= len(old.tokens) if old else 0
        self._sessions[request.session] = _SessionKV(tokens, [(k.clone(), v.clone()) for k, v in rows])
        self._tokens += len(tokens)
        while self._tokens > self.max_tokens:
            _, evicted = self._sessions.popitem(last=False)
            self._tokens -= len(evicted.tokens)

    def clear(self) -> None:
        """Forget every session."""
        self._sessions.clear()
        self._tokens = 0
