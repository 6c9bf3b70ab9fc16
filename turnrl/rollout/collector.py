"""Many trajectories at once: groups of n per prompt, a concurrency bound, written as they finish."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

from turnrl.record.codec import trajectory_from_json
from turnrl.record.episode import failed_trajectory
from turnrl.record.writer import JsonlWriter
from turnrl.rollout.loop import TURN_LOOP
from turnrl.rollout.spec import RolloutSpec
from turnrl.support.errors import describe
from turnrl.types import Sample, StopReason, Trajectory, as_abortable

OnDone = Callable[[Trajectory], None]


Done = set[tuple[str, int]]
"""(group id, sample index) pairs already finished."""


async def iter_trajectories(
    samples: Sequence[Sample],
    spec: RolloutSpec,
    *,
    group_size: int = 1,
    concurrency: int = 32,
    skip: Done | None = None,
    target_groups: int | None = None,
) -> AsyncIterator[Trajectory]:
    """Run ``group_size`` trajectories per sample as independent tasks; yield each as soon as it finishes.

    Each trajectory is its own asyncio task (request level, not batch level): a slow one
    never holds back the others, and the engine batches whatever is in flight. Pairs in
    ``skip`` (already on disk) are not run again. With ``target_groups`` (over-sampling),
    once that many groups are complete the rest are stopped through ``spec.control``: they
    come back promptly with stop reason ``aborted`` and the tokens they had. A data source with
    a group reward (``spec.rewards.groups``) yields its groups whole, once rescored together.
    """
    if target_groups is not None and spec.control is None:
        raise ValueError("target_groups needs spec.control (a RolloutControl) to stop the slowest groups")
    left = {s.id: group_size for s in samples}
    complete = 0
    gate = asyncio.Semaphore(concurrency)
    skip = skip or set()

    async def one(sample: Sample, index: int) -> list[Trajectory]:
        async with gate:
            try:
                runner = spec.runner or TURN_LOOP  # an agent harness: the branches of one run
                return await runner(sample, index, spec)
            except Exception as exc:  # a bug in one trajectory never takes the others down
                return [
                    failed_trajectory(sample, index, f"internal: {describe(exc)}", StopReason.INTERNAL_ERROR)
                ]

    pairs = [(s, k) for s in samples for k in range(group_size) if (s.id, k) not in skip]
    by_id = {s.id: s for s in samples}
    held: dict[str, list[Trajectory]] = {}  # groups waiting for their group reward
    tasks = [asyncio.create_task(one(s, k)) for s, k in pairs]
    try:
        for next_done in asyncio.as_completed(tasks):
            run = await next_done
            group_id = run[0].group_id
            left[group_id] -= 1
            complete += left[group_id] == 0
            control = spec.control
            if target_groups is not None and complete >= target_groups and control and not control.stopped:
                await control.stop(as_abortable(spec.engine))
            if spec.rewards.group_fn_for(run[0].data_source) is None:
                for traj in run:
                    yield traj
                continue
            group = held.setdefault(group_id, [])
            group += run
            if left[group_id] == 0:
                await spec.rewards.score_group(by_id[group_id], held.pop(group_id))
                for member in sorted(group, key=lambda t: t.sample_index):
                    yield member
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(
    samples: Sequence[Sample],
    spec: RolloutSpec,
    *,
    group_size: int = 1,
    concurrency: int = 32,
    out_path: Path | None = None,
    on_done: OnDone | None = None,
    skip: Done | None = None,
    target_groups: int | None = None,
    seed: int | None = None,
) -> list[Trajectory]:
    """Run everything; write each trajectory to ``out_path`` (JSONL) the moment it finishes.

    ``target_groups`` over-samples: see ``iter_trajectories``. ``seed`` makes the run reproducible:
    every request's sampling seed and every env's seed derive from it (None: ``spec.sampling.seed``).
    """
    if seed is not None:
        spec = dataclasses.replace(spec, sampling=dataclasses.replace(spec.sampling, seed=seed))
    writer = JsonlWriter(out_path) if out_path else None
    done: list[Trajectory] = []
    try:
        trajs = iter_trajectories(
            samples,
            spec,
            group_size=group_size,
            concurrency=concurrency,
            skip=skip,
            target_groups=target_groups,
        )
        async for traj in trajs:
            if writer:
                writer.write(traj)
            done.append(traj)
            if on_done:
                on_done(traj)
    finally:
        if writer:
            writer.close()
    return done


def starts_a_run(traj: Trajectory) -> bool:
    """Whether ``traj`` is a group member's first (or only) trajectory: an agent harness run's later
    branches belong to a run already counted."""
    return traj.branch is None or traj.branch.index == 0


def read_trajectories(path: Path) -> list[Trajectory]:
    """Load a trajectories.jsonl file."""
    with path.open(encoding="utf-8") as f:
        return [trajectory_from_json(json.loads(line)) for line in f if line.strip()]


def recover(path: Path, say: Callable[[str], None] | None = None) -> tuple[list[Trajectory], int]:
    """Trajectories already on disk, for a resume; returns them and the number of lines dropped.

    A last line cut short by a crash is removed from the file (so appends stay valid JSONL); a
    pair that somehow appears twice is kept once. A complete line that does not parse (a corrupt
    record) is moved to ``PATH.corrupt`` and reported through ``say`` with its line number: its
    trajectory runs again.
    """
    if not path.exists():
        return [], 0
    raw = path.read_bytes()
    keep = raw[: raw.rfind(b"\n") + 1]  # everything up to the last complete line
    dropped = 1 if len(keep) < len(raw) else 0
    trajs: list[Trajectory] = []
    seen: Done = set()
    lines = keep.decode("utf-8", errors="replace").splitlines(keepends=True)
    clean: list[str] = []
    corrupt: list[str] = []
    for number, line in enumerate(lines, start=1):
        try:
            traj = trajectory_from_json(json.loads(line))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            dropped += 1
            corrupt.append(line)
            if say is not None:
                why = exc.msg if isinstance(exc, json.JSONDecodeError) else describe(exc)
                kept = f"kept in {path.name}.corrupt"
                say(f"{path}:{number}: a corrupt record ({why}): {kept}, its trajectory runs again")
            continue
        if (traj.group_id, traj.sample_index) in seen:
            dropped += 1
            continue
        seen.add((traj.group_id, traj.sample_index))
        trajs.append(traj)
        clean.append(line)
    if corrupt:
        with path.with_name(path.name + ".corrupt").open("a", encoding="utf-8") as f:
            f.write("".join(corrupt))
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(clean), encoding="utf-8")
        os.replace(tmp, path)
    return trajs, dropped


def keep_turns_of(path: Path, finished: Done) -> int:
    """Rewrite the turn log ``path`` (turns.jsonl) with only the turns of ``finished`` trajectories:
    the turns of one cut off by a crash are logged again when it reruns, exactly once. Returns the
    number of turn records dropped."""
    if not path.exists():
        return 0
    keep, dropped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
        try:
            group, _, index = json.loads(line)["trajectory"].rpartition("/")
            done = (group, int(index)) in finished and line.endswith("\n")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            done = False
        if done:
            keep.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(keep), encoding="utf-8")
        os.replace(tmp, path)
    return dropped
