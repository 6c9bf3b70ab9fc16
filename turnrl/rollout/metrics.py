"""Run-level and turn-level metrics: what a run did, in numbers, for the console and summary.json."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from turnrl.rollout.failures import FAILURES
from turnrl.types import Trajectory

TOOL_COUNTS = ("num_tool_calls", "num_tool_errors", "num_parse_errors", "num_truncated_outputs")


def run_of(traj: Trajectory) -> tuple[str, int] | int:
    """The run a trajectory belongs to: an agent harness run may leave several branches (``branch``),
    one run of its group member; any other trajectory is a run of its own."""
    return (traj.group_id, traj.sample_index) if traj.branch is not None else id(traj)


def run_reward(traj: Trajectory) -> float:
    """The reward of the run ``traj`` belongs to: its branches' own may differ (a reward that scored
    branches); the run's is ``run.reward`` (else the trajectory's)."""
    return traj.run.reward if traj.run is not None and traj.run.reward is not None else traj.score


def runs(trajs: Iterable[Trajectory]) -> dict[tuple[str, int] | int, list[Trajectory]]:
    """The trajectories of each run, in order."""
    out: dict[tuple[str, int] | int, list[Trajectory]] = {}
    for traj in trajs:
        out.setdefault(run_of(traj), []).append(traj)
    return out


def run_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Rewards per run, as a user counts: ``reward/mean`` and ``reward/std`` over runs (a failed run's
    0 included), ``reward/scored_mean`` over the runs that did not fail, ``runs`` and ``branches``
    (trajectories: an agent harness run leaves one per branch of its session)."""
    members = list(runs(trajs).values())
    rewards = [run_reward(run[0]) for run in members]
    scored = [run_reward(run[0]) for run in members if run[0].stop_reason not in FAILURES]
    return {
        "runs": len(members),
        "branches": len(trajs),
        "reward/mean": statistics.fmean(rewards),
        "reward/std": statistics.pstdev(rewards),
        "reward/scored_mean": statistics.fmean(scored) if scored else 0.0,
    }


def _quantiles(values: Sequence[float]) -> dict[str, float]:
    """Mean, p50, p90, p99 and max of ``values`` (empty: nothing)."""
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "mean": statistics.fmean(ordered),
        "p50": at(0.5),
        "p90": at(0.9),
        "p99": at(0.99),
        "max": ordered[-1],
    }


def _add(counter: Counter[str], items: Iterable[tuple[str, int]]) -> None:
    for key, value in items:
        counter[key] += int(value)


def error_kind(traj: Trajectory) -> str:
    """What kind of error ended ``traj``: its stop reason, where it failed, and the exception's type
    when the error names one (``engine_error/engine/ServerError``, ``env_error/step``)."""
    where, _, rest = (traj.error or "").partition(": ")
    kind = f"{traj.stop_reason.value}/{where}"
    exc = rest.partition(":")[0]
    return f"{kind}/{exc}" if exc.isidentifier() else kind


def _turn_timings(trajs: Sequence[Trajectory]) -> dict[str, dict[str, float]]:
    """Per-turn seconds by phase (generate, env, encode) across all turns."""
    phases: dict[str, list[float]] = {}
    for traj in trajs:
        for turn in traj.turns:
            for phase, seconds in turn.timings.items():
                phases.setdefault(phase, []).append(seconds)
    return {phase: _quantiles(values) for phase, values in sorted(phases.items())}


def summarize(trajs: Sequence[Trajectory]) -> dict[str, Any]:
    """Rewards, turns, stop reasons, env failures by kind, tool calls, tokens, timings, check results."""
    if not trajs:
        return {"trajectories": 0}
    failures: Counter[str] = Counter()
    info: Counter[str] = Counter()
    by_source: dict[str, list[float]] = {}
    for t in trajs:
        _add(failures, t.metrics.get("env_failures", {}).items())
        _add(info, ((k, v) for k, v in t.info.items() if k in TOOL_COUNTS))
        by_source.setdefault(t.data_source, []).append(t.score)
    count = len(trajs)
    return {
        "trajectories": count,
        **run_metrics(trajs),
        "reward/by_data_source": {k: statistics.fmean(v) for k, v in sorted(by_source.items())},
        "turns/mean": statistics.fmean(t.num_turns for t in trajs),
        "turns/histogram": dict(sorted(Counter(t.num_turns for t in trajs).items())),
        "stop_reasons": dict(sorted(Counter(t.stop_reason.value for t in trajs).items())),
        "truncated/ratio": sum(t.truncated for t in trajs) / count,
        "env_retries": sum(int(t.metrics.get("env_retries", 0)) for t in trajs),
        "env_failures/by_kind": dict(sorted(failures.items())),
        "tool_calls": info.get("num_tool_calls", 0),
        "tool_errors": info.get("num_tool_errors", 0),
        "tool_parse_errors": info.get("num_parse_errors", 0),
        "tool_truncated_outputs": info.get("num_truncated_outputs", 0),
        "tokens/model_mean": statistics.fmean(sum(t.loss_mask) for t in trajs),
        "tokens/response_mean": statistics.fmean(len(t.response_ids) for t in trajs),
        "check/mismatched_trajectories": sum(1 for t in trajs if t.metrics.get("check/ok") is False),
        "time/turn_seconds": _turn_timings(trajs),
        "errors/by_kind": dict(sorted(Counter(error_kind(t) for t in trajs if t.error).items())),
        "errors/top": dict(Counter(t.error for t in trajs if t.error).most_common(3)),
        "observations/truncated": sum(int(t.metrics.get("observations/truncated", 0)) for t in trajs),
        **_judge_totals(trajs),
    }


def _judge_totals(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """What LLM judges cost over the run (seconds, tokens, cached replies), when any judged."""
    keys = ("judge/seconds", "judge/prompt_tokens", "judge/completion_tokens", "judge/cached")
    if not any(keys[0] in t.metrics for t in trajs):
        return {}
    return {key: round(sum(float(t.metrics.get(key, 0)) for t in trajs), 3) for key in keys}


def turn_record(group_id: str, sample_index: int, index: int, turn: Any) -> dict[str, Any]:
    """One line of turns.jsonl: a turn as it happened (no token ids; those are in the trajectory)."""
    return {
        "trajectory": f"{group_id}/{sample_index}",
        "turn": index,
        "role": turn.role,
        "tokens": turn.end - turn.start,
        "finish_reason": turn.finish_reason,
        "reward": turn.reward,
        "env_retries": turn.env_retries,
        "timings": turn.timings,
        "info": turn.info,
        "text": turn.text,
    }
