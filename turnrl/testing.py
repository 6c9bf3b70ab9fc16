"""Test doubles for users' own tests: a scripted engine (fixed replies, exact tokens) and small envs
that are deterministic, instant, and failing on purpose."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from turnrl.engines.scripted import ScriptedEngine, ScriptedReply
from turnrl.env.base import Env
from turnrl.types import Message, Sample, StepResult, Trajectory

__all__ = ["BrokenResetEnv", "EchoEnv", "FlakyEnv", "ParityEnv", "ScriptedEngine", "ScriptedReply", "until"]


class EchoEnv(Env):
    """Answers every turn with a user message; done after ``done_after`` turns (0: never)."""

    def __init__(
        self,
        sample: Sample,
        done_after: int = 0,
        reply: str = "Go on.",
        reward: float = 1.0,
        delay_s: float = 0.0,
    ) -> None:
        super().__init__(sample)
        self.done_after = done_after
        self.reply = reply
        self.reward = reward
        self.delay_s = delay_s
        self.steps = 0
        self.closed = False

    async def step(self, action: str) -> StepResult:
        """Count the turn (after ``delay_s``); answer with the same reply."""
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        self.steps += 1
        done = bool(self.done_after) and self.steps >= self.done_after
        return StepResult(f"{self.reply} (turn {self.steps})", self.reward if done else 0.0, done)

    async def close(self) -> None:
        """Remember that close ran."""
        self.closed = True

    @staticmethod
    def dataset(size: int = 4) -> list[dict[str, Any]]:
        """Rows asking for a short story, told turn by turn."""
        return [
            {"id": f"echo-{i}", "prompt": f"Tell story number {i}, one sentence per turn."}
            for i in range(size)
        ]


class ParityEnv(Env):
    """One turn; reward 1 when the model's text has an even length: a coin flip for a random model,
    so a training step on a tiny random model has groups with varied rewards to learn from."""

    async def step(self, action: str) -> StepResult:
        """End after the model's one turn."""
        return StepResult(None, done=True)

    async def score(self, trajectory: Trajectory) -> float:
        """1.0 when the first model turn's text has an even length."""
        return float(len(trajectory.turns[0].text) % 2 == 0)

    @staticmethod
    def dataset(size: int = 8) -> list[dict[str, Any]]:
        """``size`` prompts, ids ``p0``, ``p1``..."""
        return [{"id": f"p{i}", "prompt": f"Say something, number {i}."} for i in range(size)]


class FlakyEnv(EchoEnv):
    """Fails its first ``failures`` step attempts of every turn (raising, or hanging past a timeout)."""

    def __init__(self, sample: Sample, failures: int = 1, hang: bool = False, **kwargs: Any) -> None:
        super().__init__(sample, **kwargs)
        self.failures = failures
        self.hang = hang
        self.attempts = 0

    async def step(self, action: str) -> StepResult:
        """Fail ``failures`` times per turn, then succeed."""
        self.attempts += 1
        if self.attempts <= self.failures:
            if self.hang:
                await asyncio.sleep(3600)
            raise ConnectionError(f"flaky env: attempt {self.attempts} failed")
        self.attempts = 0
        return await super().step(action)


class BrokenResetEnv(EchoEnv):
    """Raises in reset, always."""

    async def reset(self) -> list[Message]:
        """Fail."""
        raise RuntimeError("reset is broken")


async def until(condition: Callable[[], bool], timeout_s: float = 60.0, what: str = "the condition") -> None:
    """Return as soon as ``condition()`` holds (checked every few milliseconds); TimeoutError naming
    ``what`` after ``timeout_s``. Tests wait on a state this way instead of sleeping a fixed time."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s}s")
        await asyncio.sleep(0.002)
