"""The environment protocol: reset, step, format_observation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast, runtime_checkable

from turnrl.types import Message, Observation, Sample, StepResult, Trajectory


class Env:
    """One episode of a task. Subclass it and override what you need.

    The rollout calls ``reset`` once, then ``step(action)`` after every model turn with the
    model's text, and ``format_observation`` on what ``step`` returned. ``close`` always
    runs at the end, also after errors.
    """

    tools: list[dict[str, Any]] | None = None  # OpenAI function schemas shown in the prompt

    def __init__(self, sample: Sample) -> None:
        self.sample = sample

    async def reset(self) -> list[Message]:
        """Start the episode; return the prompt messages (default: the sample's prompt)."""
        return list(self.sample.prompt)

    async def step(self, action: str) -> StepResult:
        """Apply the model's action (its decoded text for this turn)."""
        raise NotImplementedError

    def format_observation(self, observation: Observation) -> list[Message]:
        """Turn an observation into the chat messages appended for the next turn."""
        if isinstance(observation, str):
            return [{"role": "user", "content": observation}]
        if isinstance(observation, dict):
            return [cast(Message, observation)]
        if isinstance(observation, list):
            return observation
        raise TypeError(f"cannot format observation of type {type(observation).__name__}")

    async def score(self, trajectory: Trajectory) -> float | None:
        """Final reward of the episode, or None to use the reward function / sum of step rewards."""
        return None

    async def close(self) -> None:
        """Release what the episode holds."""


EnvFactory = Callable[[Sample], Env]
"""Builds a fresh env for one trajectory."""


@runtime_checkable
class StoppableFactory(Protocol):
    """An env factory that holds workers (``turnrl.distributed``'s Ray actors), stopped once a run ends."""

    def __call__(self, sample: Sample) -> Env: ...

    def shutdown(self) -> None:
        """Stop the workers; envs still open in them are lost."""
        ...
