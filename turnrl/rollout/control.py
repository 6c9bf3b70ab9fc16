"""Pause, resume and stop generation across every trajectory in flight (partial rollout)."""

from __future__ import annotations

import asyncio

from turnrl.types import Abortable


class RolloutControl:
    """Shared by the trajectories of a collection.

    ``pause`` aborts every generation in flight; each trajectory keeps the tokens sampled so
    far and waits. ``resume`` lets them continue exactly where each stopped, conditioned on
    the partial tokens (a weight update usually sits in between: bump ``policy_version``).
    ``stop`` ends every trajectory at its next generation with stop reason ``aborted``.
    """

    def __init__(self, policy_version: int = 0) -> None:
        self.policy_version = policy_version  # stamped on tokens when the engine reports none
        self.stopped = False
        self.pauses = 0
        self._running = asyncio.Event()
        self._running.set()

    @property
    def paused(self) -> bool:
        """Whether generation is paused."""
        return not self._running.is_set()

    async def pause(self, engine: Abortable) -> None:
        """Pause: abort every generation in flight (their tokens are kept)."""
        self.hold()
        await engine.abort_all()

    def hold(self) -> None:
        """Pause without aborting: generations in flight finish (or are aborted by whoever shares
        the engine), and no trajectory starts or resumes one until :meth:`resume`."""
        self.pauses += 1
        self._running.clear()

    def resume(self, policy_version: int | None = None) -> None:
        """Let paused trajectories continue, optionally under a new policy version."""
        if policy_version is not None:
            self.policy_version = policy_version
        self._running.set()

    async def stop(self, engine: Abortable) -> None:
        """End every trajectory at its next generation (and abort those generating now)."""
        self.stopped = True
        self._running.set()
        await engine.abort_all()

    async def wait_running(self) -> None:
        """Return once generation may go on."""
        await self._running.wait()
