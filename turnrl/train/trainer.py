"""One training step, in order: roll out, score, advantages, samples, update, push weights.

``train_step`` reads top to bottom:

1. the step's rollout (``rounds.step_rollout``): ``group_size`` trajectories per prompt, every
   request seeded by step and round, and the ones fit to train on (allowed weight versions, no
   failures, overlong-shaped; dynamic sampling and over-sampling refill or stop groups);
2. ``learn_from`` that rollout: stop the run if too many trajectories failed; advantages per model
   turn (``algorithm.advantage``); training samples (``algorithm.samples``: one per trajectory, or
   one per model turn); micro-batches; the update (``update.update``: old and reference logprobs,
   then ``ppo_epochs`` x ``mini_batches`` optimizer steps) in a worker thread, so rollouts in flight
   go on meanwhile; the new weights pushed into the engine (``weight_sync.push_weights``).

The prompts of a step are a function of the seed and the step only, so a resumed run gets the very
batch the interrupted one would have. ``loop`` runs the steps, evaluation and checkpoints;
``overlap`` runs the same ``learn_from`` on groups rolled out ahead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from turnrl.rollout.failures import check_failures
from turnrl.train.advantages import compute_advantages
from turnrl.train.batch import Batch, TrainSample, batches_of, build_samples, packs
from turnrl.train.data_parallel import Ranks, gather, param_spread, sum_across
from turnrl.train.evaluation import EVAL_SEED_OFFSET, eval_metrics, run_eval
from turnrl.train.exclusions import exclusion_metrics, forest_metrics
from turnrl.train.logprobs import shares_prefixes
from turnrl.train.metrics import cpu_metrics, rollout_metrics
from turnrl.train.rounds import StepRollout, step_rollout
from turnrl.train.state import Run
from turnrl.train.update import update
from turnrl.train.weight_sync import push_weights
from turnrl.types import Trajectory


async def train_step(run: Run, step: int) -> dict[str, float]:
    """Step ``step`` (from 1): its rollout, then the update and the weight push; its metrics."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    rollout = await step_rollout(run, step)
    return await learn_from(run, rollout, t0, cpu0)


async def learn_from(run: Run, rollout: StepRollout, t0: float, cpu0: float) -> dict[str, float]:
    """From a step's rollout to an optimizer update and the weight push; the step's metrics (its
    times from ``t0``, wall, and ``cpu0``, this process's CPU)."""
    cfg, algo, ranks = run.config, run.config.algorithm, run.ranks
    t1 = time.perf_counter()
    # 1. every rank's trajectories: too many failures stop the run (every rank decides alike)
    every = _every_ranks(rollout.rolled, ranks)
    check_failures(every, cfg.rollout.fail_fraction, f"training step {run.step + 1}")
    metrics = rollout_metrics(every) | rollout.counts.metrics() | forest_metrics(every)
    metrics["train/turns_cut_fraction"] = cut_fraction(every)
    # 2. advantages per model turn, then the training samples
    trajs = rollout.trainable
    advantages = compute_advantages(algo.advantage, trajs, algo.advantage_options())
    samples = build_samples(algo.samples, trajs, advantages, algo.loss_turns)
    tokens = sum(sum(s.loss_mask) for s in samples)
    metrics |= exclusion_metrics(trajs, advantages, samples, rollout.counts.excluded)
    if algo.kl_coef == 0:  # all-zero advantages: exactly zero loss, so skip their compute
        samples = [s for s in samples if any(s.advantages)]
    everyone = sum_across([tokens, len(samples), rollout.counts.refused], ranks)
    tokens, trained = int(everyone[0]), int(everyone[1])
    metrics |= {"train/samples": trained, "train/tokens": tokens, "train/refused_versions": everyone[2]}
    # 3. the update, in the run's learner thread (rollouts in flight go on meanwhile)
    if trained:
        batches = _batches(run, samples)
        loop = asyncio.get_running_loop()  # one thread for every step: one heap arena (support.heap)
        metrics |= await loop.run_in_executor(run.updates, update, run.learner, batches, tokens)
        # tokens not run again, over every rank (under FSDP, where the ranks' votes left a prefix)
        shared = sum(b.shared_prefix * (len(b.input_ids_B_T) - 1) for b in batches)
        metrics["train/prefix_tokens_shared"] = sum_across([shared], ranks)[0]
    if ranks.distributed and run.learner.sharded is None:  # under FSDP each weight lives on one rank
        metrics["dist/param_spread"] = param_spread(run.policy, ranks)
    # 4. the new weights into the engine
    t2 = time.perf_counter()
    await push_weights(run)
    t3 = time.perf_counter()
    metrics |= {"time/rollout": t1 - t0, "time/train": t2 - t1, "time/sync": t3 - t2, "time/step": t3 - t0}
    return metrics | cpu_metrics(time.process_time() - cpu0, t3 - t0)


def cut_fraction(trajs: list[Trajectory]) -> float:
    """The share of model turns that ended at max_tokens."""
    turns = [turn for t in trajs for turn in t.turns if turn.role == "assistant"]
    return sum(turn.finish_reason == "length" for turn in turns) / max(len(turns), 1)


def _batches(run: Run, samples: list[TrainSample]) -> list[Batch]:
    """The samples in micro-batches on the policy's device (packed, and sharing prefixes, where the
    model allows)."""
    train, policy = run.config.train, run.policy
    share = train.share_prefix_tokens if shares_prefixes(policy) else 0
    parts = batches_of(
        samples, train.micro_batch_tokens, run.learner.pad_id, packs(train.pack, policy), share
    )
    return [part.to(policy.device) for part in parts]


def _every_ranks(trajs: list[Trajectory], ranks: Ranks) -> list[Trajectory]:
    """The step's trajectories of every rank, for its metrics (without messages and images)."""
    if not ranks.distributed:
        return trajs
    light = [dataclasses.replace(t, messages=[], images=[], multimodal_inputs={}) for t in trajs]
    return [t for part in gather(light, ranks) for t in part]


async def evaluate(run: Run, step: int, name: str = "") -> dict[str, float]:
    """Roll out the held-out prompts (eval sampling, fixed seeds); their metrics as ``eval/...``
    (rank 0 only)."""
    held_out = run.data.held_out
    if not held_out or not run.ranks.main:
        return {}
    cfg = run.config
    t0 = time.perf_counter()
    trajs, rows = await run_eval(
        held_out,
        run.spec,
        cfg.eval,
        cfg.seed + EVAL_SEED_OFFSET,  # the same at every evaluation, so they compare
        concurrency=cfg.rollout.concurrency,
        fail_fraction=cfg.rollout.fail_fraction,
        out_path=run.out_dir / "eval" / f"{name or f'step_{step:06d}'}.jsonl",
        on_done=run.phase(f"eval {name or step}", len(held_out) * cfg.eval.group_size),
    )
    return rollout_metrics(trajs, "eval/") | eval_metrics(rows) | {"time/eval": time.perf_counter() - t0}
