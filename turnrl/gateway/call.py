"""One call, whatever API it came in: the request as the gateway reads it (messages and tools in the
chat template's OpenAI form), the answer it gives, and an error with its HTTP status.

Each API is a ``Dialect`` (``openai_chat.OpenAIChat``, ``openai_responses.OpenAIResponses``,
``anthropic_messages.AnthropicMessages`` and ``AnthropicCountTokens``, registered in
``dialects.DIALECTS``): it reads its requests into a ``ChatRequest``, writes a ``Completed`` (and an
``ApiError``) in its own schema, and holds its own state, so the session logic sees one kind of
call and ``routes`` serves every dialect the same way. The checks every dialect reads a body with
(``checked_body``, ``positive``, ``stop_list``) are here too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.responses import StreamingResponse

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


Answer = Callable[[str, ChatRequest], Awaitable[Completed]]
"""The gateway's answer to a call of a session (aborted when the client goes away first)."""

Outgoing = dict[str, Any] | StreamingResponse
"""What a dialect answers: a JSON body, or the response that streams a call's events."""


@dataclass(frozen=True)
class Begun:
    """A streamed call once planned: the model that answers, its prompt's tokens, those of them the
    session already held."""

    model: str
    prompt_tokens: int
    cached_tokens: int


class Events(Protocol):
    """A dialect's event stream for one streamed call, written as the reply comes."""

    def opening(self, begun: Begun) -> list[str]:
        """The events before any content (the call is planned: its prompt size is known)."""
        ...

    def text(self, reasoning: str | None, delta: str) -> list[str]:
        """Content as it is sampled; ``reasoning`` (the whole of it) comes with the first content."""
        ...

    def closing(self, done: Completed, reasoning: str | None, rest: str) -> list[str]:
        """The end of the reply: ``reasoning`` when not shown yet, ``rest`` of the content, then the
        tool calls, the finish reason, the usage; every other reply of ``n > 1`` whole."""
        ...

    def failed(self, error: ApiError) -> list[str]:
        """An error after the stream began (the engine failed)."""
        ...


Stream = Callable[[str, ChatRequest, Events], Awaitable[StreamingResponse]]
"""The gateway's streamed answer to a call of a session: its events (``Events``) as the reply is
sampled, from a response returned once the call is planned (a call refused before that raises)."""


@dataclass
class Incoming:
    """One HTTP call as a dialect gets it."""

    body: Any  # the request's JSON
    session: str  # the session its URL or key may write to (authorized)
    named: bool  # whether its URL or key named that session (else the gateway's default one)
    answer: Answer
    stream: Stream


class Dialect(Protocol):
    """One API the gateway speaks: the paths it is served at (each also under ``/s/{session}``),
    how it answers a call, and its errors in its own schema."""

    paths: tuple[str, ...]
    counted: bool  # whether its errors count in /metrics (a token count is not a call)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        """``error`` as this API writes it."""
        ...

    async def serve(self, call: Incoming) -> Outgoing:
        """Read ``call``'s request, answer it (``call.answer``), write the answer (``ApiError``: a
        request it refuses)."""
        ...


def stop_list(value: Any, param: str) -> list[str]:
    """Stop strings as a list: a string, a list of strings, or nothing; ``ApiError`` (400) else."""
    if value is None or value == []:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise ApiError(400, f"{param} must be a string or a list of strings", param=param)


def checked_body(body: Any, known: set[str], listed: str) -> Mapping[str, Any]:
    """``body`` as a JSON object of fields the gateway knows, whose ``listed`` field is a non-empty
    list (or text, for the Responses API's ``input``); ``ApiError`` (400) names the first problem."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(
            400, f"unsupported parameter: {unknown[0]!r}", param=unknown[0], code="unsupported_parameter"
        )
    value = body.get(listed)
    if not (isinstance(value, list) and value) and not (listed == "input" and isinstance(value, str)):
        raise ApiError(400, f"'{listed}' must be a non-empty list", param=listed)
    return body


def positive(value: Any, name: str) -> int | None:
    """An optional positive integer field."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ApiError(400, f"{name} must be a positive integer", param=name)
    return value
