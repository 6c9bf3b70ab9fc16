"""Many trajectories at once: groups of n per prompt, a concurrency bound, written as they finish."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import IO, Any

from turnrl.rollout.loop import RolloutSpec, run_trajectory
from turnrl.types import Sample, Trajectory

OnDone = Callable[[Trajectory], None]


async def iter_trajectories(
    samples: Sequence[Sample], spec: RolloutSpec, n: int = 1, concurrency: int = 32
) -> AsyncIterator[Trajectory]:
    """Run ``n`` trajectories per sample as independent tasks; yield each as soon as it finishes.

    Each trajectory is its own asyncio task (request level, not batch level): a slow one
    never holds back the others, and the engine batches whatever is in flight.
    """
    gate = asyncio.Semaphore(concurrency)

    async def one(sample: Sample, index: int) -> Trajectory:
        async with gate:
            return await run_trajectory(sample, spec, index)

    tasks = [asyncio.create_task(one(s, k)) for s in samples for k in range(n)]
    try:
        for next_done in asyncio.as_completed(tasks):
            yield await next_done
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class JsonlWriter:
    """Appends one trajectory per line and flushes, so a crash loses nothing already finished."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None

    def write(self, traj: Trajectory) -> None:
        """Append and flush one trajectory."""
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(json.dumps(traj.to_dict(), ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


async def collect(
    samples: Sequence[Sample],
    spec: RolloutSpec,
    n: int = 1,
    concurrency: int = 32,
    out_path: Path | None = None,
    on_done: OnDone | None = None,
) -> list[Trajectory]:
    """Run everything; write each trajectory to ``out_path`` (JSONL) the moment it finishes."""
    writer = JsonlWriter(out_path) if out_path else None
    done: list[Trajectory] = []
    try:
        async for traj in iter_trajectories(samples, spec, n, concurrency):
            if writer:
                writer.write(traj)
            done.append(traj)
            if on_done:
                on_done(traj)
    finally:
        if writer:
            writer.close()
    return done


def read_trajectories(path: Path) -> list[Trajectory]:
    """Load a trajectories.jsonl file."""
    with path.open(encoding="utf-8") as f:
        return [Trajectory.from_dict(json.loads(line)) for line in f if line.strip()]


def summarize(trajs: Sequence[Trajectory]) -> dict[str, Any]:
    """Run-level metrics: rewards, turns, stop reasons, tokens, sanity-check mismatches."""
    if not trajs:
        return {"trajectories": 0}
    stops: dict[str, int] = {}
    for t in trajs:
        stops[t.stop_reason.value] = stops.get(t.stop_reason.value, 0) + 1
    count = len(trajs)
    return {
        "trajectories": count,
        "reward/mean": sum(t.reward for t in trajs) / count,
        "turns/mean": sum(t.num_turns for t in trajs) / count,
        "turns/max": max(t.num_turns for t in trajs),
        "stop_reasons": dict(sorted(stops.items())),
        "truncated/ratio": sum(t.truncated for t in trajs) / count,
        "tokens/model_mean": sum(sum(t.loss_mask) for t in trajs) / count,
        "tokens/response_mean": sum(len(t.response_ids) for t in trajs) / count,
        "check/mismatched_trajectories": sum(1 for t in trajs if t.metrics.get("check/ok") is False),
        "env_retries": sum(int(t.metrics.get("env_retries", 0)) for t in trajs),
    }
