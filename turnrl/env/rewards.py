"""Reward functions routed by data source, carried on the rollout spec (no global registry).

A per-trajectory function gets a ``RewardContext`` (sample, trajectory, live env) and returns a
float; a group function gets the contexts of a whole GRPO group at once (every trajectory of
one prompt, envs already closed) and returns one float each: for LLM judges that compare,
rankings, or pass@k-style credit.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnrl.env.base import Env
from turnrl.support.errors import describe
from turnrl.types import Sample, Trajectory


@dataclass
class RewardContext:
    """What a reward function may look at."""

    sample: Sample  # the data row (ground truth in metadata / tools_kwargs)
    trajectory: Trajectory  # tokens, messages, turn rewards, stop reason
    env: Env | None = None  # the live env (closed right after scoring); None for group rewards

    @property
    def final_text(self) -> str:
        """The text of the last model turn."""
        for turn in reversed(self.trajectory.turns):
            if turn.role == "assistant":
                return turn.text
        return ""


RewardFn = Callable[[RewardContext], float | Awaitable[float]]
"""Scores one trajectory."""
GroupRewardFn = Callable[[list[RewardContext]], Sequence[float] | Awaitable[Sequence[float]]]
"""Scores every trajectory of one prompt at once; one float per context, in order."""


@dataclass
class Rewards:
    """Which function scores which data source.

    Routing: ``by_source[data_source]``, else ``default``, else the env's ``score``, else the
    sum of the step rewards. ``groups[data_source]`` (or ``group_default``), when set, rescores
    each finished group and its values replace the per-trajectory rewards.
    """

    by_source: dict[str, RewardFn] = field(default_factory=dict)  # data_source -> per-trajectory fn
    default: RewardFn | None = None  # for data sources without a function of their own
    groups: dict[str, GroupRewardFn] = field(default_factory=dict)  # data_source -> group fn
    group_default: GroupRewardFn | None = None  # group fn for data sources without one of their own

    def fn_for(self, data_source: str) -> RewardFn | None:
        """The per-trajectory function for ``data_source``, if any."""
        return self.by_source.get(data_source, self.default)

    def group_fn_for(self, data_source: str) -> GroupRewardFn | None:
        """The group function for ``data_source``, if any."""
        return self.groups.get(data_source, self.group_default)

    async def score(self, ctx: RewardContext) -> float:
        """The trajectory's reward: its routed function, else the env's score, else its step rewards."""
        fn = self.fn_for(ctx.sample.data_source)
        if fn is not None:
            return float(await _maybe_await(fn(ctx)))
        if ctx.env is not None:
            score = await ctx.env.score(ctx.trajectory)
            if score is not None:
                return float(score)
        return float(sum(ctx.trajectory.turn_rewards))

    async def score_group(self, sample: Sample, group: list[Trajectory]) -> None:
        """Rescore a finished group in place with its group function (no-op without one).
        A failing function leaves each reward 0.0 and says why in ``metrics["reward_error"]``."""
        fn = self.group_fn_for(sample.data_source)
        if fn is None:
            return
        try:
            values = [float(v) for v in await _maybe_await(fn([RewardContext(sample, t) for t in group]))]
            if len(values) != len(group):
                raise ValueError(f"returned {len(values)} rewards for a group of {len(group)}")
            if bad := [v for v in values if not math.isfinite(v)]:
                raise ValueError(f"returned the reward {bad[0]!r}, expected finite numbers")
        except Exception as exc:
            values = [0.0] * len(group)
            for traj in group:
                traj.metrics["reward_error"] = f"group reward: {describe(exc)}"
        for traj, value in zip(group, values, strict=True):
            traj.metrics["reward/per_trajectory"] = traj.reward
            traj.reward = value


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value
