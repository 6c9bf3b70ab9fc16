"""An engine together with the server processes it talks to: closing it stops them."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from turnrl.engines.process import ServerProcess
from turnrl.types import (
    Engine,
    Generation,
    SamplingParams,
    Weights,
    as_abortable,
    as_following,
    as_updatable,
    weight_version,
)


class ManagedEngine:
    """Forwards to ``engine``; :meth:`close` closes it, then stops ``servers`` (also on errors)."""

    def __init__(self, engine: Engine, servers: Sequence[ServerProcess]) -> None:
        self.engine = engine
        self.servers = list(servers)

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[Any] = (),
        *,
        session: str | None = None,
    ) -> Generation:
        """The wrapped engine's generation."""
        return await self.engine.generate(prompt_ids, sampling, images, session=session)

    async def abort_all(self) -> None:
        """Abort everything in flight on the wrapped engine."""
        await as_abortable(self.engine).abort_all()

    async def update_weights(self, weights: Weights, *, version: int | None = None) -> int:
        """Update the wrapped engine's weights."""
        return await as_updatable(self.engine).update_weights(weights, version=version)

    async def follow_weights(self, version: int) -> None:
        """Take up a version another process loaded into the wrapped engine's servers."""
        await as_following(self.engine).follow_weights(version)

    @property
    def weight_version(self) -> int:
        """The wrapped engine's weight version."""
        return weight_version(self.engine)

    @property
    def urls(self) -> list[str]:
        """The addresses of the servers it started."""
        return [s.url for s in self.servers]

    async def close(self) -> None:
        """Close the engine, then stop every server process."""
        try:
            await self.engine.close()
        finally:
            await asyncio.gather(*(asyncio.to_thread(s.stop) for s in self.servers))
