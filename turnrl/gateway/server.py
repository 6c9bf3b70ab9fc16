"""The gateway: an OpenAI-compatible HTTP server in front of any turnrl engine that records every
session token-exactly (``session``, ``store``).

A session is named by the URL (``/s/{session}/v1/...``) or by the API key (``Authorization:
Bearer KEY``), so an agent needs only ``base_url`` and ``api_key``. The calls of one session run
one at a time (a session is one agent's conversation); sessions run concurrently on the engine.
FastAPI routes and validates, uvicorn serves: the standard ASGI pair, both already in the field's
stacks (vLLM, SGLang). The server never dies from a request: every failure is answered in the API's
error schema.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections import Counter, defaultdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from turnrl.chat.encoder import ChatEncoder, NoVisionError
from turnrl.gateway.config import GatewayConfig
from turnrl.gateway.messages import BadMessage
from turnrl.gateway.openai_chat import ApiError, ChatRequest, Completed, read_request
from turnrl.gateway.session import Plan, Session
from turnrl.gateway.store import CallLog, call_record
from turnrl.rollout.generation import request_seed
from turnrl.tools.parser_base import ToolParser
from turnrl.types import CURRENT_TURN, Engine, Sample, SamplingParams, TurnContext, weight_version

MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_SESSION = "default"


class Gateway:
    """Sessions over one engine: plan each call, generate, record, answer."""

    def __init__(
        self,
        engine: Engine,
        encoder: ChatEncoder,
        parser: ToolParser | None,
        config: GatewayConfig,
        log: CallLog | None = None,
    ) -> None:
        self.engine, self.encoder, self.parser, self.config, self.log = engine, encoder, parser, config, log
        self.model = config.served_name or config.model
        self.sessions: dict[str, Session] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.counts: Counter[str] = Counter()  # calls, errors, tokens, branches by reason
        self.seconds = 0.0  # time spent answering calls

    def session(self, name: str) -> Session:
        """The session ``name`` (made on its first call)."""
        if name not in self.sessions:
            self.sessions[name] = Session(name, self.encoder, self.parser)
        return self.sessions[name]

    async def chat(self, name: str, body: Any) -> tuple[Completed, ChatRequest]:
        """Answer one chat completions request of session ``name``."""
        request = read_request(body)
        if request.model and request.model != self.model:
            served = f"this gateway serves {self.model!r}"
            message = f"the model {request.model!r} does not exist; {served}"
            raise ApiError(404, message, code="model_not_found", param="model")
        async with self._locks[name]:
            t0 = time.perf_counter()
            session = self.session(name)
            plan = self._plan(session, request)
            prompt = plan.prompt
            sampling = self._sampling(session, plan, request, len(prompt))
            images = (
                plan.added.images if plan.new else [*plan.branch.episode.record.images, *plan.added.images]
            )
            record = plan.branch.episode.record
            turn = TurnContext(
                Sample(name, []), plan.branch.index, [*record.messages, *plan.added.messages], images
            )
            CURRENT_TURN.set(turn)  # what a scripted policy (or a judge) reads of the conversation
            g0 = time.perf_counter()
            try:
                gen = await self.engine.generate(
                    prompt, sampling, images, session=f"{name}/{plan.branch.index}"
                )
            except Exception as exc:
                raise ApiError(
                    503, f"the engine failed: {type(exc).__name__}: {exc}", "server_error"
                ) from None
            seconds = time.perf_counter() - g0
            versions = list(gen.versions or [weight_version(self.engine)] * len(gen.token_ids))
            reply = session.commit(plan, gen, seconds, versions)
            if self.log is not None:
                self.log.write(call_record(name, plan, gen, reply, versions))
            self._count(plan, len(prompt), len(gen.token_ids), time.perf_counter() - t0)
        texts = [self.encoder.template.decode([t]) for t in gen.token_ids] if request.logprobs else []
        return Completed(reply, self.model, len(prompt), texts, gen.logprobs, request.logprobs), request

    def _plan(self, session: Session, request: ChatRequest) -> Plan:
        try:
            return session.plan(request.messages, request.tools)
        except BadMessage as exc:
            raise ApiError(400, str(exc), param="messages") from None
        except NoVisionError as exc:
            raise ApiError(400, f"{exc} ({self.model} reads text only)", param="messages") from None
        except Exception as exc:  # the chat template raised on these messages
            message = f"the chat template cannot render these messages: {type(exc).__name__}: {exc}"
            raise ApiError(400, message, param="messages") from None

    def _sampling(
        self, session: Session, plan: Plan, request: ChatRequest, prompt_tokens: int
    ) -> SamplingParams:
        """The config's sampling, with max_tokens lowered to the client's and to what is left of the
        branch's budget (``max_session_tokens``), and the client's single-token stop strings."""
        forced = self.config.sampling
        left = self.config.max_session_tokens - prompt_tokens
        if left <= 0:
            limit = self.config.max_session_tokens
            message = f"this branch holds {prompt_tokens} tokens; the limit is {limit} (max_session_tokens)"
            raise ApiError(400, message, code="context_length_exceeded")
        stops = list(forced.stop_token_ids)
        for text in request.stop:
            ids = self.encoder.template.encode(text)
            if len(ids) != 1:
                raise ApiError(
                    400, f"stop {text!r} is {len(ids)} tokens; stops of one token are supported", param="stop"
                )
            stops.append(ids[0])
        max_tokens = min(forced.max_tokens, request.max_tokens or forced.max_tokens, left)
        seed = request_seed(self.config.seed, Sample(session.name, []), plan.branch.index, plan.branch.calls)
        return dataclasses.replace(forced, max_tokens=max_tokens, seed=seed, stop_token_ids=tuple(stops))

    def _count(self, plan: Plan, prompt_tokens: int, completion_tokens: int, seconds: float) -> None:
        self.counts["calls"] += 1
        self.counts["prompt_tokens"] += prompt_tokens
        self.counts["completion_tokens"] += completion_tokens
        if plan.new:
            self.counts[f"branch:{plan.branch.reason}"] += 1
        self.seconds += seconds

    def metrics(self) -> str:
        """Prometheus text: sessions, branches by reason, calls, tokens, errors, time answering."""
        lines = [
            f"turnrl_gateway_sessions {len(self.sessions)}",
            f"turnrl_gateway_calls_total {self.counts['calls']}",
            f"turnrl_gateway_errors_total {self.counts['errors']}",
            f'turnrl_gateway_tokens_total{{kind="prompt"}} {self.counts["prompt_tokens"]}',
            f'turnrl_gateway_tokens_total{{kind="completion"}} {self.counts["completion_tokens"]}',
            f"turnrl_gateway_call_seconds_sum {self.seconds:.6f}",
            f"turnrl_gateway_call_seconds_count {self.counts['calls']}",
        ]
        for name, n in sorted(self.counts.items()):
            if name.startswith("branch:"):
                lines.append(f'turnrl_gateway_branches_total{{reason="{name[7:]}"}} {n}')
        return "\n".join(lines) + "\n"


def make_app(gateway: Gateway) -> FastAPI:
    """The FastAPI application serving ``gateway``."""
    app = FastAPI(title="turnrl gateway", docs_url=None, redoc_url=None, openapi_url=None)

    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": gateway.model, "object": "model", "owned_by": "turnrl"}]}

    async def chat(request: Request, session: str | None = None) -> Any:
        try:
            body = await _body(request)
            name = session or _key(request) or DEFAULT_SESSION
            done, asked = await gateway.chat(name, body)
        except ApiError as exc:
            gateway.counts["errors"] += 1
            return JSONResponse(exc.body(), status_code=exc.status)
        except Exception as exc:  # a bug answers 500; the server goes on
            gateway.counts["errors"] += 1
            error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
            return JSONResponse(error.body(), status_code=500)
        if asked.stream:
            return StreamingResponse(done.chunks(asked.include_usage), media_type="text/event-stream")
        return JSONResponse(done.response())

    app.get("/v1/models")(models)
    app.get("/s/{session}/v1/models")(models)
    app.post("/v1/chat/completions")(chat)
    app.post("/s/{session}/v1/chat/completions")(chat)
    app.get("/metrics")(lambda: PlainTextResponse(gateway.metrics()))
    return app


async def _body(request: Request) -> Any:
    size = int(request.headers.get("content-length") or 0)
    if size > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is {size} bytes; the limit is {MAX_BODY_BYTES}")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


def _key(request: Request) -> str | None:
    """The API key of a request (``Authorization: Bearer KEY`` or ``x-api-key``), which names its session."""
    auth = request.headers.get("authorization") or ""
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
    return key or None
