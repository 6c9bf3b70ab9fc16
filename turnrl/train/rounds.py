"""A step's rollout: its prompts rolled out in rounds, and what of it is fit to train on.

One round rolls out ``group_size`` trajectories per prompt, seeded by step and round. A trajectory
is fit to train on when an allowed weight version sampled every model token, no failure ended it,
and overlong shaping kept it (``fit_to_train``). With ``algorithm.dynamic_sampling`` only groups
with varied rewards count, and rounds refill the step from unused prompts; with
``train.oversample_groups`` one round rolls out more groups than the step needs and stops the rest
once enough are complete.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from turnrl.rollout.collector import collect
from turnrl.rollout.control import RolloutControl
from turnrl.train.advantages import groups
from turnrl.train.batch import step_prompts, step_seed, unexpected_versions
from turnrl.train.data_parallel import shard
from turnrl.train.exclusions import exclude_failures
from turnrl.train.shaping import refill_count, refill_prompts, shape_overlong, varied_groups
from turnrl.train.state import Run
from turnrl.types import Sample, StopReason, Trajectory, weight_version


@dataclass
class StepCounts:
    """What the rounds of a step's rollout left out or shaped, summed over its rounds."""

    refused: int = 0  # trajectories with tokens of an unexpected weight version
    excluded: Counter[str] = field(default_factory=Counter)  # failures left out, per stop reason
    shaped: Counter[str] = field(default_factory=Counter)  # overlong/... and dynamic/... counts
    rounds: int = 0

    def metrics(self) -> dict[str, float]:
        out = {k: float(v) for k, v in sorted(self.shaped.items())}
        return out | ({"dynamic/rounds": float(self.rounds)} if "dynamic/flat_groups" in self.shaped else {})


@dataclass
class StepRollout:
    """A step's rollout: every trajectory rolled out, those to train on, and what was left out."""

    rolled: list[Trajectory]
    trainable: list[Trajectory]
    counts: StepCounts


def rollouts_path(run: Run, step: int) -> Path | None:
    """Where step ``step`` writes its trajectories (``train.save_rollouts``), emptied for the step."""
    if not run.config.train.save_rollouts:
        return None
    name = f"step_{step:06d}" + (f".rank{run.ranks.rank}" if run.ranks.distributed else "")
    out_path = run.out_dir / "rollouts" / f"{name}.jsonl"
    out_path.unlink(missing_ok=True)  # a resumed run redoes the step
    return out_path


async def step_rollout(run: Run, step: int) -> StepRollout:
    """Roll out this rank's share of the step's prompts (refilled round after round under dynamic
    sampling, or over-sampled), and keep what is fit to train on."""
    cfg, algo = run.config, run.config.algorithm
    out_path = rollouts_path(run, step)
    chosen = step_prompts(run.data.train, cfg.train.prompts_per_step, step - 1, cfg.seed)
    prompts = shard(chosen, run.ranks)  # this rank's share (all of them in one process)
    pool = shard([s for s in run.data.train if s.id not in {p.id for p in chosen}], run.ranks)
    if cfg.train.oversample_groups:
        return await _oversampled(run, step, prompts, pool, out_path)
    target, counts = len(prompts), StepCounts()
    rolled: list[Trajectory] = []
    keep: list[Trajectory] = []
    tried = 0
    while prompts:
        counts.rounds += 1
        new = await rollout_round(run, prompts, step, counts.rounds, out_path)
        rolled += new
        tried += len(prompts)
        fit = fit_to_train(run, new, counts)
        if algo.dynamic_sampling is None:
            return StepRollout(rolled, fit, counts)
        varied, flat = varied_groups(fit)
        keep += varied
        counts.shaped["dynamic/flat_groups"] += flat
        have = len(groups(keep))
        if have >= target or counts.rounds >= algo.dynamic_sampling.max_rounds:
            break
        prompts = refill_prompts(
            pool, refill_count(target - have, have, tried), cfg.seed, step, counts.rounds
        )
        drawn = {p.id for p in prompts}
        pool = [s for s in pool if s.id not in drawn]
    kept_groups = list(groups(keep).values())[:target]
    counts.shaped["dynamic/kept_groups"] += len(kept_groups)
    counts.shaped["dynamic/short_groups"] += target - len(kept_groups)
    return StepRollout(rolled, [keep[i] for members in kept_groups for i in members], counts)


