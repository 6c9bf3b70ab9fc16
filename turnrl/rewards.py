"""Reward functions routed by data source; each gets everything the rollout knew."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from turnrl.env.base import Env
from turnrl.types import Sample, Trajectory


@dataclass
class RewardContext:
    """What a reward function may look at."""

    sample: Sample  # the data row (ground truth in metadata / tools_kwargs)
    trajectory: Trajectory  # tokens, messages, turn rewards, stop reason
    env: Env  # the live env (closed right after scoring)

    @property
    def final_text(self) -> str:
        """The text of the last model turn."""
        for turn in reversed(self.trajectory.turns):
            if turn.role == "assistant":
                return turn.text
        return ""


RewardFn = Callable[[RewardContext], float | Awaitable[float]]

_REWARDS: dict[str, RewardFn] = {}


def register_reward(data_source: str, fn: RewardFn | None = None) -> Any:
    """Register ``fn`` for ``data_source`` (usable as a decorator)."""

    def add(f: RewardFn) -> RewardFn:
        _REWARDS[data_source] = f
        return f

    return add(fn) if fn is not None else add


def reward_fn_for(data_source: str) -> RewardFn | None:
    """The registered reward function for ``data_source``, if any."""
    return _REWARDS.get(data_source)


async def compute_reward(ctx: RewardContext, fn: RewardFn | None) -> float:
    """Final reward: the routed function, else the env's score, else the sum of step rewards."""
    fn = fn or reward_fn_for(ctx.sample.data_source)
    if fn is not None:
        value = fn(ctx)
        return float(await value) if inspect.isawaitable(value) else float(value)
    score = await ctx.env.score(ctx.trajectory)
    if score is not None:
        return float(score)
    return float(sum(ctx.trajectory.turn_rewards))
