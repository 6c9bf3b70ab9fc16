"""Spread requests over several engines: least in flight, sticky sessions, fail-over.

- A request without a session, or the first turn of one, goes to the healthy engine with
  the fewest requests in flight (ties: the one that has served the fewest).
- Later turns of a session stick to the same engine, so its prefix cache is reused, until
  ``max_sticky_turns`` consecutive turns have gone there or that engine has more than
  ``load_factor`` times the in-flight requests of the least loaded one (at least 1); then
  the session is placed afresh (possibly on the same engine).
- An engine whose call fails for a server reason (unreachable, timed out, 5xx after its own
  retries, or any exception that is not an ``EngineError``) is marked down for
  ``cooloff_s`` seconds, its sessions move on their next call, and the failed call is tried
  once more on another healthy engine. An ``EngineError`` that says the request itself was
  bad (``RequestError`` and plain ``EngineError``) is raised without fail-over.
- With no healthy engine left, ``generate`` raises ``EngineError``: the turn loop ends that
  trajectory with stop reason ``engine_error``.
- ``abort_all`` aborts on every engine; ``update_weights`` updates every healthy engine to
  one new version (an engine that is down then keeps its old weights: its
  ``EngineStats.weight_version`` says which it has).
- The engine list can change while it runs: ``add_engine`` appends one (new sessions go to it
  first, having served the fewest), ``retire`` takes one out for good (its sessions move on
  their next call, calls already on it finish there, it is no longer aborted or updated).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from turnrl.engines.http import ServerError
from turnrl.support.errors import describe
from turnrl.types import (
    TOKEN_SINK,
    Engine,
    EngineError,
    Generation,
    SamplingParams,
    TokenSink,
    Weights,
    as_abortable,
    as_following,
    as_updatable,
    can_abort,
    engine_label,
)

_MAX_SESSIONS = 100_000  # remembered sessions; the least recently used are forgotten first


@dataclass
class EngineStats:
    """What the balancer knows about one engine."""

    name: str
    in_flight: int = 0
    served: int = 0  # calls that returned a generation
    failures: int = 0  # calls that failed for a server reason
    down_until: float = 0.0  # monotonic time until which the engine gets no new requests
    last_error: str = ""  # why it was last marked down
    weight_version: int | None = None  # the version its last weight update through the balancer set
    retired: bool = False  # taken out for good (``BalancedEngine.retire``)

    def healthy(self, now: float) -> bool:
        """Whether the engine may take new requests."""
        return not self.retired and now >= self.down_until


@dataclass
class _Binding:
    """Where a session lives and how many consecutive turns it had there."""

    index: int
    turns: int = 0


class _Counted:
    """A streamed call's token sink that counts what it passed on (a call whose tokens were already
    streamed is not tried again elsewhere: its caller cannot take them back)."""

    def __init__(self, sink: TokenSink | None) -> None:
        self.sink, self.count = sink, 0

    def __call__(self, token_ids: Sequence[int]) -> None:
        self.count += len(token_ids)
        if self.sink is not None:
            self.sink(token_ids)


def _server_failure(exc: BaseException) -> bool:
    """Whether a failed call means the engine (not the request) is at fault."""
    return isinstance(exc, ServerError) or not isinstance(exc, EngineError)


class BalancedEngine:
    """An Engine over several engines: least-in-flight placement, sticky sessions, fail-over."""

    def __init__(
        self,
        engines: Sequence[Engine],
        *,
        max_sticky_turns: int = 32,
        load_factor: float = 2.0,
        cooloff_s: float = 30.0,
        names: Sequence[str] | None = None,
    ) -> None:
        """Balance over ``engines``; ``names`` label them in ``info["engine"]`` and errors."""
        if not engines:
            raise ValueError("BalancedEngine needs at least one engine")
        if names is not None and len(names) != len(engines):
            raise ValueError(f"{len(names)} names for {len(engines)} engines")
        self.engines = list(engines)
        labels = names or [engine_label(e) or f"engine{i}" for i, e in enumerate(engines)]
        self.stats = [EngineStats(str(label)) for label in labels]
        self.max_sticky_turns = max_sticky_turns
        self.load_factor = load_factor
        self.cooloff_s = cooloff_s
        self._sessions: OrderedDict[str, _Binding] = OrderedDict()
        self._version = 0

    @property
    def weight_version(self) -> int:
        """The version of the last weight update made through the balancer (0 before any)."""
        return self._version

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[Any] = (),
        *,
        session: str | None = None,
    ) -> Generation:
        """Generate on the chosen engine; on a server failure, once more on another healthy one."""
        index = self._place(session)
        streamed = _Counted(TOKEN_SINK.get())
        token = TOKEN_SINK.set(streamed if streamed.sink is not None else None)
        try:
            return await self._call(index, prompt_ids, sampling, images, session)
        except Exception as exc:
            if not _server_failure(exc) or streamed.count:  # a caller that has seen tokens gets no rerun
                raise
            self._mark_down(index, exc)
            first = f"{self.stats[index].name} failed: {exc}"
        finally:
            TOKEN_SINK.reset(token)
        retry = self._place(session, exclude=index, reason=first)
        try:
            return await self._call(retry, prompt_ids, sampling, images, session)
        except Exception as exc:
            if not _server_failure(exc):
                raise
            self._mark_down(retry, exc)
            raise EngineError(f"{first}; then {self.stats[retry].name} failed: {exc}") from exc

    def add_engine(self, engine: Engine, name: str | None = None) -> int:
        """Add an engine while the balancer runs; its index."""
        label = name or engine_label(engine) or f"engine{len(self.engines)}"
        self.engines.append(engine)
        self.stats.append(EngineStats(str(label)))
        return len(self.engines) - 1

    def retire(self, index: int) -> Engine:
        """Take an engine out for good (the caller closes it); calls already on it finish there."""
        self.stats[index].retired = True
        return self.engines[index]

    def active(self) -> list[int]:
        """Indices of the engines not retired."""
        return [i for i, s in enumerate(self.stats) if not s.retired]

    def forget(self, session: str) -> None:
        """Drop a finished session's binding (optional: old sessions are evicted anyway)."""
        self._sessions.pop(session, None)

    def healthy(self) -> list[bool]:
        """Per engine, whether it takes new requests now."""
        now = time.monotonic()
        return [s.healthy(now) for s in self.stats]

    async def abort_all(self) -> None:
        """Abort the generations in flight on every engine not retired (each must have ``abort_all``)."""
        targets = self.active()
        missing = [self.stats[i].name for i in targets if not can_abort(self.engines[i])]
        if missing:
            raise TypeError(f"cannot abort generations in flight on {', '.join(missing)} (no abort_all)")
        calls = (as_abortable(self.engines[i]).abort_all() for i in targets)
        results = await asyncio.gather(*calls, return_exceptions=True)
        self._raise_failures("abort_all", targets, results)

    async def update_weights(self, weights: Weights, *, version: int | None = None) -> int:
        """Update every healthy engine to one new version and return it.

        The new version is ``version``, else the balancer's previous one plus one; every
        engine is asked for it. EngineError when an engine fails (the others are updated).
        """
        new = self._version + 1 if version is None else version
        await self._set_version(
            "update_weights", new, lambda e: as_updatable(e).update_weights(weights, version=new)
        )
        return new

    async def follow_weights(self, version: int) -> None:
        """Take up ``version`` on every healthy engine, which another process updated (see
        ``WeightFollowing``). EngineError when an engine does not serve it."""
        await self._set_version("follow_weights", version, lambda e: as_following(e).follow_weights(version))

    async def _set_version(
        self, what: str, version: int, call: Callable[[Engine], Awaitable[object]]
    ) -> None:
        """``call`` on every healthy engine; those that succeed now serve ``version``, and so does the
        balancer unless one failed (EngineError naming it)."""
        now = time.monotonic()
        targets = [i for i, s in enumerate(self.stats) if s.healthy(now)]
        if not targets:
            raise EngineError(f"no healthy engine among {len(self.active())} for {what}")
        results = await asyncio.gather(*(call(self.engines[i]) for i in targets), return_exceptions=True)
        for i, result in zip(targets, results, strict=True):
            if not isinstance(result, BaseException):
                self.stats[i].weight_version = version
        self._raise_failures(what, targets, results)
        self._version = version

    def _raise_failures(self, what: str, indices: Sequence[int], results: Sequence[object]) -> None:
        """EngineError naming every engine whose call failed, if any did."""
        failures = [
            f"{self.stats[i].name}: {type(r).__name__}: {r}"
            for i, r in zip(indices, results, strict=True)
            if isinstance(r, BaseException)
        ]
        if failures:
            raise EngineError(f"{what} failed on {len(failures)} engine(s): {'; '.join(failures)}")

    async def close(self) -> None:
        """Close every engine."""
        await asyncio.gather(*(e.close() for e in self.engines), return_exceptions=True)

    def _place(self, session: str | None, *, exclude: int | None = None, reason: str = "") -> int:
        """The engine index for this call, updating the session's binding."""
        now = time.monotonic()
        candidates = [i for i, s in enumerate(self.stats) if s.healthy(now) and i != exclude]
        if not candidates:
            detail = f" ({reason})" if reason else ""
            raise EngineError(f"no healthy engine among {len(self.active())}{detail}")
        binding = self._sessions.get(session) if session is not None else None
        if binding is not None and self._keep(binding, candidates):
            binding.turns += 1
            assert session is not None
            self._sessions.move_to_end(session)
            return binding.index
        index = min(candidates, key=lambda i: (self.stats[i].in_flight, self.stats[i].served, i))
        if session is not None:
            self._bind(session, index)
        return index

    def _keep(self, binding: _Binding, candidates: list[int]) -> bool:
        """Whether a session stays on its engine for one more turn."""
        if binding.index not in candidates or binding.turns >= self.max_sticky_turns:
            return False
        least = min(self.stats[i].in_flight for i in candidates)
        return self.stats[binding.index].in_flight <= self.load_factor * max(least, 1)

    def _bind(self, session: str, index: int) -> None:
        """Place a session on an engine, evicting the oldest bindings past the bound."""
        self._sessions[session] = _Binding(index, turns=1)
        self._sessions.move_to_end(session)
        while len(self._sessions) > _MAX_SESSIONS:
            self._sessions.popitem(last=False)

    def _mark_down(self, index: int, exc: BaseException) -> None:
        """Keep new requests off a failed engine for the cool-off."""
        stats = self.stats[index]
        stats.failures += 1
        stats.last_error = describe(exc)
        stats.down_until = time.monotonic() + self.cooloff_s

    async def _call(
        self,
        index: int,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[Any],
        session: str | None,
    ) -> Generation:
        """One call on one engine, counted in flight; the engine's name lands in ``info``."""
        stats = self.stats[index]
        stats.in_flight += 1
        try:
            gen = await self.engines[index].generate(prompt_ids, sampling, images, session=session)
        finally:
            stats.in_flight -= 1
        stats.served += 1
        gen.info = {**(gen.info or {}), "engine": stats.name}
        return gen
