"""OpenAI Responses (what Codex CLI and the OpenAI Agents SDK speak): ``input`` items read into
OpenAI chat messages, an answer written as a response with output items or its event stream.

``instructions`` becomes a system message; ``message`` items keep their role; ``function_call``
items join the assistant message before them (or make one); ``function_call_output`` items become
tool messages; a ``reasoning`` item becomes the next assistant message's ``reasoning_content``. The
reply goes back as a ``reasoning`` item, a ``message`` item and ``function_call`` items.
``previous_response_id`` continues a response this gateway gave (its messages and reply first):
the dialect (``OpenAIResponses``) keeps the last ``KEEP_RESPONSES`` answers' conversations.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
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
)
from turnrl.gateway.openai_chat import error_body

if TYPE_CHECKING:
    from turnrl.gateway.server import Gateway

KEEP_RESPONSES = 10_000  # answers a later request may continue (previous_response_id)
KNOWN = {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
    "stream", "stream_options", "reasoning", "store", "include", "temperature", "top_p", "metadata",
    "previous_response_id", "truncation", "user", "text", "prompt_cache_key", "service_tier",
    "safety_identifier", "top_logprobs", "client_metadata",
}  # fmt: skip
"""Fields a request may carry. Tools other than functions (hosted ones: web search, file search, a
namespace of another agent's tools) are left out of what the model sees: a self-hosted model cannot
call them. ``/metrics`` counts them by type."""


def read_request(body: Any, history: list[dict[str, Any]] | None = None) -> ChatRequest:
    """Validate a Responses request (``history``: the messages of its ``previous_response_id``)."""
    body = checked_body(body, KNOWN, "input")
    items = body["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    messages = list(history or [])
    if body.get("instructions") and not history:
        messages.append({"role": "system", "content": str(body["instructions"])})
    messages += chat_messages(items)
    listed = body.get("tools") or []
    if not isinstance(listed, list):
        raise ApiError(400, "'tools' must be a list", param="tools")
    tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(listed) if _is_function(t)]
    return ChatRequest(
        model=str(body.get("model", "")),
        messages=messages,
        tools=tools or None,
        max_tokens=positive(body.get("max_output_tokens"), "max_output_tokens"),
        stream=bool(body.get("stream")),
        dropped_tools=[str(t.get("type")) for t in listed if isinstance(t, Mapping) and not _is_function(t)],
    )


def _is_function(tool: Any) -> bool:
    return isinstance(tool, Mapping) and tool.get("type") == "function"


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool.get("name"), str):
        raise ApiError(400, f"{where}: a function tool needs a name", param="tools")
    function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _content(content: Any, where: str) -> Any:
    """A message item's content as OpenAI chat content (text, or parts with images)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be text or a list of parts", param="input")
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal", ""))})
        elif kind == "input_image" and part.get("image_url"):
            parts.append({"type": "image_url", "image_url": {"url": str(part["image_url"])}})
        else:
            raise ApiError(400, f"{where}.content[{i}] has type {kind!r}, not read here", param="input")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    """``input`` items as OpenAI chat messages."""
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []
    calls_open = False  # the last message is an assistant turn that function calls may join
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, Mapping) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            message: dict[str, Any] = {"role": item["role"], "content": _content(item.get("content"), where)}
            if item["role"] == "assistant" and reasoning:
                message["reasoning_content"], reasoning = "".join(reasoning), []
            out.append(message)
            calls_open = item["role"] == "assistant"
        elif kind == "reasoning":
            texts = [p.get("text", "") for p in item.get("content") or () if isinstance(p, Mapping)]
            reasoning += [str(t) for t in texts]
        elif kind == "function_call":
            if not calls_open:
                out.append({"role": "assistant", "content": ""})
                if reasoning:
                    out[-1]["reasoning_content"], reasoning = "".join(reasoning), []
                calls_open = True
            function = {"name": str(item.get("name")), "arguments": str(item.get("arguments") or "{}")}
            call = {"id": str(item.get("call_id") or ""), "type": "function", "function": function}
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _content(output, where)
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""), "content": content})
            calls_open = False
        else:
            role = item.get("role") if isinstance(item, Mapping) else None
            raise ApiError(400, f"{where} has type {kind!r} (role {role!r}); not read here", param="input")
    return out


