"""Anthropic Messages (what Claude Code and the ``anthropic`` SDK speak): a request read into OpenAI
chat messages, an answer written as a message or its event stream, errors in Anthropic's schema.

``system`` becomes a system message; ``tool_result`` blocks become tool messages (in order, before
the user's own text); an assistant's ``thinking``, ``text`` and ``tool_use`` blocks become one
assistant message with ``reasoning_content``, content and ``tool_calls``; image blocks become image
parts. The reply goes back as ``thinking``, ``text`` and ``tool_use`` blocks with ``stop_reason``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from turnrl.gateway.server import Gateway

KNOWN = {
    "model", "messages", "system", "max_tokens", "tools", "tool_choice", "stop_sequences", "stream",
    "temperature", "top_p", "top_k", "metadata", "thinking", "service_tier", "output_config",
    "context_management",
}  # fmt: skip
# Server tools (web search, code execution...) are left out of what the model sees: a self-hosted
# model cannot call them. ``/metrics`` counts them by type.
STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip


def error_body(error: ApiError) -> dict[str, Any]:
    """An error as the Anthropic API writes it."""
    kind = ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": str(error)}}


def read_request(body: Any) -> ChatRequest:
    """Validate a Messages request; ``ApiError`` (400) names the first problem."""
    body = checked_body(body, KNOWN, "messages")
    messages = body["messages"]
    if body.get("max_tokens") is None:
        raise ApiError(400, "max_tokens: field required", param="max_tokens")
    limit = positive(body["max_tokens"], "max_tokens")
    out = [{"role": "system", "content": _system(body.get("system"))}] if body.get("system") else []
    for i, message in enumerate(messages):
        out += chat_messages(message, f"messages.{i}")
    stop = stop_list(body.get("stop_sequences"), "stop_sequences")
    listed = body.get("tools") or []
    if not isinstance(listed, list):
        raise ApiError(400, "tools: must be a list", param="tools")
    client = [t for t in listed if not (isinstance(t, Mapping) and t.get("type") not in (None, "custom"))]
    return ChatRequest(
        model=str(body.get("model", "")),
        messages=out,
        tools=[_tool(t, f"tools.{i}") for i, t in enumerate(client)] or None,
        dropped_tools=[str(t["type"]) for t in listed if t not in client],
        max_tokens=limit,
        stop=[str(s) for s in stop],
        stream=bool(body.get("stream")),
    )


def _system(system: Any) -> str:
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return "\n\n".join(str(b.get("text", "")) for b in system if isinstance(b, Mapping))
    raise ApiError(400, "system: must be text or a list of text blocks", param="system")


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str):
        raise ApiError(400, f"{where}: a tool needs a name", param="tools")
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _image(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if isinstance(source, Mapping) and source.get("type") == "base64":
        url = f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    elif isinstance(source, Mapping) and source.get("type") == "url":
        url = str(source.get("url"))
    else:
        raise ApiError(400, f"{where}.source: an image needs a base64 or url source", param="messages")
    return {"type": "image_url", "image_url": {"url": url}}


def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    """Text and image blocks as OpenAI content parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    parts = []
    for i, block in enumerate(content or ()):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind == "image":
            parts.append(_image(block, f"{where}.{i}"))
        else:
            raise ApiError(400, f"{where}.{i}: block type {kind!r} is not read here", param="messages")
    return parts