async def rollout_round(
    run: Run,
    prompts: list[Sample],
    step: int,
    round_: int,
    out_path: Path | None,
    target_groups: int | None = None,
) -> list[Trajectory]:
    """One rollout round of a step: ``group_size`` trajectories per prompt, seeded by step and round;
    with ``target_groups``, the slowest are stopped once that many groups are complete."""
    cfg = run.config
    seed = step_seed(cfg.seed, step) + 7919 * (round_ - 1)
    spec = dataclasses.replace(run.spec, sampling=dataclasses.replace(run.spec.sampling, seed=seed))
    if target_groups is not None:  # a control of the round's own: stopping it ends only this round
        spec = dataclasses.replace(spec, control=RolloutControl(weight_version(run.engine)))
    group = cfg.rollout.group_size
    label = f"step {step} rollout" + (f" (round {round_})" if round_ > 1 else "")
    trajs = await collect(
        prompts,
        spec,
        group_size=group,
        concurrency=cfg.rollout.concurrency,
        out_path=out_path,
        on_done=run.phase(label, len(prompts) * group),
        target_groups=target_groups,
    )
    return sorted(trajs, key=lambda t: (t.group_id, t.sample_index))


def complete_groups(trajs: list[Trajectory]) -> tuple[list[Trajectory], int]:
    """The groups none of whose members over-sampling stopped (``aborted``), and how many were stopped."""
    stopped = {t.group_id for t in trajs if t.stop_reason == StopReason.ABORTED}
    return [t for t in trajs if t.group_id not in stopped], len(stopped)


async def _oversampled(
    run: Run, step: int, prompts: list[Sample], pool: list[Sample], out_path: Path | None
) -> StepRollout:
    """Roll out ``train.oversample_groups`` more groups than the step needs (this rank's share of
    them); once the step's number of groups is complete, the rest are stopped and left out."""
    cfg, counts = run.config, StepCounts(rounds=1)
    extra = refill_prompts(pool, cfg.train.oversample_groups, cfg.seed, step, 0)
    rolled = await rollout_round(run, prompts + extra, step, 1, out_path, target_groups=len(prompts))
    complete, stopped = complete_groups(rolled)
    counts.shaped["oversample/stopped_groups"] += stopped
    return StepRollout(rolled, fit_to_train(run, complete, counts), counts)


def fit_to_train(run: Run, trajs: list[Trajectory], counts: StepCounts) -> list[Trajectory]:
    """The trajectories fit to train on: sampled by allowed weight versions, not ended by a
    failure, overlong-shaped (``algorithm.overlong``); what was left out is added to ``counts``."""
    algo = run.config.algorithm
    fit, refused = _allowed_versions(run, trajs)
    fit, excluded = exclude_failures(fit, algo.train_on_failures)
    counts.refused += refused
    counts.excluded += excluded
    if algo.overlong is not None:
        o = algo.overlong
        fit, shaped = shape_overlong(fit, o.max_tokens, o.buffer, o.penalty, o.mask_truncated)
        counts.shaped.update(shaped)
    return fit


def _allowed_versions(run: Run, trajs: list[Trajectory]) -> tuple[list[Trajectory], int]:
    """The trajectories whose every model token the engine sampled with an allowed weight version
    (the current one, or up to ``algorithm.max_staleness`` older); the others are refused, each
    named in a console line, and counted."""
    current = weight_version(run.engine)
    refused = unexpected_versions(trajs, current, run.config.algorithm.max_staleness)
    if not refused:
        return trajs, 0
    shown = "; ".join(
        f"{t.group_id}#{t.sample_index}: versions {sorted({v for v in t.policy_versions if v >= 0})}"
        for t in refused[:3]
    )
    more = " ..." if len(refused) > 3 else ""
    run.console.print(
        f"refusing {len(refused)} trajectories not sampled by weight version {current}: {shown}{more}"
    )
    return [t for t in trajs if all(t is not r for r in refused)], len(refused)
