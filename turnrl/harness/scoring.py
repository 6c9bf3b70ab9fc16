"""How a harness run is scored, in one place: its stop reason (``ending``), the user's reward checked
(``branch_rewards``) and put on its branches, the branches not to train marked (``exclude``), and
each sampled token put in exactly one branch's loss (``gateway.forest.train_once``).

Every branch of a run carries the run's stop reason (``agent_done``; ``agent_error`` for a crash, an
exit code not in ``env.scored_exit_codes``, an agent that never called; ``agent_timeout``;
``token_budget`` when the session's call budget ran out), its own reward, and ``run``
(``AgentRun``: exit code, time, calls, the run's reward for the group's baseline, which is over
runs, not branches). A failed run is not scored: its
branches keep reward 0 with the failure as their stop reason, and training leaves them out.
Branches not to train (``reinforce``, ``skip_system``, a reward of None) say why in ``exclude``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from turnrl.config import HarnessConfig
from turnrl.gateway.forest import train_once
from turnrl.harness.process import Exit
from turnrl.harness.result import HarnessResult, HarnessRewardFn
from turnrl.record.episode import failed_trajectory
from turnrl.support.imports import import_object
from turnrl.support.user_code import raised_at
from turnrl.types import AgentRun, Sample, StopReason, Trajectory

log = logging.getLogger(__name__)


class Scoring:
    """Scores the runs of one harness config (its reward, ``reinforce`` and ``skip_system``)."""

    def __init__(self, config: HarnessConfig) -> None:
        self.config = config
        self.reward: HarnessRewardFn = import_object(config.reward, "env.reward")
        self.skip = [re.compile(pattern) for pattern in config.skip_system]
        self._reward_errors: set[str] = set()  # said on the console already

    async def score(
        self, sample: Sample, index: int, exit: Exit, result: HarnessResult, over_budget: bool
    ) -> list[Trajectory]:
        """The run's branches, with its stop reason and rewards (a failed trajectory when it has none)."""
        branches = result.branches
        stop, error = ending(exit, result, self.config.timeout_s, over_budget, self.config.scored_exit_codes)
        if not branches:
            return [failed_trajectory(sample, index, error or "the agent never called the model", stop)]
        run = AgentRun(exit.code, round(exit.seconds, 3), result.calls)
        for traj in branches:
            traj.stop_reason, traj.error, traj.run = stop, error, run
        per_branch = False
        if stop in (StopReason.AGENT_DONE, StopReason.TOKEN_BUDGET):
            per_branch = await self._reward(sample, result, run)
        run.commands = result.commands
        self._select(branches)
        train_once(branches, credit_unchosen=per_branch)
        return branches

    async def _reward(self, sample: Sample, result: HarnessResult, run: AgentRun) -> bool:
        """Score the branches with the user's reward, in a thread (it may run the task's tests); a
        raise or a bad value ends them as internal_error (a bug in a hook), a None leaves them out
        of training. Whether the reward scored branches one by one."""
        try:
            scores = await asyncio.to_thread(branch_rewards, self.reward, sample, result)
        except RewardError as exc:
            if str(exc) not in self._reward_errors:  # each on the console once, all in the records
                self._reward_errors.add(str(exc))
                log.warning("env.reward: %s (the run's branches end as internal_error)", exc)
            for traj in result.branches:
                traj.stop_reason, traj.error = StopReason.INTERNAL_ERROR, f"env.reward: {exc}"
            return False
        if scores is None:
            for traj in result.branches:
                traj.exclude = "reward_none"
            return False
        run.reward = statistics.fmean(scores.values)
        for traj, reward in zip(result.branches, scores.values, strict=True):
            traj.reward = reward
        return scores.per_branch

    def _select(self, branches: list[Trajectory]) -> None:
        """Mark the branches not to train: all but the last with ``reinforce: last``, and those whose
        system prompt matches ``skip_system``."""
        for i, traj in enumerate(branches):
            system = next((str(m.get("content")) for m in traj.messages if m.get("role") == "system"), "")
            last_only = self.config.reinforce == "last" and i != len(branches) - 1
            if last_only or any(p.search(system) for p in self.skip):
                traj.exclude = traj.exclude or "not_reinforced"


def ending(
    exit: Exit, result: HarnessResult, timeout: float, over_budget: bool, scored: Sequence[int] = (0,)
) -> tuple[StopReason, str | None]:
    """The run's stop reason and error line (``scored``: the exit codes of a run that ended)."""
    last = (exit.stderr.strip().splitlines() or [""])[-1][-300:]
    said = f": {last}" if last else ""
    if exit.error is not None:
        return StopReason.AGENT_ERROR, exit.error
    if exit.timed_out:
        limit = exit.limit_s if exit.limit_s is not None else timeout
        # a row's place (a task's [agent] timeout_sec) sets the limit instead of env.timeout_s
        named = "env.timeout_s" if limit == timeout else "its row's time limit (a task's [agent] timeout_sec)"
        killed = f"the agent ran past {named} {limit:g} s and was killed{said}"
        return StopReason.AGENT_TIMEOUT, killed
    if over_budget:
        return StopReason.TOKEN_BUDGET, f"the agent made {result.calls} calls, its limit (env.max_calls)"
    if not result.branches:
        return StopReason.AGENT_ERROR, f"the agent never called the model (exit code {exit.code}){said}"
    if exit.code not in scored:
        return StopReason.AGENT_ERROR, f"the agent exited with code {exit.code}{said}"
    return StopReason.AGENT_DONE, None


def as_member(traj: Trajectory, sample: Sample, index: int) -> Trajectory:
    """A branch as member ``index`` of ``sample``'s group (its id names the branch)."""
    branch = traj.branch.index if traj.branch else 0
    traj.id = f"{sample.id}/{index}" + (f"/{branch}" if branch else "")
    traj.group_id, traj.sample_index, traj.data_source = sample.id, index, sample.data_source
    return traj


class RewardError(ValueError):
    """The reward raised, or returned something that is not a score."""


@dataclass(frozen=True)
class Scores:
    """What the reward gave: a value per branch, and whether it scored branches one by one (a list)
    rather than the run (one number for all)."""

    values: list[float]
    per_branch: bool


def branch_rewards(fn: HarnessRewardFn, sample: Sample, result: HarnessResult) -> Scores | None:
    """Per branch, its reward: ``fn``'s float for every branch, its list (one per branch), or None
    (the run is left out). ``RewardError`` says in one line what was wrong."""
    try:
        value = fn(sample, result)
    except Exception as exc:
        at = raised_at(exc)
        where = f" at {at}" if at else ""
        raise RewardError(f"the reward raised {type(exc).__name__}{where}: {exc}") from None
    if value is None:
        return None
    n = len(result.branches)
    values = list(value) if isinstance(value, list | tuple) else [value] * n
    if len(values) != n:
        raise RewardError(f"the reward returned {len(values)} values for {n} branches")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise RewardError(f"the reward returned {v!r}: a finite number is needed")
    return Scores([float(v) for v in values], isinstance(value, list | tuple))
