"""OpenAI Chat Completions: a request read into a ``ChatRequest``, an answer written as the API's
response or its stream of chunks, and errors in the API's own schema."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from turnrl.gateway.call import (
    ApiError,
    ChatRequest,
    Completed,
    Incoming,
    Outgoing,
    checked_body,
    positive,
    stop_list,
)

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


def chunks(done: Completed, include_usage: bool) -> Iterator[str]:
    """The answer as server-sent events: per choice the role, the reasoning, the content, each call
    and the finish reason; the usage when asked; then ``[DONE]``."""
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": done.model}  # fmt: skip

    def event(k: int, delta: dict[str, Any], finish: str | None = None) -> str:
        choice = {"index": k, "delta": delta, "finish_reason": finish, "logprobs": None}
        return f"data: {json.dumps(base | {'choices': [choice]})}\n\n"

    for k, reply in enumerate(done.replies):
        message = reply.message
        yield event(k, {"role": "assistant", "content": ""})
        if message.get("reasoning_content"):
            yield event(k, {"reasoning_content": message["reasoning_content"]})
        if message.get("content"):
            yield event(k, {"content": message["content"]})
        for i, call in enumerate(message.get("tool_calls") or ()):
            yield event(k, {"tool_calls": [{"index": i, **call}]})
        yield event(k, {}, reply.finish_reason)
    if include_usage:
        yield f"data: {json.dumps(base | {'choices': [], 'usage': usage(done)})}\n\n"
    yield "data: [DONE]\n\n"


class OpenAIChat:
    """The Chat Completions dialect (``/v1/chat/completions``)."""

    paths: tuple[str, ...] = ("/v1/chat/completions",)
    counted: bool = True

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error_body(error)

    async def serve(self, call: Incoming) -> Outgoing:
        asked = read_request(call.body)
        done = await call.answer(call.session, asked)
        return chunks(done, asked.include_usage) if asked.stream else response(done)
