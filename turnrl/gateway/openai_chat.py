"""OpenAI Chat Completions: a request read into what the gateway needs, a reply written as the API's
response or its stream of chunks, and errors in the API's own schema."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from turnrl.gateway.session import Reply

KNOWN = {
    "model", "messages", "tools", "tool_choice", "parallel_tool_calls", "n", "stop", "max_tokens",
    "max_completion_tokens", "logprobs", "top_logprobs", "stream", "stream_options", "temperature", "top_p",
    "seed", "user", "metadata", "store", "reasoning_effort", "frequency_penalty", "presence_penalty",
}  # fmt: skip
"""Fields a request may carry; sampling fields are read but the config's sampling wins."""


class ApiError(Exception):
    """An error the client gets in the API's schema, with its HTTP status."""

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

    def body(self) -> dict[str, Any]:
        """The error as the API writes it."""
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """What the gateway reads from a chat completions request."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    max_tokens: int | None
    stop: list[str]
    logprobs: bool
    stream: bool
    include_usage: bool


def read_request(body: Any) -> ChatRequest:
    """Validate a request body; ``ApiError`` (400) names the first problem."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise ApiError(
            400, f"unsupported parameter: {unknown[0]!r}", param=unknown[0], code="unsupported_parameter"
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    if body.get("n") not in (None, 1):
        raise ApiError(400, "only n=1 is supported: send one request per sample", param="n")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(_is_function(t) for t in tools)):
        raise ApiError(
            400, "'tools' must be a list of {type: function, function: {name, ...}}", param="tools"
        )
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ApiError(400, "max_tokens must be a positive integer", param="max_tokens")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    options = body.get("stream_options") or {}
    return ChatRequest(
        model=str(body.get("model", "")),
        messages=messages,
        tools=tools or None,
        max_tokens=limit,
        stop=[str(s) for s in stop],
        logprobs=bool(body.get("logprobs")),
        stream=bool(body.get("stream")),
        include_usage=bool(isinstance(options, Mapping) and options.get("include_usage")),
    )


def _is_function(tool: Any) -> bool:
    function = tool.get("function") if isinstance(tool, Mapping) else None
    return (
        tool.get("type") == "function"
        and isinstance(function, Mapping)
        and isinstance(function.get("name"), str)
    )


@dataclass
class Completed:
    """One answered call: the reply and what the response reports with it."""

    reply: Reply
    model: str
    prompt_tokens: int
    token_texts: list[str]  # one per sampled token (for logprobs)
    logprobs: list[float]
    want_logprobs: bool

    @property
    def usage(self) -> dict[str, int]:
        """The call's true token counts."""
        done = len(self.logprobs)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done,
            "total_tokens": self.prompt_tokens + done,
        }

    def _logprobs(self) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        content = [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(self.token_texts, self.logprobs, strict=True)
        ]
        return {"content": content}

    def response(self) -> dict[str, Any]:
        """The whole chat completion."""
        choice = {
            "index": 0,
            "message": self.reply.message,
            "finish_reason": self.reply.finish_reason,
            "logprobs": self._logprobs(),
        }
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": self.usage,
        }

    def chunks(self, include_usage: bool) -> Iterator[str]:
        """The reply as server-sent events: the role, the reasoning, the content, each call, the
        finish reason, the usage when asked, then ``[DONE]``."""
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": self.model}  # fmt: skip

        def event(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return f"data: {json.dumps(base | {'choices': [choice]} | extra)}\n\n"

        message = self.reply.message
        yield event({"role": "assistant", "content": ""})
        if message.get("reasoning_content"):
            yield event({"reasoning_content": message["reasoning_content"]})
        if message.get("content"):
            yield event({"content": message["content"]})
        for i, call in enumerate(message.get("tool_calls") or ()):
            yield event({"tool_calls": [{"index": i, **call}]})
        yield event({}, self.reply.finish_reason)
        if include_usage:
            yield f"data: {json.dumps(base | {'choices': [], 'usage': self.usage})}\n\n"
        yield "data: [DONE]\n\n"
