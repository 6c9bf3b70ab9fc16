"""The gateway over HTTP: each API of ``dialects.DIALECTS`` (OpenAI Chat Completions, OpenAI
Responses, Anthropic Messages and its token count) at ``/v1/...`` and at ``/s/{session}/v1/...``,
plus ``/v1/models`` and ``/metrics``; one route per dialect and path, all alike.

A session is named by the URL or by the API key (``Authorization: Bearer KEY`` or ``x-api-key``), so
an agent needs only ``base_url`` and ``api_key``; a gateway with keys (``api_keys``, or a harness's,
whose every session has a secret key) answers a missing or wrong key with a 401 (``Gateway.authorize``).
FastAPI routes, uvicorn serves: the standard ASGI pair, both already in the field's stacks (vLLM,
SGLang). The server never dies from a request: every failure is answered in the caller's API's
error schema. A client that goes away before its reply aborts the call's generation.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from turnrl.gateway.call import ApiError, ChatRequest, Completed, Dialect, Incoming
from turnrl.gateway.dialects import dialects
from turnrl.gateway.openai_chat import error_body
from turnrl.gateway.rewards import RewardDesk
from turnrl.gateway.server import Gateway
from turnrl.gateway.streaming import Events, LiveResponse, ReplyStream, live_events
from turnrl.support.errors import describe

MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_SESSION = "default"
CLIENT_CLOSED = 499  # nginx's status for a request its client abandoned (nobody reads it)

ErrorBody = Callable[[ApiError], dict[str, Any]]


def make_app(
    gateway: Gateway, rewards: RewardDesk | None = None, metrics: Sequence[Callable[[], list[str]]] = ()
) -> FastAPI:
    """The FastAPI application serving ``gateway``: every dialect of ``dialects.DIALECTS`` at its
    paths, at the root and under ``/s/{session}``, plus ``/v1/models`` and ``/metrics`` (with the
    lines of each of ``metrics``); with ``rewards`` (a learning gateway), ``POST /v1/rewards``."""
    app = FastAPI(title="turnrl gateway", docs_url=None, redoc_url=None, openapi_url=None)

    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": gateway.model, "object": "model", "owned_by": "turnrl"}]}

    served = dialects(gateway)  # once: a dialect's state (Responses' memory) is the same under every prefix
    for prefix in ("", "/s/{session}"):
        app.get(f"{prefix}/v1/models")(models)
        for dialect in served:
            for path in dialect.paths:
                app.post(f"{prefix}{path}")(_endpoint(gateway, dialect))
    extra = [*metrics, rewards.metrics] if rewards is not None else list(metrics)
    app.get("/metrics")(
        lambda: PlainTextResponse(gateway.metrics() + "".join(f"{line}\n" for m in extra for line in m()))
    )
    if rewards is not None:
        app.post("/v1/rewards")(_rewards_endpoint(gateway, rewards))
    return app


def _rewards_endpoint(gateway: Gateway, rewards: RewardDesk) -> Callable[..., Awaitable[Response]]:
    """``POST /v1/rewards``: one session's reward (errors in the OpenAI schema)."""

    async def endpoint(request: Request) -> Response:
        async def run() -> Response:
            return JSONResponse(rewards.post(await _body(request), _key(request)))

        return await _guarded(gateway, run, error_body, count=False)

    return endpoint


def _endpoint(gateway: Gateway, dialect: Dialect) -> Callable[..., Awaitable[Response]]:
    """The route of ``dialect``: the call authorized, its body read, served, answered as JSON or as a
    stream of events; any failure in the dialect's error schema."""

    async def endpoint(request: Request, session: str | None = None) -> Response:
        async def run() -> Response:
            key = _key(request)
            name = gateway.authorize(session, key, DEFAULT_SESSION)
            body = await _body(request)

            async def answer(name: str, asked: ChatRequest) -> Completed:
                return await _answer(gateway, request, name, asked)

            async def stream(name: str, asked: ChatRequest, events: Events) -> StreamingResponse:
                return await _streamed(gateway, name, asked, events)

            named = session is not None or key is not None
            out = await dialect.serve(Incoming(body, name, named, answer, stream))
            return JSONResponse(out) if isinstance(out, dict) else out

        return await _guarded(gateway, run, dialect.error_body, count=dialect.counted)

    return endpoint


async def _guarded(
    gateway: Gateway, run: Callable[[], Awaitable[Response]], error_body: ErrorBody, count: bool = True
) -> Response:
    """``run``'s response, or its failure in the API's error schema (a bug answers 500)."""
    try:
        return await run()
    except ApiError as exc:
        gateway.counts["errors"] += count
        return JSONResponse(error_body(exc), status_code=exc.status)
    except RecursionError:  # a body nested deeper than a reader follows
        gateway.counts["errors"] += count
        error = ApiError(400, "the request body is nested too deeply")
        return JSONResponse(error_body(error), status_code=400)
    except Exception as exc:  # the server goes on
        gateway.counts["errors"] += count
        error = ApiError(500, f"internal error: {describe(exc)}", "server_error")
        return JSONResponse(error_body(error), status_code=500)


async def _answer(gateway: Gateway, request: Request, name: str, asked: ChatRequest) -> Completed:
    """The gateway's answer, aborted (its generation cancelled) if the client disconnects first:
    with the body read, the next ASGI message a request receives is its disconnect."""
    task = asyncio.ensure_future(gateway.answer(name, asked))
    gone: asyncio.Future[Any] = asyncio.ensure_future(request.receive())
    try:
        while not task.done():
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone.done() and gone.result().get("type") == "http.disconnect":
                break
            if gone.done():  # not a disconnect (nothing else is sent): listen again
                gone = asyncio.ensure_future(request.receive())
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ApiError(CLIENT_CLOSED, "the client closed the connection; the call was aborted")


async def _streamed(gateway: Gateway, name: str, asked: ChatRequest, events: Events) -> StreamingResponse:
    """A streamed call's response, once the call is planned and generating (a call refused before
    that raises its ``ApiError``, answered with its status like any other)."""
    live = ReplyStream()
    task = asyncio.ensure_future(gateway.answer(name, asked, live))
    started = asyncio.ensure_future(live.started.wait())
    try:
        await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        started.cancel()
    if not live.started.is_set():
        task.result()  # its error
        raise ApiError(500, "internal error: the call ended before it began", "server_error")
    return LiveResponse(live_events(task, live, events, gateway.counts), task)


async def _body(request: Request) -> Any:
    """The request's JSON, read as it arrives: past MAX_BODY_BYTES it stops with a 413 (a chunked
    body has no length to check first)."""
    size = int(request.headers.get("content-length") or 0)
    if size > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is {size} bytes; the limit is {MAX_BODY_BYTES}")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


def _key(request: Request) -> str | None:
    """The API key of a request (``Authorization: Bearer KEY`` or ``x-api-key``), which names its session."""
    auth = request.headers.get("authorization") or ""
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
    return key or None
