"""A balancer whose engine list follows an engine registry, and building it from a config.

``RegistryEngine`` is a ``BalancedEngine`` over everything a registry lists: every ``refresh_s``
it re-reads the list, adds the engines that registered (they get new trajectories first,
having served the fewest) and retires those that left (unregistered, or dropped by the
registry's health check). An engine that fails in the middle of a call is the balancer's
business, as for servers: it is marked down, the call is tried once more on another engine
(same prompt, same seed: the same tokens from a seeded engine), and the trajectory goes on.

``turnrl.app.engines`` builds what a config's ``engine.ray`` asks for from these parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from turnrl.distributed.ray_engines import (
    RayEngine,
    await_call,
)
from turnrl.distributed.registry import EngineEntry
from turnrl.engines.balancer import BalancedEngine, EngineStats
from turnrl.support.errors import describe
from turnrl.types import Engine, Generation, SamplingParams, Weights, as_updatable

ServerFactory = Callable[[EngineEntry], Engine]
"""Builds the driver's client for a registered server."""


class RegistryEngine:
    """An Engine over every engine in a registry: a BalancedEngine whose list follows it.

    ``owned`` names the engines this driver registered itself: ``close`` unregisters them and
    kills those that are actors; the others are left running for their nodes to manage.
    """

    def __init__(
        self,
        registry: Any,
        entries: Sequence[EngineEntry],
        *,
        make_server: ServerFactory | None = None,
        refresh_s: float = 5.0,
        owned: Sequence[str] = (),
        **balancer_kwargs: Any,
    ) -> None:
        if not entries:
            raise ValueError("RegistryEngine needs at least one registered engine to start")
        self.registry = registry
        self.refresh_s = refresh_s
        self._make_server = make_server
        self._owned = set(owned)
        self._entries = {e.name: e for e in entries}
        self.balancer = BalancedEngine(
            [self._make(e) for e in entries], names=[e.name for e in entries], **balancer_kwargs
        )
        self._index = {e.name: i for i, e in enumerate(entries)}
        self._version = -1
        self._last = time.monotonic()
        self._failures = 0
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._weights: tuple[Weights, int] | None = None  # the last update, for engines that join later
        self.refresh_error = ""  # why the last refresh failed ("" when it did not)

    def names(self) -> list[str]:
        """The engines in use now (registered and not retired)."""
        return list(self._index)

    def engine_stats(self, name: str) -> EngineStats:
        """What the balancer knows about an engine in use (KeyError for others)."""
        return self.balancer.stats[self._index[name]]

    @property
    def weight_version(self) -> int:
        """The version of the last weight update (0 before any)."""
        return self.balancer.weight_version

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[Any] = (),
        *,
        session: str | None = None,
    ) -> Generation:
        """Generate through the balancer; re-read the registry when due, or at once when no engine is up."""
        self._maybe_refresh()
        if not any(self.balancer.healthy()):
            with contextlib.suppress(Exception):
                await self.refresh()
        return await self.balancer.generate(prompt_ids, sampling, images, session=session)

    async def refresh(self) -> None:
        """Re-read the registry now: add the engines that joined, retire those that left.

        After a failure in the balancer, the registry is first asked to check its engines, so
        a dead one is dropped now rather than at its next health check.
        """
        async with self._lock:
            self._last = time.monotonic()
            self.refresh_error = ""
            failures = sum(s.failures for s in self.balancer.stats)
            if failures > self._failures:
                self._failures = failures
                await await_call(self.registry.check.remote())
            version, entries = await await_call(self.registry.entries.remote())
            if version != self._version and await self._apply(entries):
                self._version = version

    async def abort_all(self) -> None:
        """Abort the generations in flight on every engine in use."""
        await self.balancer.abort_all()

    async def update_weights(self, weights: Weights, *, version: int | None = None) -> int:
        """Update every healthy engine; engines that join later get these weights before any work.

        The weights are kept (by reference) until the next update, for those later engines.
        """
        new = await self.balancer.update_weights(weights, version=version)
        self._weights = (weights, new)
        return new

    async def close(self) -> None:
        """Unregister this driver's own engines and close every engine (owned actors are killed)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for name in self._owned:
            with contextlib.suppress(Exception):
                await await_call(self.registry.unregister.remote(name))
        await self.balancer.close()

    def _maybe_refresh(self) -> None:
        """Start a refresh in the background when one is due."""
        due = time.monotonic() - self._last >= self.refresh_s
        if due and (self._task is None or self._task.done()):
            self._last = time.monotonic()
            self._task = asyncio.get_running_loop().create_task(self._refresh_quietly())

    async def _refresh_quietly(self) -> None:
        try:
            await self.refresh()
        except Exception as exc:  # the registry is unreachable: keep balancing over the last list
            self.refresh_error = describe(exc)

    async def _apply(self, entries: Sequence[EngineEntry]) -> bool:
        """Follow the registry's list: retire what left or changed, add what joined.

        False when a newcomer could not be given the current weights (it is tried again next time).
        """
        complete = True
        listed = {e.name: e for e in entries}
        for name in list(self._index):
            if listed.get(name) != self._entries[name]:
                self.balancer.retire(self._index.pop(name))
                del self._entries[name]
        for name, entry in listed.items():
            if name in self._index:
                continue
            engine = self._make(entry)
            if self._weights is not None:
                weights, version = self._weights
                try:
                    await as_updatable(engine).update_weights(weights, version=version)
                except Exception as exc:
                    self.refresh_error = f"{name} joined but its weight update failed: {exc}"
                    await engine.close()
                    complete = False
                    continue
            self._index[name] = self.balancer.add_engine(engine, name)
            self._entries[name] = entry
            if self._weights is not None:
                self.balancer.stats[self._index[name]].weight_version = self._weights[1]
        return complete

    def _make(self, entry: EngineEntry) -> Engine:
        if entry.is_actor:
            return RayEngine(entry.handle, entry.name, owned=entry.name in self._owned)
        if self._make_server is None:
            raise ValueError(f"registered server {entry.name!r} needs make_server to be reached")
        return self._make_server(entry)
