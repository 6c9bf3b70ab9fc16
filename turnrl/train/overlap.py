"""Overlapped training (``train.overlap: true``): rollouts keep going while the trainer steps.

A producer walks the steps' prompts in order (the same prompts and seeds as the synchronous
trainer) and rolls out one GRPO group per prompt, at most ``train.max_inflight_groups`` groups
generating or waiting at once (default: ``max_staleness`` steps' worth, so a group is taken
before it grows too old), so memory stays flat however fast it runs. A step takes the next
finished groups off the queue (fastest first), screens them as the synchronous step does
(weight versions, failures, overlong shaping; with ``algorithm.dynamic_sampling``, groups with
all-equal rewards are skipped and the next ones taken, up to ``max_rounds`` steps' worth of groups,
as the synchronous step's rounds bound it), trains on them in a worker thread while
the producer and the engine go on, and pushes the new weights into the running engine. Requests
in flight go on under the new weights (a partial rollout across the update): every token keeps
the version that sampled it. The embedded engine swaps weights between two decode steps; vLLM
servers have their turns in flight aborted (keeping their tokens), reload, and each turn resumes
from its last token (``weight_sync.push_weights`` through the rollout's ``RolloutControl``).

The staleness bound is ``algorithm.max_staleness``: a group with a model token sampled more than
that many versions before the one serving now is refused at batch time and counted
(``train/refused_versions``); the importance correction (``algorithm.importance``) accounts for
the older tokens that are kept. Metrics: ``async/staleness/K`` (the share of a step's trained
model tokens sampled K versions back), ``async/staleness_max``, ``async/trainer_idle_s`` (the
step waiting for groups) and ``async/rollout_idle_s`` (the producer waiting for a free slot).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from turnrl.record.writer import JsonlWriter
from turnrl.rollout.collector import collect
from turnrl.rollout.spec import RolloutSpec
from turnrl.train.batch import step_prompts, step_seed
from turnrl.train.data_parallel import shard
from turnrl.train.rounds import StepCounts, StepRollout, fit_to_train, rollouts_path
from turnrl.train.state import Run
from turnrl.train.trainer import learn_from
from turnrl.types import Sample, Trajectory, weight_version


@dataclass
class Feed:
    """Finished groups, produced ahead of the trainer: at most ``limit`` generating or queued."""

    limit: int
    queue: asyncio.Queue[list[Trajectory]] = field(default_factory=asyncio.Queue)
    slots: asyncio.Semaphore = field(init=False)
    refills: asyncio.Semaphore = field(init=False)
    rollout_idle_s: float = 0.0  # the producer waiting for a free slot, since the last step took it
    task: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        self.slots = asyncio.Semaphore(self.limit)
        self.refills = asyncio.Semaphore(0)  # groups the steps dropped, to roll out past the last step

    async def stop(self) -> None:
        """Stop producing; groups in flight are cancelled."""
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


def start_feed(run: Run, first_step: int) -> Feed:
    """Start producing the groups of ``first_step`` up to the last step (``train.steps``)."""
    cfg = run.config
    # one step ahead per version of staleness allowed: a group started under the version a step
    # trains from is taken by a later step at most max_staleness versions on
    limit = cfg.train.max_inflight_groups or cfg.train.prompts_per_step * cfg.algorithm.max_staleness
    feed = Feed(limit)
    feed.task = asyncio.create_task(_produce(run, first_step, feed))
    return feed


async def _produce(run: Run, step: int, feed: Feed) -> None:
    """Roll out the groups of ``step`` and each later step up to the last (``train.steps``); past
    it, one group for each group a step dropped (refused, failed, flat), so the last steps fill up
    and nothing is rolled out that no step takes (it would only slow the last steps and the eval)."""
    cfg = run.config
    running: set[asyncio.Task[None]] = set()
    try:
        while True:
            prompts = shard(
                step_prompts(run.data.train, cfg.train.prompts_per_step, step - 1, cfg.seed), run.ranks
            )
            sampling = dataclasses.replace(run.spec.sampling, seed=step_seed(cfg.seed, step))
            spec = dataclasses.replace(run.spec, sampling=sampling)
            for prompt in prompts:
                if step > cfg.train.steps:
                    await feed.refills.acquire()
                t0 = time.perf_counter()
                await feed.slots.acquire()
                feed.rollout_idle_s += time.perf_counter() - t0
                task = asyncio.create_task(_group(run, spec, prompt, feed))
                running.add(task)
                task.add_done_callback(running.discard)
            step += 1
    finally:
        for task in list(running):
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


async def _group(run: Run, spec: RolloutSpec, prompt: Sample, feed: Feed) -> None:
    group = run.config.rollout.group_size
    trajs = await collect([prompt], spec, group_size=group, concurrency=group)
    await feed.queue.put(sorted(trajs, key=lambda t: t.sample_index))


async def overlapped_step(run: Run, step: int, feed: Feed) -> dict[str, float]:
    """Step ``step`` from the feed's next groups: screen, train (the feed goes on), push weights."""
    cfg = run.config
    t0, cpu0 = time.perf_counter(), time.process_time()
    target = len(shard(range(cfg.train.prompts_per_step), run.ranks))  # this rank's groups per step
    dynamic = cfg.algorithm.dynamic_sampling
    # dynamic sampling: at most max_rounds steps' worth of groups, as the synchronous step's rounds
    bound = target * dynamic.max_rounds if dynamic is not None else None
    counts, waited, taken = StepCounts(), 0.0, 0
    rolled: list[Trajectory] = []
    kept: list[list[Trajectory]] = []
    seen: Counter[str] = Counter()
    while len(kept) < target and (bound is None or taken < bound):
        t = time.perf_counter()
        group = await feed.queue.get()
        waited += time.perf_counter() - t
        feed.slots.release()
        taken += 1
        rolled += group
        batch = fit_to_train(run, group, counts)
        if dynamic is not None and len({t.reward for t in batch}) < 2:
            counts.shaped["dynamic/flat_groups"] += 1
            batch = []
        if batch:  # a prompt met twice in one batch (an epoch's end) stays two GRPO groups
            seen[batch[0].group_id] += 1
            if seen[batch[0].group_id] > 1:
                batch = [dataclasses.replace(t, group_id=f"{t.group_id}#{step}") for t in batch]
            kept.append(batch)
        elif bound is None or taken < bound:
            feed.refills.release()  # another group takes its place
    if dynamic is not None:
        counts.rounds = -(-taken // target)
        counts.shaped["dynamic/flat_groups"] += 0  # reported when none was flat too
        counts.shaped["dynamic/kept_groups"] += len(kept)
        counts.shaped["dynamic/short_groups"] += target - len(kept)
    trajs = [t for batch in kept for t in batch]
    _write(rollouts_path(run, step), rolled)
    metrics = staleness(trajs, weight_version(run.engine))
    metrics |= {"async/trainer_idle_s": waited, "async/rollout_idle_s": feed.rollout_idle_s}
    feed.rollout_idle_s = 0.0
    return metrics | await learn_from(run, StepRollout(rolled, trajs, counts), t0, cpu0)


def staleness(trajs: list[Trajectory], current: int) -> dict[str, float]:
    """The share of the trained model tokens sampled K weight versions before ``current``, per K."""
    behind = Counter(
        current - v
        for t in trajs
        for v, m in zip(t.policy_versions, t.loss_mask, strict=False)
        if m and v >= 0
    )
    total = sum(behind.values()) or 1
    out = {f"async/staleness/{k}": n / total for k, n in sorted(behind.items())}
    return out | {"async/staleness_max": float(max(behind, default=0))}


def _write(path: Path | None, trajs: list[Trajectory]) -> None:
    if path is None:
        return
    writer = JsonlWriter(path)
    try:
        for traj in trajs:
            writer.write(traj)
    finally:
        writer.close()
