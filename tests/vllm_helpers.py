"""What the tests on real vLLM servers share: the skip-or-fail rule, the model, the tolerance, and
the process-table check for servers that outlived their engine, and the gate that makes a weight
push meet turns in flight."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any

from parts import missing

from turnrl.env.builtin.key_lookup import KeyLookupEnv
from turnrl.testing import ParityEnv
from turnrl.types import EngineError, Message

MODEL = "smollm2-135m"  # what the shared servers serve (SmolLM2-135M-Instruct, saved as float32)
TOLERANCE = 2e-4  # nats, vLLM CPU float32 vs a transformers float32 forward pass (measured: up to 1.03e-4)


def need_vllm() -> None:
    """Skip without vLLM's environment; in CI (CI set) that is a failure instead."""
    from turnrl.engines.vllm_server import find_vllm_python

    try:
        find_vllm_python()
    except EngineError as exc:
        missing(str(exc))


def running(pids: list[int]) -> list[int]:
    """Which of ``pids`` (or processes in their groups) are still running."""
    out = subprocess.run(["ps", "-eo", "pid=,pgid=,stat="], capture_output=True, text=True, check=True)
    alive = []
    for line in out.stdout.splitlines():
        pid, pgid, stat = line.split()[:3]
        if (int(pid) in pids or int(pgid) in pids) and not stat.startswith("Z"):
            alive.append(int(pid))
    return alive


class PushGate:
    """Makes a weight push meet a turn in flight, whatever the model and the machine's speed.

    The overlapped trainer starts new groups when a step takes its own; whether one is still
    generating when that step's push comes depends on how long the update takes against the
    rollouts (a fast update pushes before the new groups reach the server, a slow one after they
    finished). With the gate: a group whose env is reset while the trainer learns waits there (at
    most ``hold_s``) until the push comes; the push first releases the waiting groups, lets their
    first turns get under way (until ``lead_tokens`` more tokens have streamed back from the
    engine, or ``lead_s`` for an engine that does not count them: a fixed wait is too long for
    short turns on a fast server, and a turn paused before its first token is not split), then
    pauses them mid-turn and loads the weights."""

    def __init__(self, hold_s: float = 120.0, lead_s: float = 0.5, lead_tokens: int = 4) -> None:
        self.hold_s, self.lead_s, self.lead_tokens = hold_s, lead_s, lead_tokens
        self.learning = False
        self.waiting = 0  # resets held for the coming push
        self.released = 0  # resets released into a push, over the run
        self.coming: asyncio.Event | None = None

    def wrap_learn(self, learn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        """``learn`` (the update and its push) with the trainer marked learning meanwhile."""

        async def learning(*args: Any, **kwargs: Any) -> Any:
            self.learning = True
            try:
                return await learn(*args, **kwargs)
            finally:
                self.learning = False

        return learning

    def wrap_load(self, load: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        """The trainer's server update (which pauses the turns in flight first), releasing the
        waiting groups and letting them generate first."""

        async def loading(run: Any) -> None:
            self.learning = False  # a group reset from here on is not held for the push after next
            held, self.waiting = self.waiting, 0
            if self.coming is not None:
                self.coming.set()
                self.coming = None
            if held:
                self.released += held
                await self._lead(run.engine)
            await load(run)

        return loading

    async def _lead(self, engine: Any) -> None:
        """Wait until the released turns have streamed back their first tokens (at most 60 s)."""
        engine = getattr(engine, "engine", engine)  # the client inside a ManagedEngine
        start = getattr(engine, "tokens_received", None)
        if start is None:
            await asyncio.sleep(self.lead_s)
            return
        deadline = time.monotonic() + 60
        while engine.tokens_received < start + self.lead_tokens and time.monotonic() < deadline:
            await asyncio.sleep(0.002)

    async def hold(self) -> None:
        """In an env's reset: wait for the next push while the trainer learns."""
        if not self.learning:
            return
        if self.coming is None:
            self.coming = asyncio.Event()
        coming, self.waiting = self.coming, self.waiting + 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(coming.wait(), self.hold_s)


GATE = PushGate()


class GatedParityEnv(ParityEnv):
    """The parity env, its reset held by ``GATE`` while the trainer learns."""

    async def reset(self) -> list[Message]:
        """Wait while ``GATE`` holds, then reset."""
        await GATE.hold()
        return await super().reset()


class GatedKeyLookupEnv(KeyLookupEnv):
    """The demo's env, its reset held by ``GATE`` while the trainer learns."""

    async def reset(self) -> list[Message]:
        """Wait while ``GATE`` holds, then reset."""
        await GATE.hold()
        return await super().reset()
