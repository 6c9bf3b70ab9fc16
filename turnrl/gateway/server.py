"""The gateway's core: sessions over one engine. Each call is planned on its session's branches,
generated, recorded and answered (``session``, ``store``); ``routes`` serves it over HTTP.

The calls of one session run one at a time (a session is one agent's conversation); sessions run
concurrently on the engine. A call cancelled before its reply (the client went away) is aborted on
the engine and leaves its session as it was. A weight update (``update_weights``) waits for the
calls generating to finish under the old weights and holds new ones until it is done.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from turnrl.chat.encoder import ChatEncoder, NoVisionError
from turnrl.gateway.call import ApiError, Begun, ChatRequest, Completed
from turnrl.gateway.config import GatewayConfig
from turnrl.gateway.messages import BadMessage, check_call_ids
from turnrl.gateway.session import Plan, Reason, Reply, Session
from turnrl.gateway.store import CallLog, call_record
from turnrl.gateway.streaming import ReplyStream
from turnrl.record.seeds import request_seed
from turnrl.support.errors import describe
from turnrl.tools.parser_base import ToolParser
from turnrl.types import (
    CURRENT_TURN,
    TOKEN_SINK,
    Engine,
    Generation,
    Sample,
    SamplingParams,
    TurnContext,
    weight_version,
)


class Gateway:
    """Sessions over one engine: plan each call, generate, record, answer."""

    def __init__(
        self,
        engine: Engine,
        encoder: ChatEncoder,
        parser: ToolParser | None,
        config: GatewayConfig,
        log: CallLog | None = None,
        sealed: bool = False,
    ) -> None:
        """``sealed`` (a harness's gateway): only sessions opened with a key are served, each to its
        own key."""
        self.engine, self.encoder, self.parser, self.config, self.log = engine, encoder, parser, config, log
        self.model = config.served_name or config.model
        self.sessions: dict[str, Session] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.counts: Counter[str] = Counter()  # calls, errors, aborted, tokens, branches by reason
        self.seconds = 0.0  # time spent answering calls
        self._open = asyncio.Event()  # cleared while weights are updated: new generations wait
        self._open.set()
        self._generating = 0  # generations in flight
        self._idle = asyncio.Condition()
        self.keys = frozenset(config.all_keys()) or None  # None: calls need no key
        self.sealed = sealed
        self._secrets: dict[str, str] = {}  # session -> the key its calls must carry
        self._owners: dict[str, str] = {}  # key -> its session (sealed), or session -> its key

    def open_session(
        self,
        name: str,
        key: str,
        engine: Engine | None = None,
        sampling: SamplingParams | None = None,
        seed_key: str | None = None,
    ) -> Session:
        """Open session ``name``, whose calls must carry ``key`` (a harness run's secret), served by
        its own ``engine`` and ``sampling`` (None: the gateway's), its calls' seeds drawn from
        ``seed_key`` (None: its name)."""
        self._secrets[name] = key
        self._owners[key] = name
        session = self.session(name)
        session.engine, session.sampling = engine, sampling
        session.seed_key = seed_key if seed_key is not None else name
        return session

    def close_session(self, name: str) -> Session | None:
        """Forget session ``name`` and its key; the session, if it was there."""
        key = self._secrets.pop(name, None)
        self._owners.pop(key or "", None)
        self._locks.pop(name, None)
        return self.sessions.pop(name, None)

    def busy(self, name: str) -> bool:
        """Whether a call of session ``name`` is being answered now."""
        lock = self._locks.get(name)
        return lock is not None and lock.locked()

    def authorize(self, session: str | None, key: str | None, default: str) -> str:
        """The session a call may write to, given the session its URL names and its API key, or a 401.

        A sealed gateway (a harness's) serves the sessions it opened, each to its own key only. With
        ``api_keys``, a call needs one of them, and a session belongs to the key that made it. Else
        the URL or the key names the session, as the client pleases."""
        if self.sealed:
            name = session if session is not None else self._owners.get(key or "")
            expected = self._secrets.get(name or "")
            if name is None or expected is None or key is None or not hmac.compare_digest(key, expected):
                raise self._refuse("a missing or wrong API key for this session")
            return name
        if self.keys is None:
            return session or key or default
        if key is None or not any(hmac.compare_digest(key, k) for k in self.keys):
            raise self._refuse("a missing or unknown API key")
        name = session or key
        if not hmac.compare_digest(self._secrets.setdefault(name, key), key):
            raise self._refuse(f"the session {name!r} belongs to another API key")
        return name

    def _refuse(self, why: str) -> ApiError:
        self.counts["unauthorized"] += 1
        return ApiError(401, f"unauthorized: {why}", "authentication_error", code="invalid_api_key")

    def session(self, name: str) -> Session:
        """The session ``name`` (made on its first call)."""
        if name not in self.sessions:
            self.sessions[name] = Session(name, self.encoder, self.parser)
        return self.sessions[name]

    def check_tools(self, tools: list[dict[str, Any]] | None) -> None:
        """Refuse tools the chat template cannot put into the prompt (400), unless ``tool_parser``
        says the agent's own prompt teaches the model a format: never drop them unsaid."""
        if not tools or self.encoder.renders_tools:
            return
        if self.config.tool_parser is None:
            self.counts["dropped:unrendered"] += len(tools)
            raise ApiError(
                400,
                f"{self.model}'s chat template renders no tools, so this call's {len(tools)} tools would "
                "not reach the model; set the gateway's tool_parser (hermes, ...) if the agent's own "
                "prompt teaches the model that format, or serve a model whose template renders tools",
                param="tools",
            )
        self.counts["unrendered:passed"] += len(tools)

    def check_model(self, model: str) -> None:
        """Refuse a model this gateway does not serve (404)."""
        if model and model != self.model and not self.config.any_model:
            served = f"this gateway serves {self.model!r}"
            message = f"the model {model!r} does not exist; {served} (any_model: true answers any name)"
            raise ApiError(404, message, code="model_not_found", param="model")

    async def answer(self, name: str, request: ChatRequest, live: ReplyStream | None = None) -> Completed:
        """Answer one call of session ``name``: ``request.n`` replies to its messages (the first on
        the branch the call extends, each other one a branch of its own that says ``sample``).
        ``live`` (a streamed call): the first reply's tokens go there as they are sampled."""
        self.check_model(request.model)
        self.check_tools(request.tools)
        for kind in request.dropped_tools:
            self.counts[f"dropped:{kind}"] += 1
        async with self._locks[name]:
            t0 = time.perf_counter()
            session = self.session(name)
            self._check_budget(session)
            plan = self._plan(session, request)
            prompt = plan.prompt
            cached = 0 if plan.new and plan.branch.fork_at is None else len(plan.branch.sequence)
            sampling = self._sampling(session, plan, request, len(prompt))
            images = [*plan.branch.episode.record.images, *plan.added.images]
            record = plan.branch.episode.record
            sample = Sample(name, [])
            turn = TurnContext(sample, plan.branch.index, [*record.messages, *plan.added.messages], images)
            CURRENT_TURN.set(turn)  # what a scripted policy (or a judge) reads of the conversation
            if live is not None:
                conv = plan.branch.conv
                template = conv.template
                begun = Begun(self.model, len(prompt), cached)
                live.begin(
                    template.decode, template.decodes_piecewise, conv.streamed_text, session.parse, begun
                )
            g0 = time.perf_counter()
            gens = await self._generate(name, plan, prompt, sampling, images, request.n, live)
            seconds = time.perf_counter() - g0
            replies = [self._commit(session, plan, gens[0], seconds)]
            for gen in gens[1:]:
                other = session.plan(request.messages, request.tools)  # the same request: a fork before it
                other.branch.reason = Reason.SAMPLE
                replies.append(self._commit(session, other, gen, seconds))
            self._count(plan, len(prompt), sum(len(g.token_ids) for g in gens), time.perf_counter() - t0)
            self.counts["branch:sample"] += len(gens) - 1
        decode = self.encoder.template.decode
        texts = [[decode([t]) for t in g.token_ids] if request.logprobs else [] for g in gens]
        logprobs = [g.logprobs for g in gens]
        return Completed(replies, self.model, len(prompt), texts, logprobs, request.logprobs, cached)

    async def _generate(
        self,
        name: str,
        plan: Plan,
        prompt: list[int],
        sampling: SamplingParams,
        images: list[Any],
        n: int,
        live: ReplyStream | None = None,
    ) -> list[Generation]:
        """``n`` generations of ``prompt`` (seeds apart), concurrently on the engine; the first one's
        tokens go to ``live`` as they are sampled."""
        where = f"{name}/{plan.branch.index}"
        session = self.sessions[name]

        def seeded(k: int) -> SamplingParams:
            if k == 0 or sampling.seed is None:
                return sampling
            return sampling.for_request(sampling.max_tokens, self._seed(session, plan, k))

        engine = session.engine or self.engine
        await self._open.wait()
        self._generating += 1

        async def one(k: int) -> Generation:  # its own task (gather's): the sink is the first one's only
            TOKEN_SINK.set(live.push if live is not None and k == 0 else None)
            return await engine.generate(prompt, seeded(k), images, session=where)

        try:
            return list(await asyncio.gather(*(one(k) for k in range(n))))
        except asyncio.CancelledError:
            self.counts["aborted"] += 1
            raise
        except Exception as exc:
            raise ApiError(503, f"the engine failed: {describe(exc)}", "server_error") from None
        finally:
            self._generating -= 1
            async with self._idle:
                self._idle.notify_all()

    async def update_weights(self, update: Callable[[], Awaitable[None]]) -> None:
        """Run ``update`` (a weight update of the engine) with no generation in flight: new calls
        wait until it is done; calls already generating finish under the old weights first. So no
        reply mixes weight versions, and each token's version is the one it was sampled under."""
        self._open.clear()
        try:
            async with self._idle:
                await self._idle.wait_for(lambda: self._generating == 0)
            await update()
        finally:
            self._open.set()

    def _commit(self, session: Session, plan: Plan, gen: Generation, seconds: float) -> Reply:
        versions = list(gen.versions or [weight_version(session.engine or self.engine)] * len(gen.token_ids))
        reply = session.commit(plan, gen, seconds, versions)
        if self.log is not None:
            self.log.write(call_record(session.name, plan, gen, reply, versions))
        return reply

    def _check_budget(self, session: Session) -> None:
        """Refuse a call past the session's call budget (``max_session_calls``)."""
        limit = self.config.max_session_calls
        if limit is not None and session.calls >= limit:
            session.over_budget = True
            message = f"this session made {session.calls} calls; the limit is {limit} (max_session_calls)"
            raise ApiError(400, message, code="session_call_limit")  # 400: clients do not retry it

    def _plan(self, session: Session, request: ChatRequest) -> Plan:
        try:
            plan = session.plan(request.messages, request.tools)
            check_call_ids(request.messages, 0 if plan.new else len(plan.branch.seen))
            return plan
        except BadMessage as exc:
            raise ApiError(400, str(exc), param="messages") from None
        except NoVisionError as exc:
            raise ApiError(400, f"{exc} ({self.model} reads text only)", param="messages") from None
        except Exception as exc:  # the chat template raised on these messages
            message = f"the chat template cannot render these messages: {describe(exc)}"
            raise ApiError(400, message, param="messages") from None

    def _sampling(
        self, session: Session, plan: Plan, request: ChatRequest, prompt_tokens: int
    ) -> SamplingParams:
        """The config's sampling, with max_tokens lowered to the client's and to what is left of the
        branch's budget (``max_session_tokens``), and the client's single-token stop strings."""
        forced = session.sampling or self.config.sampling
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
        return forced.for_request(max_tokens, self._seed(session, plan), tuple(stops))

    def _seed(self, session: Session, plan: Plan, reply: int = 0) -> int | None:
        """The seed of a call's ``reply``-th generation: from the session's own sampling's seed (a
        harness run: the run's; None: unseeded), else the gateway's, with the session's seed key,
        the branch and the call."""
        base = session.sampling.seed if session.sampling is not None else self.config.seed
        key = session.seed_key if reply == 0 else f"{session.seed_key}#{reply}"
        return request_seed(base, Sample(key, []), plan.branch.index, plan.branch.calls)

    def prompt_length(self, request: ChatRequest) -> int:
        """The tokens ``request``'s messages take as a fresh prompt (a dialect's token count)."""
        session = Session("count", self.encoder, self.parser)
        return len(self._plan(session, request).prompt)

    def _count(self, plan: Plan, prompt_tokens: int, completion_tokens: int, seconds: float) -> None:
        self.counts["calls"] += 1
        self.counts["prompt_tokens"] += prompt_tokens
        self.counts["completion_tokens"] += completion_tokens
        if plan.new:
            self.counts[f"branch:{plan.branch.reason}"] += 1
        self.seconds += seconds

    def metrics(self) -> str:
        """Prometheus text: sessions, branches by reason, calls, tokens, errors, aborted calls, time."""
        lines = [
            f"turnrl_gateway_sessions {len(self.sessions)}",
            f"turnrl_gateway_calls_total {self.counts['calls']}",
            f"turnrl_gateway_errors_total {self.counts['errors']}",
            f"turnrl_gateway_aborted_total {self.counts['aborted']}",
            f"turnrl_gateway_stream_diverged_total {self.counts['stream_diverged']}",
            f"turnrl_gateway_unauthorized_total {self.counts['unauthorized']}",
            f'turnrl_gateway_tokens_total{{kind="prompt"}} {self.counts["prompt_tokens"]}',
            f'turnrl_gateway_tokens_total{{kind="completion"}} {self.counts["completion_tokens"]}',
            f"turnrl_gateway_call_seconds_sum {self.seconds:.6f}",
            f"turnrl_gateway_call_seconds_count {self.counts['calls']}",
        ]
        for name, n in sorted(self.counts.items()):
            if name.startswith("branch:") and n:
                lines.append(f'turnrl_gateway_branches_total{{reason="{name[7:]}"}} {n}')
            if name.startswith("dropped:"):
                lines.append(f'turnrl_gateway_dropped_tools_total{{type="{name[8:]}"}} {n}')
        passed = self.counts["unrendered:passed"]
        lines.append(f"turnrl_gateway_unrendered_tools_total {passed}")  # let through by tool_parser
        return "\n".join(lines) + "\n"
