"""OpenAI Chat Completions: a request read into a ``ChatRequest``, an answer written as the API's
response or its stream of chunks, and errors in the API's own schema."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

from turnrl.gateway.call import (
    ApiError,
    Begun,
    ChatRequest,
    Completed,
    Incoming,
    Outgoing,
    checked_body,
    positive,
    stop_list,
)
from turnrl.gateway.session import Reply

KNOWN = {
    "model", "messages", "tools", "tool_choice", "parallel_tool_calls", "n", "stop", "max_tokens",
    "max_completion_tokens", "logprobs", "top_logprobs", "stream", "stream_options", "temperature", "top_p",
    "seed", "user", "metadata", "store", "reasoning_effort", "frequency_penalty", "presence_penalty",
}  # fmt: skip
"""Fields a request may carry; sampling fields are read but the config's sampling wins."""
MAX_N = 16


def error_body(error: ApiError) -> dict[str, Any]:
    """An error as the OpenAI API writes it."""
    return {"error": {"message": str(error), "type": error.kind, "param": error.param, "code": error.code}}


def read_request(body: Any) -> ChatRequest:
    """Validate a request body; ``ApiError`` (400) names the first problem."""
    body = checked_body(body, KNOWN, "messages")
    messages = body["messages"]
    n = positive(body.get("n"), "n") or 1
    if n > MAX_N:
        raise ApiError(400, f"n is {n}; at most {MAX_N} samples per request", param="n")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(_is_function(t) for t in tools)):
        raise ApiError(
            400, "'tools' must be a list of {type: function, function: {name, ...}}", param="tools"
        )
    limit = positive(body.get("max_completion_tokens", body.get("max_tokens")), "max_tokens")
    stop = stop_list(body.get("stop"), "stop")
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
        n=n,
    )


def _is_function(tool: Any) -> bool:
    function = tool.get("function") if isinstance(tool, Mapping) else None
    return (
        tool.get("type") == "function"
        and isinstance(function, Mapping)
        and isinstance(function.get("name"), str)
    )


def usage(done: Completed) -> dict[str, Any]:
    """The call's true token counts."""
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


def _logprobs(done: Completed, k: int) -> dict[str, Any] | None:
    if not done.want_logprobs:
        return None
    content = [
        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
        for t, lp in zip(done.token_texts[k], done.logprobs[k], strict=True)
    ]
    return {"content": content}


def response(done: Completed) -> dict[str, Any]:
    """The whole chat completion."""
    choices = [
        {"index": k, "message": r.message, "finish_reason": r.finish_reason, "logprobs": _logprobs(done, k)}
        for k, r in enumerate(done.replies)
    ]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": done.model,
        "choices": choices,
        "usage": usage(done),
    }


class Chunks:
    """The answer as server-sent chunks, written as it comes (``streaming.Events``): the role, the
    reasoning and content (of the first choice as sampled), each call and the finish reason per
    choice; the usage when asked; then ``[DONE]``."""

    def __init__(self, include_usage: bool) -> None:
        self.include_usage = include_usage
        self.base: dict[str, Any] = {}

    def _event(self, k: int, delta: dict[str, Any], finish: str | None = None) -> str:
        choice = {"index": k, "delta": delta, "finish_reason": finish, "logprobs": None}
        return f"data: {json.dumps(self.base | {'choices': [choice]})}\n\n"

    def opening(self, begun: Begun) -> list[str]:
        self.base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                     "created": int(time.time()), "model": begun.model}  # fmt: skip
        return [self._event(0, {"role": "assistant", "content": ""})]

    def text(self, reasoning: str | None, delta: str) -> list[str]:
        first = [self._event(0, {"reasoning_content": reasoning})] if reasoning else []
        return [*first, self._event(0, {"content": delta})]

    def closing(self, done: Completed, reasoning: str | None, rest: str) -> list[str]:
        out = self._end(0, done.replies[0], reasoning, rest)
        for k, reply in enumerate(done.replies[1:], 1):
            message = reply.message
            out.append(self._event(k, {"role": "assistant", "content": ""}))
            out += self._end(k, reply, message.get("reasoning_content"), message.get("content") or "")
        if self.include_usage:
            out.append(f"data: {json.dumps(self.base | {'choices': [], 'usage': usage(done)})}\n\n")
        return [*out, "data: [DONE]\n\n"]

    def _end(self, k: int, reply: Reply, reasoning: str | None, rest: str) -> list[str]:
        out = [self._event(k, {"reasoning_content": reasoning})] if reasoning else []
        if rest:
            out.append(self._event(k, {"content": rest}))
        for i, call in enumerate(reply.message.get("tool_calls") or ()):
            out.append(self._event(k, {"tool_calls": [{"index": i, **call}]}))
        return [*out, self._event(k, {}, reply.finish_reason)]

    def failed(self, error: ApiError) -> list[str]:
        return [f"data: {json.dumps(error_body(error))}\n\n"]


class OpenAIChat:
    """The Chat Completions dialect (``/v1/chat/completions``)."""

    paths: tuple[str, ...] = ("/v1/chat/completions",)
    counted: bool = True

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error_body(error)

    async def serve(self, call: Incoming) -> Outgoing:
        asked = read_request(call.body)
        if asked.stream:
            return await call.stream(call.session, asked, Chunks(asked.include_usage))
        return response(await call.answer(call.session, asked))
