"""The engine host: one process serving one turnrl engine, called through a Ray actor.

Plain Python, no Ray: ``ray_engines`` wraps ``EngineHost`` in ``ray.remote``. Every method is
async, so Ray runs it as an async actor and concurrent ``generate`` calls reach the engine
together (the embedded engine batches them). The engine is built in the host by a picklable
zero-argument callable (``turnrl.app.engines.EngineBuild`` builds one from a run config).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

from turnrl.types import (
    Engine,
    EngineError,
    Generation,
    SamplingParams,
    Weights,
    as_abortable,
    as_updatable,
    can_abort,
    can_update_weights,
)


class EngineHost:
    """Hosts one engine; every call of a RayEngine proxy runs here."""

    def __init__(self, build: Callable[[], Engine]) -> None:
        self.engine = build()
        self.version: int | None = None  # the last version update_weights set

    async def ready(self) -> dict[str, Any]:
        """Where the host runs (pid, host name), once its engine is built."""
        return {"pid": os.getpid(), "host": socket.gethostname()}

    async def ping(self) -> bool:
        """Answers while the host is alive (the registry's health check)."""
        return True

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        images: Sequence[Any] = (),
        session: str | None = None,
    ) -> Generation:
        """The engine's generation."""
        return await self.engine.generate(prompt_ids, sampling, images, session=session)

    async def abort_all(self) -> None:
        """Abort every generation in flight (they return with finish_reason "abort")."""
        if not can_abort(self.engine):
            raise EngineError(f"{type(self.engine).__name__} cannot abort generations in flight")
        await as_abortable(self.engine).abort_all()

    async def update_weights(self, weights: Weights, version: int | None = None) -> int:
        """Load new weights (a state dict, or a checkpoint folder on this node); the new version."""
        if not can_update_weights(self.engine):
            raise EngineError(f"{type(self.engine).__name__} cannot update its weights")
        self.version = await as_updatable(self.engine).update_weights(weights, version=version)
        return self.version

    async def close(self) -> None:
        """Close the engine (the actor stays until it is killed)."""
        await self.engine.close()