def chat_messages(message: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI chat messages."""
    if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
        raise ApiError(400, f"{where}.role: must be 'user' or 'assistant'", param="messages")
    content = message.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        raise ApiError(400, f"{where}.content: must be text or a list of blocks", param="messages")
    if message["role"] == "assistant":
        return [_assistant(blocks, where)]
    out: list[dict[str, Any]] = []
    rest: list[Any] = []
    for i, block in enumerate(blocks):
        if isinstance(block, Mapping) and block.get("type") == "tool_result":
            parts = _parts(block.get("content"), f"{where}.content.{i}.content")
            text = "".join(p["text"] for p in parts if p["type"] == "text")
            result = parts if any(p["type"] != "text" for p in parts) else text
            call_id = str(block.get("tool_use_id") or "")
            out.append({"role": "tool", "tool_call_id": call_id, "content": result})
        else:
            rest.append(block)
    if rest or not out:
        out.append({"role": "user", "content": _parts(rest, f"{where}.content")})
    return out


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    text, thinking, calls = [], [], []
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "thinking":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            function = {"name": str(block.get("name")), "arguments": arguments}
            calls.append({"id": str(block.get("id") or ""), "type": "function", "function": function})
        else:
            message = f"{where}.content.{i}: block type {kind!r} is not read in an assistant message"
            raise ApiError(400, message, param="messages")
    out: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if thinking:
        out["reasoning_content"] = "".join(thinking)
    if calls:
        out["tool_calls"] = calls
    return out


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        function = call["function"]
        arguments = json.loads(function["arguments"])
        arguments = arguments if isinstance(arguments, dict) else {"input": arguments}
        blocks.append({"type": "tool_use", "id": call["id"], "name": function["name"], "input": arguments})
    return blocks


def _usage(done: Completed, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": done.prompt_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": done.cached_tokens}  # fmt: skip


def response(done: Completed) -> dict[str, Any]:
    """The whole message."""
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": done.model,
        "content": _blocks(done.reply.message),
        "stop_reason": STOP_REASONS.get(done.reply.finish_reason, "end_turn"),
        "stop_sequence": None,
        "usage": _usage(done, done.completion_tokens),
    }


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class MessageEvents:
    """The message as Anthropic's event stream, written as it comes (``streaming.Events``):
    ``message_start``; per block its start, its deltas (the text's as sampled) and its stop;
    ``message_delta`` with the stop reason and usage; ``message_stop``."""

    def __init__(self) -> None:
        self.index = 0  # the next block's
        self.writing = False  # a text block is open

    def opening(self, begun: Begun) -> list[str]:
        usage = {"input_tokens": begun.prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": begun.cached_tokens}  # fmt: skip
        start: dict[str, Any] = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                                 "model": begun.model, "content": [], "stop_reason": None,
                                 "stop_sequence": None, "usage": usage}  # fmt: skip
        return [_event("message_start", {"message": start})]

    def text(self, reasoning: str | None, delta: str) -> list[str]:
        out: list[str] = []
        if not self.writing:
            if reasoning:
                out += self._block({"type": "thinking", "thinking": reasoning, "signature": ""})
            out.append(self._start({"type": "text", "text": ""}))
            self.writing = True
        return [*out, self._delta({"type": "text_delta", "text": delta})]

    def closing(self, done: Completed, reasoning: str | None, rest: str) -> list[str]:
        out: list[str] = []
        if self.writing:
            out += [self._delta({"type": "text_delta", "text": rest})] if rest else []
            out.append(self._stop())
        else:
            out += (
                self._block({"type": "thinking", "thinking": reasoning, "signature": ""}) if reasoning else []
            )
            out += self._block({"type": "text", "text": rest}) if rest else []
        for block in _blocks(done.reply.message):
            out += self._block(block) if block["type"] == "tool_use" else []
        stop = {"stop_reason": STOP_REASONS.get(done.reply.finish_reason, "end_turn"), "stop_sequence": None}
        out.append(
            _event("message_delta", {"delta": stop, "usage": {"output_tokens": done.completion_tokens}})
        )
        return [*out, _event("message_stop", {})]

    def failed(self, error: ApiError) -> list[str]:
        return [_event("error", error_body(error))]

    def _block(self, block: dict[str, Any]) -> list[str]:
        """A whole block: its start, one delta, its stop."""
        if block["type"] == "thinking":
            first: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": block["thinking"]},
                      {"type": "signature_delta", "signature": ""}]  # fmt: skip
        elif block["type"] == "text":
            first = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": block["text"]}]
        else:
            first = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"])}]
        return [self._start(first), *(self._delta(d) for d in deltas), self._stop()]

    def _start(self, block: dict[str, Any]) -> str:
        return _event("content_block_start", {"index": self.index, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def _stop(self) -> str:
        self.index += 1
        return _event("content_block_stop", {"index": self.index - 1})


# an Anthropic client adds /v1 to its base URL itself: one given .../v1 asks for /v1/v1/...
class AnthropicMessages:
    """The Messages dialect (``/v1/messages``)."""

    paths: tuple[str, ...] = ("/v1/messages", "/v1/v1/messages")
    counted: bool = True

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error_body(error)

    async def serve(self, call: Incoming) -> Outgoing:
        asked = read_request(call.body)
        if asked.stream:
            return await call.stream(call.session, asked, MessageEvents())
        return response(await call.answer(call.session, asked))


class AnthropicCountTokens:
    """Messages' token count (``/v1/messages/count_tokens``): the tokens a request's messages take
    as a fresh prompt, nothing generated, nothing recorded."""

    paths: tuple[str, ...] = ("/v1/messages/count_tokens", "/v1/v1/messages/count_tokens")
    counted: bool = False

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error_body(error)

    async def serve(self, call: Incoming) -> Outgoing:
        body = call.body
        asked = read_request({"max_tokens": 1, **body} if isinstance(body, dict) else body)
        self.gateway.check_model(asked.model)
        return {"input_tokens": self.gateway.prompt_length(asked)}
