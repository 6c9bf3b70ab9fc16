"""The engine registry: where engines started on many nodes make themselves known.

Plain Python: ``ray_engines`` runs ``EngineRegistry`` as a named, detached Ray actor. An entry
is an engine actor (its handle) or an inference server (its URL and dialect). Entries leave
when they unregister, or when the registry's health check finds them gone: an engine actor
whose process died (at once), or one that misses ``max_misses`` pings in a row; a server
whose ``/health`` fails ``max_misses`` times in a row. Drivers read ``entries`` now and then
and balance over whatever is listed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from turnrl.support.errors import describe


@dataclass(frozen=True)
class EngineEntry:
    """One registered engine."""

    name: str  # unique in the registry; a later registration under the same name replaces it
    handle: Any = None  # an EngineHost actor handle, or None for a server
    url: str = ""  # a server's base URL (handle is None)
    kind: Literal["openai", "sglang"] = "openai"  # a server's API: OpenAI-compatible or SGLang native
    dialect: Literal["vllm", "sglang", "llamacpp"] = "vllm"  # openai: which server speaks
    served_model: str | None = None  # openai: the server's "model" field
    node: str = ""  # where it runs, for people reading the list
    registered_at: float = field(default=0.0, compare=False)  # wall-clock time of registration

    @property
    def is_actor(self) -> bool:
        """Whether the entry is an engine actor (else a server reached by URL)."""
        return self.handle is not None


class EngineRegistry:
    """Named engines and their health; every method is async (an async Ray actor)."""

    def __init__(
        self, health_interval_s: float = 5.0, health_timeout_s: float = 10.0, max_misses: int = 3
    ) -> None:
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.max_misses = max_misses
        self.version = 0  # bumped on every change of the entry list
        self._entries: dict[str, EngineEntry] = {}
        self._misses: dict[str, int] = {}
        self.dropped: list[tuple[str, str]] = []  # (name, why) of the last 100 the health check removed
        self._checker: asyncio.Task[None] | None = None

    async def register(self, entry: EngineEntry) -> int:
        """Add (or replace) an entry; the registry's new version."""
        self._start_checker()
        if not entry.name:
            raise ValueError("an engine entry needs a name")
        if entry.handle is None and not entry.url:
            raise ValueError(f"engine entry {entry.name!r} has neither an actor handle nor a URL")
        self._entries[entry.name] = replace(entry, registered_at=time.time())
        self._misses[entry.name] = 0
        self.version += 1
        return self.version

    async def unregister(self, name: str) -> bool:
        """Remove an entry; whether it was there."""
        if self._entries.pop(name, None) is None:
            return False
        self._misses.pop(name, None)
        self.version += 1
        return True

    async def entries(self) -> tuple[int, list[EngineEntry]]:
        """The version and the entries, oldest registration first."""
        self._start_checker()
        return self.version, list(self._entries.values())

    async def dropped_entries(self) -> list[tuple[str, str]]:
        """The entries the health check removed, and why."""
        return list(self.dropped)

    async def check(self) -> list[str]:
        """Check every entry now; the names dropped."""
        entries = list(self._entries.values())
        results = await asyncio.gather(*(self._probe(e) for e in entries))
        dropped = []
        for entry, (alive, gone, why) in zip(entries, results, strict=True):
            if self._entries.get(entry.name) is not entry:
                continue  # replaced or removed while it was being checked
            misses = 0 if alive else self._misses.get(entry.name, 0) + 1
            self._misses[entry.name] = misses
            if gone or misses >= self.max_misses:
                await self.unregister(entry.name)
                self.dropped = [*self.dropped[-99:], (entry.name, why)]
                dropped.append(entry.name)
        return dropped

    def _start_checker(self) -> None:
        if self._checker is None or self._checker.done():
            self._checker = asyncio.get_running_loop().create_task(self._check_forever())

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            with contextlib.suppress(Exception):  # a failed round never stops the checks
                await self.check()

    async def _probe(self, entry: EngineEntry) -> tuple[bool, bool, str]:
        """(answered, gone for good, why not)."""
        if entry.is_actor:
            return await self._probe_actor(entry)
        return await self._probe_server(entry)

    async def _probe_actor(self, entry: EngineEntry) -> tuple[bool, bool, str]:
        from ray.exceptions import ActorDiedError

        try:
            async with asyncio.timeout(self.health_timeout_s):
                await entry.handle.ping.remote()
        except ActorDiedError as exc:
            return False, True, f"actor died: {exc}".splitlines()[0]
        except Exception as exc:
            return False, False, describe(exc).splitlines()[0]
        return True, False, ""

    async def _probe_server(self, entry: EngineEntry) -> tuple[bool, bool, str]:
        import httpx

        try:
            async with httpx.AsyncClient(timeout=self.health_timeout_s, trust_env=False) as client:
                response = await client.get(f"{entry.url.rstrip('/')}/health")
        except httpx.HTTPError as exc:
            return False, False, describe(exc)
        if response.status_code != 200:
            return False, False, f"/health answered {response.status_code}"
        return True, False, ""
