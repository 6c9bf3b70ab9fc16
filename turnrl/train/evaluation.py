"""Held-out evaluation numbers: mean reward and pass@k per data source, with 95% confidence intervals.

One code path for ``turnrl eval`` and the trainer's periodic evaluation. A trajectory passes when
its reward is at least ``pass_reward``. pass@k is the unbiased estimator of Chen et al. (2021)
over the ``n`` trajectories of a prompt with ``c`` passes, ``1 - C(n-c, k) / C(n, k)``, defined
for ``k <= n``. Trajectories of one prompt are correlated, so the prompt is the unit of the
confidence interval: each prompt's value (its mean reward, its pass@k), then their mean
``± 1.96 · s / √P`` with ``s`` the sample standard deviation over the ``P`` prompts (a normal
approximation; none below two prompts; pass@k's clipped to [0, 1]).

Per prompt (a task of a task set, say: ``prompt_rows``), the unit is the attempt: pass@1's interval
is the Wilson score interval of its ``c`` passes in ``n`` attempts, and pass@k's is that interval
carried through ``1 - (1 - p)^k`` (the pass@k of independent attempts that each pass with ``p``);
the point estimates are the same unbiased ones as above.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from turnrl.rollout.collector import OnDone, collect
from turnrl.rollout.failures import check_failures
from turnrl.rollout.metrics import run_reward
from turnrl.rollout.spec import RolloutSpec
from turnrl.train.config import EvalConfig
from turnrl.types import Sample, Trajectory

ALL = "all"  # the row over every data source
Z95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval
EVAL_SEED_OFFSET = 1234  # evaluations sample with the run's seed + this: the same at every one


@dataclass
class Estimate:
    """A mean over prompts and its 95% confidence interval (None below two prompts)."""

    mean: float
    low: float | None = None
    high: float | None = None


@dataclass
class EvalRow:
    """The numbers of one data source (or of all, ``ALL``)."""

    data_source: str
    prompts: int
    trajectories: int
    reward: Estimate
    pass_at: dict[int, Estimate] = field(default_factory=dict)  # k -> pass@k


@dataclass
class PromptRow:
    """The numbers of one held-out prompt (its sample id: a task's name for a task set)."""

    prompt: str
    data_source: str
    attempts: int
    passes: int
    reward: float  # the mean over its attempts
    pass_at: dict[int, Estimate] = field(default_factory=dict)  # k -> pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of ``k`` of ``n`` samples (``c`` of them correct) passes."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def estimate(values: Sequence[float], bounds: tuple[float, float] | None = None) -> Estimate:
    """The mean of per-prompt ``values`` with its normal-approximation 95% interval, clipped to
    ``bounds`` where the quantity has them (a rate lies in [0, 1])."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return Estimate(mean)
    half = Z95 * statistics.stdev(values) / math.sqrt(len(values))
    low, high = mean - half, mean + half
    if bounds is not None:
        low, high = max(low, bounds[0]), min(high, bounds[1])
    return Estimate(mean, low, high)


def wilson(n: int, c: int) -> tuple[float, float]:
    """The 95% Wilson score interval of a rate with ``c`` successes in ``n`` trials (n >= 1)."""
    z2 = Z95 * Z95
    center = (c + z2 / 2) / (n + z2)
    half = Z95 * math.sqrt(c * (n - c) / n + z2 / 4) / (n + z2)
    return max(0.0, center - half), min(1.0, center + half)


def prompt_rows(
    trajs: Sequence[Trajectory], ks: Sequence[int] = (1,), pass_reward: float = 1.0
) -> list[PromptRow]:
    """One row per prompt, in the order first seen: its attempts, passes, mean reward and pass@k
    for each ``k`` up to its attempts, each with a 95% interval over its attempts."""
    rows = []
    for prompt, group in _by_prompt(trajs).items():
        n, c = len(group), sum(t.score >= pass_reward for t in group)
        low, high = wilson(n, c)
        row = PromptRow(prompt, group[0].data_source or "", n, c, statistics.fmean(t.score for t in group))
        for k in ks:
            if k <= n:
                row.pass_at[k] = Estimate(pass_at_k(n, c, k), 1 - (1 - low) ** k, 1 - (1 - high) ** k)
        rows.append(row)
    return rows


def _row(source: str, groups: list[list[Trajectory]], ks: Sequence[int], pass_reward: float) -> EvalRow:
    size = min(len(g) for g in groups)
    row = EvalRow(
        source,
        prompts=len(groups),
        trajectories=sum(len(g) for g in groups),
        reward=estimate([statistics.fmean(t.score for t in g) for g in groups]),
    )
    for k in ks:
        if k <= size:  # every prompt has at least k trajectories
            passes = [pass_at_k(len(g), sum(t.score >= pass_reward for t in g), k) for g in groups]
            row.pass_at[k] = estimate(passes, (0.0, 1.0))
    return row


def one_per_run(trajs: Sequence[Trajectory]) -> list[Trajectory]:
    """Each run once: an agent harness run's branches (``branch``) count as one trajectory with the
    run's reward (``run_reward``), as pass@k counts attempts."""
    out: list[Trajectory] = []
    seen: set[tuple[str, int]] = set()
    for traj in trajs:
        if traj.branch is None:
            out.append(traj)
        elif (traj.group_id, traj.sample_index) not in seen:
            seen.add((traj.group_id, traj.sample_index))
            out.append(dataclasses.replace(traj, reward=run_reward(traj)))
    return out


def _by_prompt(trajs: Sequence[Trajectory]) -> dict[str, list[Trajectory]]:
    """Each prompt's runs (``one_per_run``), in the order first seen."""
    groups: dict[str, list[Trajectory]] = {}
    for traj in one_per_run(trajs):
        groups.setdefault(traj.group_id, []).append(traj)
    return groups


def eval_rows(
    trajs: Sequence[Trajectory], ks: Sequence[int] = (1,), pass_reward: float = 1.0
) -> list[EvalRow]:
    """One row per data source (sorted), then the ``ALL`` row; empty for no trajectories. pass@k is
    given for each ``k`` that every prompt has enough trajectories for."""
    groups = _by_prompt(trajs)
    by_source: dict[str, list[list[Trajectory]]] = {}
    for group in groups.values():
        by_source.setdefault(group[0].data_source or "", []).append(group)
    if not groups:
        return []
    rows = [_row(source, by_source[source], ks, pass_reward) for source in sorted(by_source)]
    everything = [g for source in sorted(by_source) for g in by_source[source]]
    return (
        [*rows, _row(ALL, everything, ks, pass_reward)]
        if len(rows) > 1
        else [_row(ALL, everything, ks, pass_reward)]
    )


def eval_metrics(rows: Sequence[EvalRow], prefix: str = "eval/") -> dict[str, float]:
    """The rows as flat scalars: ``eval/pass@1``, ``eval/reward/ci95_low``...; per data source
    under ``eval/<source>/``."""
    out: dict[str, float] = {}
    for row in rows:
        head = prefix if row.data_source == ALL else f"{prefix}{row.data_source or 'unnamed'}/"
        named = {"reward/mean": row.reward, **{f"pass@{k}": e for k, e in row.pass_at.items()}}
        for name, e in named.items():
            out[head + name] = e.mean
            if e.low is not None and e.high is not None:
                out[f"{head}{name}/ci95_low"], out[f"{head}{name}/ci95_high"] = e.low, e.high
    return out


def write_report(
    path: Path, rows: Sequence[EvalRow], about: dict[str, Any], prompts: Sequence[PromptRow] = ()
) -> None:
    """``rows`` (and each prompt's, ``prompts``) as JSON with what was evaluated (``about``: model,
    data, sampling...)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {**about, "rows": [asdict(r) for r in rows], "prompts_rows": [asdict(r) for r in prompts]}
    path.write_text(json.dumps(payload, indent=2) + "\n")


def _cell(e: Estimate) -> str:
    if e.low is None or e.high is None:
        return f"{e.mean:.3f}"
    return f"{e.mean:.3f} [{e.low:.3f}, {e.high:.3f}]"


def report_table(rows: Sequence[EvalRow], title: str = "held-out evaluation") -> Table:
    """A short table: per data source, prompts, trajectories, reward and pass@k with 95% CIs."""
    ks = sorted({k for r in rows for k in r.pass_at})
    table = Table(title=f"{title}: mean [95% interval over prompts]")
    for name in ("data source", "prompts", "trajectories", "reward", *(f"pass@{k}" for k in ks)):
        table.add_column(name, justify="left" if name == "data source" else "right")
    for r in rows:
        passes = [_cell(r.pass_at[k]) if k in r.pass_at else "-" for k in ks]
        table.add_row(
            r.data_source or "(none)", str(r.prompts), str(r.trajectories), _cell(r.reward), *passes
        )
    return table


def prompt_table(rows: Sequence[PromptRow], title: str = "per prompt") -> Table:
    """A row per prompt: attempts, passes, mean reward, pass@k with 95% intervals over its attempts."""
    ks = sorted({k for r in rows for k in r.pass_at})
    table = Table(title=f"{title}: pass@k [95% interval over its attempts]")
    for name in ("prompt", "data source", "attempts", "passes", "reward", *(f"pass@{k}" for k in ks)):
        table.add_column(name, justify="left" if name in ("prompt", "data source") else "right")
    for r in rows:
        passes = [_cell(r.pass_at[k]) if k in r.pass_at else "-" for k in ks]
        table.add_row(
            r.prompt, r.data_source or "(none)", str(r.attempts), str(r.passes), f"{r.reward:.3f}", *passes
        )
    return table


async def run_eval(
    samples: Sequence[Sample],
    spec: RolloutSpec,
    config: EvalConfig,
    seed: int,
    *,
    concurrency: int,
    out_path: Path,
    on_done: OnDone | None = None,
    fail_fraction: float = 0.5,
) -> tuple[list[Trajectory], list[EvalRow]]:
    """Roll out ``samples`` with the evaluation's sampling (``config.temperature``, base ``seed``:
        the same at every evaluation, so they compare), ``config.group_size`` per prompt, trajectories
        written to ``out_path`` (``.jsonl``); then the rows, also written beside it as ``.json``. More
    than ``fail_fraction`` of them failed: ``RunFailed``, and no rows."""
    sampling = dataclasses.replace(spec.sampling, temperature=config.temperature, seed=seed)
    out_path.unlink(missing_ok=True)
    trajs = await collect(
        list(samples),
        dataclasses.replace(spec, sampling=sampling),
        group_size=config.group_size,
        concurrency=concurrency,
        out_path=out_path,
        on_done=on_done,
    )
    check_failures(trajs, fail_fraction, "the evaluation")  # its trajectories stay on disk
    rows = eval_rows(trajs, config.k, config.pass_reward)
    about = {
        "prompts": len(samples),
        "group_size": config.group_size,
        "temperature": config.temperature,
        "seed": seed,
        "pass_reward": config.pass_reward,
        "trajectories": out_path.name,
    }
    write_report(out_path.with_suffix(".json"), rows, about, prompt_rows(trajs, config.k, config.pass_reward))
    return trajs, rows