def output_items(done: Completed, ids: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The reply as output items: reasoning, the message, then each function call (``ids``: the
    reasoning's and the message's item ids, when a stream already named them)."""
    message = done.reply.message
    ids = ids or _item_ids()
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        text = message["reasoning_content"]
        items.append({"type": "reasoning", "id": ids["reasoning"], "summary": [],
                      "content": [{"type": "reasoning_text", "text": text}]})  # fmt: skip
    if message.get("content"):
        part = {"type": "output_text", "text": message["content"], "annotations": [], "logprobs": []}
        items.append({"type": "message", "id": ids["message"], "role": "assistant",
                      "status": "completed", "content": [part]})  # fmt: skip
    for call in message.get("tool_calls") or ():
        function = call["function"]
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                      "name": function["name"], "arguments": function["arguments"],
                      "status": "completed"})  # fmt: skip
    return items


def _item_ids() -> dict[str, str]:
    return {"reasoning": f"rs_{uuid.uuid4().hex}", "message": f"msg_{uuid.uuid4().hex}"}


def _shell(response_id: str, model: str, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A response in progress: nothing output yet."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "in_progress",
        "incomplete_details": None,
        "output": [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [{"type": "function", **t["function"]} for t in tools or ()],
        "usage": None,
    }


def response(
    done: Completed,
    response_id: str,
    tools: list[dict[str, Any]] | None,
    ids: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The whole response."""
    cut = done.reply.finish_reason == "length"
    usage = {
        "input_tokens": done.prompt_tokens,
        "input_tokens_details": {"cached_tokens": done.cached_tokens},
        "output_tokens": done.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }
    return _shell(response_id, done.model, tools) | {
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": output_items(done, ids),
        "usage": usage,
    }


class ResponseEvents:
    """The response as its event stream, written as it comes (``streaming.Events``): created; per
    output item its addition, its text (as sampled) or arguments (delta and done) and its
    completion; then completed. ``finished`` is told the answer (the dialect remembers it)."""

    def __init__(
        self, response_id: str, tools: list[dict[str, Any]] | None, finished: Callable[[Completed], None]
    ) -> None:
        self.response_id, self.tools, self.finished = response_id, tools, finished
        self.ids = _item_ids()
        self.number = iter(range(1 << 30))
        self.output = 0  # the next item's index
        self.writing: dict[str, Any] | None = None  # the message item whose text is being sent

    def _event(self, kind: str, **data: Any) -> str:
        body = {"type": kind, "sequence_number": next(self.number), **data}
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def opening(self, begun: Begun) -> list[str]:
        shell = _shell(self.response_id, begun.model, self.tools)
        return [
            self._event("response.created", response=shell),
            self._event("response.in_progress", response=shell),
        ]

    def text(self, reasoning: str | None, delta: str) -> list[str]:
        out: list[str] = []
        if self.writing is None:
            if reasoning:
                out += self._item({"type": "reasoning", "id": self.ids["reasoning"], "summary": [],
                                   "content": [{"type": "reasoning_text", "text": reasoning}]})  # fmt: skip
            self.writing = {"type": "message", "id": self.ids["message"], "role": "assistant",
                            "status": "in_progress", "content": []}  # fmt: skip
            out.append(self._event("response.output_item.added", output_index=self.output, item=self.writing))
            out.append(
                self._event("response.content_part.added", **self._where(), content_index=0, part=_part(""))
            )
        return [
            *out,
            self._event(
                "response.output_text.delta", **self._where(), content_index=0, delta=delta, logprobs=[]
            ),
        ]

    def closing(self, done: Completed, reasoning: str | None, rest: str) -> list[str]:
        self.finished(done)
        whole = response(done, self.response_id, self.tools, self.ids)
        out: list[str] = []
        for item in whole["output"]:
            if self.writing is not None and item["type"] == "reasoning":
                continue  # sent with the first text
            if self.writing is not None and item["type"] == "message":
                out += self._finish_text(item, rest)
            else:
                out += self._item(item)
        return [*out, self._event(f"response.{whole['status']}", response=whole)]

    def failed(self, error: ApiError) -> list[str]:
        return [self._event("error", **error_body(error)["error"])]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.ids["message"], "output_index": self.output}

    def _finish_text(self, item: dict[str, Any], rest: str) -> list[str]:
        """The end of the message item whose text was streamed."""
        where, part = self._where(), item["content"][0]
        out = (
            [self._event("response.output_text.delta", **where, content_index=0, delta=rest, logprobs=[])]
            if rest
            else []
        )
        out.append(
            self._event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
        )
        out.append(self._event("response.content_part.done", **where, content_index=0, part=part))
        out.append(self._event("response.output_item.done", output_index=self.output, item=item))
        self.output += 1
        return out

    def _item(self, item: dict[str, Any]) -> list[str]:
        """A whole item: its addition, its text or arguments, its completion."""
        i = self.output
        out = [self._event("response.output_item.added", output_index=i, item=_opening(item))]
        where = {"item_id": item["id"], "output_index": i}
        if item["type"] == "message":
            part = item["content"][0]
            text = part["text"]
            out += [
                self._event(
                    "response.content_part.added", **where, content_index=0, part=part | {"text": ""}
                ),
                self._event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[]),
                self._event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ]
        elif item["type"] == "function_call":
            arguments = item["arguments"]
            out += [
                self._event("response.function_call_arguments.delta", **where, delta=arguments),
                self._event("response.function_call_arguments.done", **where, arguments=arguments),
            ]
        self.output += 1
        return [*out, self._event("response.output_item.done", output_index=i, item=item)]


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _opening(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] == "message":
        return item | {"status": "in_progress", "content": []}
    if item["type"] == "function_call":
        return item | {"status": "in_progress", "arguments": ""}
    return item


