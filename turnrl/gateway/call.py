"""One call, whatever API it came in: the request as the gateway reads it (messages and tools in the
chat template's OpenAI form), the answer it gives, and an error with its HTTP status.

Each API module (``openai_chat``, ``openai_responses``, ``anthropic_messages``) reads its requests
into a ``ChatRequest`` and writes a ``Completed`` (and an ``ApiError``) in its own schema, so the
session logic sees one kind of call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from turnrl.gateway.session import Reply


class ApiError(Exception):
    """An error the client gets in its API's schema, with its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param


@dataclass
class ChatRequest:
    """What the gateway reads from a request: OpenAI chat messages and function tools, and limits."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    max_tokens: int | None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    dropped_tools: list[str] = field(default_factory=list)  # hosted tools' types (the model cannot call them)


@dataclass
class Completed:
    """One answered call: its replies (``n`` of them) and what the response reports with them."""

    replies: list[Reply]
    model: str
    prompt_tokens: int
    token_texts: list[list[str]]  # per reply, one per sampled token (for logprobs)
    logprobs: list[list[float]]  # per reply
    want_logprobs: bool
    cached_tokens: int = 0  # leading prompt tokens already held by the session (not encoded again)

    @property
    def reply(self) -> Reply:
        """The first (usually only) reply."""
        return self.replies[0]

    @property
    def completion_tokens(self) -> int:
        """Tokens sampled over all replies."""
        return sum(len(lps) for lps in self.logprobs)