class OpenAIResponses:
    """The Responses dialect (``/v1/responses``), with its memory of earlier answers: a request that
    names one continues its conversation, in its session. Where sessions belong to keys (a harness's
    gateway, or one with ``api_keys``), another key's response is not found (404)."""

    paths: tuple[str, ...] = ("/v1/responses",)
    counted: bool = True

    def __init__(self, gateway: Gateway) -> None:
        self.private = gateway.sealed or gateway.keys is not None
        self.answers: OrderedDict[str, tuple[str, list[dict[str, Any]]]] = OrderedDict()

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error_body(error)

    async def serve(self, call: Incoming) -> Outgoing:
        name, history = call.session, None
        earlier = call.body.get("previous_response_id") if isinstance(call.body, dict) else None
        if earlier:
            owner, history = self.history(str(earlier))
            if owner != name and self.private:  # not this key's
                raise ApiError(404, f"previous response {earlier!r} not found", param="previous_response_id")
            name = name if call.named else owner
        asked = read_request(call.body, history)
        response_id = f"resp_{uuid.uuid4().hex}"

        def finished(done: Completed) -> None:
            self.remember(response_id, name, [*asked.messages, done.reply.message])

        if asked.stream:
            return await call.stream(name, asked, ResponseEvents(response_id, asked.tools, finished))
        done = await call.answer(name, asked)
        finished(done)
        return response(done, response_id, asked.tools)

    def remember(self, response_id: str, session: str, messages: list[dict[str, Any]]) -> None:
        """Keep an answer's conversation (request and reply) for ``previous_response_id``."""
        self.answers[response_id] = (session, messages)
        while len(self.answers) > KEEP_RESPONSES:
            self.answers.popitem(last=False)

    def history(self, response_id: str) -> tuple[str, list[dict[str, Any]]]:
        """The session and conversation of an earlier answer (404 when unknown)."""
        if response_id not in self.answers:
            message = f"previous_response_id {response_id!r} is not a response of this gateway"
            raise ApiError(404, message, param="previous_response_id")
        return self.answers[response_id]
