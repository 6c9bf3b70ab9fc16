"""The training loop: roll out groups with the embedded engine, score, advantages, loss, step, push weights.

One step (``train_step``), top to bottom:

1. pick the step's prompts: a function of the seed and the step only, so a resumed run gets the
   very batch the interrupted one would have;
2. roll out ``group_size`` trajectories per prompt with the HFEngine, every request seeded;
3. advantages per model turn (``algorithm.advantage``), then training samples
   (``algorithm.samples``: one per trajectory, or one per model turn);
4. without gradient: old logprobs (PPO's behaviour policy) and the reference's (KL), chunked;
5. ``ppo_epochs`` x ``mini_batches`` AdamW steps, each over micro-batches of at most
   ``micro_batch_tokens`` padded tokens, with a token-mean loss and gradient clipping;
6. push the new weights into the running engine (``update_weights``: no reload).

Held-out evaluation runs at the start, every ``eval.every`` steps and at the end; checkpoints
every ``save_every`` steps and at the end; ``--resume`` continues from the newest checkpoint.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from transformers.utils import logging as hf_logging

from turnrl.app.engines import hf_engine_options, local_engine
from turnrl.app.parts import build_env_factory, build_spec, load_samples
from turnrl.app.preflight import check_run, check_template
from turnrl.app.run import SERVERS
from turnrl.config import ConfigError, HFEngineConfig, VLLMEngineConfig
from turnrl.engines.hf import HFEngine
from turnrl.engines.vllm import save_weights, scratch_weights_dir
from turnrl.env.registry import resolve_env
from turnrl.models import ModelSpec, load_model, load_tokenizer, load_vision_processor, resolve_model
from turnrl.openmp import release_pool
from turnrl.rollout.collector import OnDone, collect
from turnrl.rollout.control import RolloutControl
from turnrl.rollout.failures import check_failures
from turnrl.rollout.loop import RolloutSpec
from turnrl.train.advantages import compute_advantages, groups
from turnrl.train.batch import (
    Batch,
    batches_of,
    build_samples,
    packs,
    step_prompts,
    step_seed,
    unexpected_versions,
)
from turnrl.train.checkpoint import plan_output, restore_training_state, save_checkpoint, start_output
from turnrl.train.config import TrainConfig, policy_device
from turnrl.train.data_parallel import (
    SINGLE,
    Ranks,
    barrier,
    clip_gradients,
    gather,
    param_spread,
    shard,
    sum_across,
    sum_gradients,
)
from turnrl.train.evaluation import EVAL_SEED_OFFSET, eval_metrics, run_eval
from turnrl.train.exclusions import exclude_failures, exclusion_metrics
from turnrl.train.fsdp import (
    ShardedPolicy,
    agree_on_sharing,
    full_optimizer_state,
    full_state_dict,
    load_optimizer_state,
    pad_batches,
    shard_policy,
)
from turnrl.train.logprobs import shares_prefixes, token_logprobs
from turnrl.train.lora import full_weights, is_lora, merged_state, saved_adapter, serving_weights, wrap_lora
from turnrl.train.loss import LossInputs, importance_stats, policy_loss
from turnrl.train.metrics import cpu_metrics, rollout_metrics
from turnrl.train.progress import TrainProgress
from turnrl.train.sft import warm_start
from turnrl.train.shaping import refill_count, refill_prompts, shape_overlong, varied_groups
from turnrl.types import (
    Engine,
    EngineError,
    Sample,
    StopReason,
    Trajectory,
    as_abortable,
    as_following,
    as_updatable,
)


@dataclass
class Run:
    """Everything the loop holds."""

    config: TrainConfig
    policy: Any  # the trained model (float32, dropout off)
    ref: Any | None  # frozen reference for the KL term
    tokenizer: Any
    engine: Engine  # the embedded engine (its own copy of the weights) or vLLM servers
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    spec: RolloutSpec
    samples: list[Sample]
    eval_samples: list[Sample]
    out_dir: Path
    step: int = 0  # training steps done
    resumed: bool = False  # restored from a checkpoint (the step-0 evaluation and warm start are done)
    progress: TrainProgress | None = None  # the console's progress bars, while training runs
    weights_dir: Path | None = None  # where weight updates for server engines are written
    console: Console | None = None  # where the run reports
    ranks: Ranks = SINGLE  # this process among the data-parallel training processes (torchrun)
    sharded: ShardedPolicy | None = None  # the policy's FSDP root (train.fsdp), whose forward is logprobs

    def phase(self, name: str, total: int) -> OnDone | None:
        """Show a phase of ``total`` trajectories; the callback that counts them."""
        if self.progress is None:
            return None
        self.progress.phase(name, total)
        return self.progress.trajectory_done


def trainable_parameters(model: Any, patterns: list[str]) -> list[torch.nn.Parameter]:
    """Freeze the parameters no pattern matches (none given: train all); the trainable ones."""
    for name, param in model.named_parameters():
        param.requires_grad_(not patterns or any(re.search(p, name) for p in patterns))
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"optim.trainable {patterns} matches no parameter of the model")
    return params


def build_run(
    config: TrainConfig, overwrite: bool, resume: bool, console: Console, ranks: Ranks = SINGLE
) -> Run:
    """Check the output folder, load data, models, optimizer and engine; restore a checkpoint."""
    resumed = plan_output(config, overwrite, resume, writer=ranks.main, say=console.print)
    barrier(ranks)  # every rank has checked the folder before rank 0 writes to it
    hf_logging.disable_progress_bar()
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    entry = resolve_env(config.env.name)
    samples = load_samples(config.data, entry)
    eval_samples = load_samples(config.eval.data, entry) if config.eval.data else []
    env_factory = build_env_factory(config.env, entry)
    check_run(config.env.name, samples, env_factory)
    spec = resolve_model(config.model)
    tokenizer = load_tokenizer(spec)
    device = policy_device(config)
    opt = config.optim
    adapters = resumed.model_dir if resumed and saved_adapter(resumed.model_dir) else None
    policy = load_model(str(resumed.model_dir) if resumed and not adapters else spec, device=device)
    ref = load_model(spec, device=device).requires_grad_(False) if config.algorithm.kl_coef > 0 else None
    engine = _engine(config, policy, spec, tokenizer, console, ranks)  # a resume pushes its weights later
    if opt.lora is not None:
        policy = wrap_lora(policy, opt.lora, adapters)
    else:
        trainable_parameters(policy, opt.trainable)
    sharded = shard_policy(policy, ranks) if config.train.fsdp else None
    params = [p for p in policy.parameters() if p.requires_grad]  # sharded ones under FSDP
    optimizer = torch.optim.AdamW(params, opt.lr, opt.betas, weight_decay=opt.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / (opt.warmup_steps + 1))
    )
    rollout = build_spec(config, engine, tokenizer, env_factory)
    check_template(rollout.encoder, samples[0])
    rollout = dataclasses.replace(
        rollout,
        # each turn's inference-time context is recorded
        inference_contexts=rollout.inference_contexts or config.algorithm.samples == "inference",
        mask_offpolicy=config.algorithm.offpolicy_tokens == "mask",
    )
    if config.train.overlap and not isinstance(engine, HFEngine):  # servers pause turns for an update
        rollout = dataclasses.replace(rollout, control=RolloutControl())
    if ranks.main:
        start_output(config, resumed)  # every input is valid: now the folder may change
    barrier(ranks)  # rank 0 has emptied the folder before any rank writes its rollouts there
    out = Path(config.output_dir)
    run = Run(
        config, policy, ref, tokenizer, engine, optimizer, scheduler, rollout, samples, eval_samples, out
    )
    run.console, run.ranks, run.sharded = console, ranks, sharded
    if resumed:
        load = functools.partial(load_optimizer_state, sharded, optimizer) if sharded else None
        run.step = restore_training_state(resumed.model_dir.parent, optimizer, scheduler, load)
        run.resumed = True
        console.print(f"resuming from {resumed.model_dir.parent} (step {run.step})")
    return run


def _engine(
    config: TrainConfig, policy: Any, spec: ModelSpec, tokenizer: Any, console: Console, ranks: Ranks
) -> Engine:
    """The rollout engine for the plain (not yet LoRA-wrapped) policy: the embedded one on a copy of
    it, or vLLM servers (``_server_engine``)."""
    e = config.engine
    if isinstance(e, VLLMEngineConfig):
        return _server_engine(config, e, console, ranks)
    if not isinstance(e, HFEngineConfig):  # refused by TrainConfig; here for the type checker
        raise TypeError(f"turnrl train cannot update the weights of engine.kind {e.kind!r}")
    engine_model = torch.nn.Module.to(copy.deepcopy(policy), dtype=getattr(torch, e.dtype))
    return HFEngine(
        engine_model, tokenizer, vision=load_vision_processor(spec, tokenizer), **hf_engine_options(e)
    )


def _logprobs(run: Run, model: Any, batch: Batch) -> torch.Tensor:
    """The batch's loss-token logprobs under ``model``, at the sampling temperature (the sharded
    policy through its FSDP root)."""
    config = run.config
    forward = run.sharded if model is run.policy and run.sharded is not None else None
    return (forward or functools.partial(token_logprobs, model))(
        batch.input_ids_B_T,
        batch.attention_mask_B_T,
        batch.loss_mask_B_T > 0,
        temperature=config.sampling.temperature or 1.0,
        chunk_size=config.train.logprob_chunk,
        keep_mib=config.train.logprob_keep_mib,
        multimodal=batch.multimodal,
        autocast=torch.bfloat16 if config.train.precision == "bfloat16" else None,
        position_ids_B_T=batch.position_ids_B_T,
        shared_prefix=batch.shared_prefix,
    )


def _prepare(run: Run, batches: list[Batch]) -> dict[str, float]:
    """Fill in old (and reference) logprobs; the rollout importance-ratio stats."""
    algo = run.config.algorithm
    with torch.no_grad():
        for batch, real in _even(run, batches):
            if algo.recompute_old_logprobs:  # FSDP's empty batches only join the sharded forward
                batch.old_logprobs_B_T = _logprobs(run, run.policy, batch)
            if run.ref is not None and real:
                batch.ref_logprobs_B_T = _logprobs(run, run.ref, batch)
    if not batches:  # under FSDP a rank with nothing to train joined the others' forward passes
        return {}
    old = torch.cat([b.old_logprobs_B_T[b.loss_mask_B_T > 0] for b in batches])
    rollout = torch.cat([b.rollout_logprobs_B_T[b.loss_mask_B_T > 0] for b in batches])
    return importance_stats(old, rollout, torch.ones_like(rollout), algo.loss_options())


def _pad_id(run: Run) -> int:
    """The id that pads the batches' rows (the tokenizer's pad token, else 0)."""
    pad = run.tokenizer.pad_token_id
    return int(pad) if pad is not None else 0


def _even(run: Run, batches: list[Batch]) -> list[tuple[Batch, bool]]:
    """The batches, each marked real; under FSDP, padded with empty ones to the most any rank has,
    and sharing a prefix only at places where every rank's batch does."""
    if run.sharded is None:
        return [(b, True) for b in batches]
    padded = pad_batches(batches, run.ranks, _pad_id(run), run.policy.device)
    return agree_on_sharing(padded, run.ranks)


def update_policy(run: Run, batches: list[Batch], tokens: int) -> dict[str, float]:
    """``ppo_epochs`` x ``mini_batches`` optimizer steps over the micro-batches; loss and grad stats.

    Each optimizer step's loss is a token mean over its share of the step's ``tokens`` loss tokens.
    """
    cfg, algo = run.config, run.config.algorithm
    minis = [batches[i :: cfg.train.mini_batches] for i in range(cfg.train.mini_batches)]
    if not run.ranks.distributed:  # ranks take the same optimizer steps, empty or not
        minis = [m for m in minis if m]
    normalizer = tokens / len(minis)  # the step's loss tokens, over every rank
    totals = {"loss": 0.0, "tokens": 0.0, "clipped": 0.0, "kl": 0.0, "grad_norm": 0.0, "steps": 0.0}
    for _ in range(cfg.train.ppo_epochs):
        for mini in minis:
            run.optimizer.zero_grad(set_to_none=True)
            for batch, real in _even(run, mini):
                inputs = LossInputs(
                    _logprobs(run, run.policy, batch),
                    batch.old_logprobs_B_T,
                    batch.rollout_logprobs_B_T,
                    batch.advantages_B_T,
                    batch.loss_mask_B_T,
                    batch.ref_logprobs_B_T,
                )
                result = policy_loss(algo.loss, inputs, algo.loss_options(), normalizer)
                if not real:  # FSDP's empty batch: the collectives run, nothing is learned
                    (result.loss * 0.0).backward()
                    continue
                result.loss.backward()
                totals["loss"] += float(result.loss.detach())
                totals["tokens"] += result.tokens
                totals["clipped"] += result.clipped
                totals["kl"] += result.kl_sum
            params = [p for p in run.policy.parameters() if p.requires_grad]
            if run.sharded is None:  # FSDP reduce-scatters the gradients itself
                sum_gradients(params, run.ranks)
            totals["grad_norm"] += clip_gradients(params, cfg.optim.grad_clip)
            run.optimizer.step()
            run.scheduler.step()
            totals["steps"] += 1
    keys = ("loss", "tokens", "clipped", "kl")
    totals.update(zip(keys, sum_across([totals[k] for k in keys], run.ranks), strict=True))
    steps, seen = max(totals["steps"], 1.0), max(totals["tokens"], 1.0)
    return {
        "loss/value": totals["loss"] / steps,
        "loss/clip_frac": totals["clipped"] / seen,
        "loss/kl": totals["kl"] / seen,
        "grad_norm": totals["grad_norm"] / steps,
        "lr": float(run.scheduler.get_last_lr()[0]),
    }


async def train_step(run: Run, step: int) -> dict[str, float]:
    """Step ``step`` (from 1): rollout, advantages, samples, update, weight push; its metrics."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    rolled, trajs, counts = await _step_trajectories(run, step, rollouts_path(run, step))
    return await learn(run, rolled, trajs, counts, t0, cpu0)


def rollouts_path(run: Run, step: int) -> Path | None:
    """Where step ``step`` writes its trajectories (``train.save_rollouts``), emptied for the step."""
    if not run.config.train.save_rollouts:
        return None
    name = f"step_{step:06d}" + (f".rank{run.ranks.rank}" if run.ranks.distributed else "")
    out_path = run.out_dir / "rollouts" / f"{name}.jsonl"
    out_path.unlink(missing_ok=True)  # a resumed run redoes the step
    return out_path


async def learn(
    run: Run,
    rolled: list[Trajectory],
    trajs: list[Trajectory],
    counts: StepCounts,
    t0: float,
    cpu0: float,
) -> dict[str, float]:
    """From a step's trajectories (``rolled``: every one rolled out; ``trajs``: those to train on)
    to an optimizer update and the weight push; the step's metrics (its times from ``t0``, wall,
    and ``cpu0``, this process's CPU). The update runs in a worker thread, so rollouts in flight
    (overlapped training) go on meanwhile."""
    cfg = run.config
    t1 = time.perf_counter()
    every = _every_ranks(rolled, run.ranks)  # every rank decides alike
    check_failures(every, cfg.rollout.fail_fraction, f"training step {run.step + 1}")
    metrics = rollout_metrics(every) | counts.metrics()
    advantages = compute_advantages(cfg.algorithm.advantage, trajs, cfg.algorithm.advantage_options())
    samples = build_samples(cfg.algorithm.samples, trajs, advantages, cfg.algorithm.loss_turns)
    tokens = sum(sum(s.loss_mask) for s in samples)
    metrics |= exclusion_metrics(trajs, advantages, samples, counts.excluded)
    if cfg.algorithm.kl_coef == 0:  # all-zero advantages: exactly zero loss, so skip their compute
        samples = [s for s in samples if any(s.advantages)]
    everyone = sum_across([tokens, len(samples), counts.refused], run.ranks)  # every rank's
    tokens, trained = int(everyone[0]), int(everyone[1])
    metrics |= {"train/samples": trained, "train/tokens": tokens, "train/refused_versions": everyone[2]}
    if trained:
        share = cfg.train.share_prefix_tokens if shares_prefixes(run.policy) else 0
        parts = batches_of(
            samples, cfg.train.micro_batch_tokens, _pad_id(run), packs(cfg.train.pack, run.policy), share
        )
        batches = [part.to(run.policy.device) for part in parts]
        metrics |= await asyncio.to_thread(_update, run, batches, tokens)
        # tokens not run again, over every rank (under FSDP, where the ranks' votes left a prefix)
        shared = sum(b.shared_prefix * (len(b.input_ids_B_T) - 1) for b in batches)
        metrics["train/prefix_tokens_shared"] = sum_across([shared], run.ranks)[0]
    if run.ranks.distributed and run.sharded is None:  # under FSDP each weight lives on one rank
        metrics["dist/param_spread"] = param_spread(run.policy, run.ranks)
    t2 = time.perf_counter()
    await push_weights(run)
    t3 = time.perf_counter()
    metrics |= {"time/rollout": t1 - t0, "time/train": t2 - t1, "time/sync": t3 - t2, "time/step": t3 - t0}
    return metrics | cpu_metrics(time.process_time() - cpu0, t3 - t0)


def _update(run: Run, batches: list[Batch], tokens: int) -> dict[str, float]:
    try:
        prepared = _prepare(run, batches) if batches or run.sharded is not None else {}
        return prepared | update_policy(run, batches, tokens)
    finally:
        release_pool()  # the update's thread hands the cores back to the engine (``turnrl.openmp``)


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


async def _rollout(
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
        spec = dataclasses.replace(
            spec, control=RolloutControl(int(getattr(run.engine, "weight_version", 0)))
        )
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


async def _step_trajectories(
    run: Run, step: int, out_path: Path | None
) -> tuple[list[Trajectory], list[Trajectory], StepCounts]:
    """Roll out this rank's share of the step's prompts; every trajectory rolled out, those to train
    on (allowed weight versions, no failures, overlong-shaped; with dynamic sampling, only groups
    with varied rewards, refilled round after round), and the counts of what was left out."""
    cfg, algo = run.config, run.config.algorithm
    chosen = step_prompts(run.samples, cfg.train.prompts_per_step, step - 1, cfg.seed)
    prompts = shard(chosen, run.ranks)  # this rank's share (all of them in one process)
    pool = shard([s for s in run.samples if s.id not in {p.id for p in chosen}], run.ranks)
    target, counts = len(prompts), StepCounts()
    if cfg.train.oversample_groups:
        return await _oversampled(run, step, prompts, pool, out_path)
    rolled: list[Trajectory] = []
    keep: list[Trajectory] = []
    tried = 0
    while prompts:
        counts.rounds += 1
        new = await _rollout(run, prompts, step, counts.rounds, out_path)
        rolled += new
        tried += len(prompts)
        batch = screen(run, new, counts)
        if algo.dynamic_sampling is None:
            return rolled, batch, counts
        varied, flat = varied_groups(batch)
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
    return rolled, [keep[i] for members in kept_groups for i in members], counts


async def _oversampled(
    run: Run, step: int, prompts: list[Sample], pool: list[Sample], out_path: Path | None
) -> tuple[list[Trajectory], list[Trajectory], StepCounts]:
    """Roll out ``train.oversample_groups`` more groups than the step needs (this rank's share of
    them); once the step's number of groups is complete, the rest are stopped and left out."""
    cfg, counts = run.config, StepCounts(rounds=1)
    extra = refill_prompts(pool, cfg.train.oversample_groups, cfg.seed, step, 0)
    rolled = await _rollout(run, prompts + extra, step, 1, out_path, target_groups=len(prompts))
    complete, stopped = complete_groups(rolled)
    counts.shaped["oversample/stopped_groups"] += stopped
    return rolled, screen(run, complete, counts), counts


def screen(run: Run, trajs: list[Trajectory], counts: StepCounts) -> list[Trajectory]:
    """The trajectories fit to train on: sampled by allowed weight versions, not ended by a
    failure, overlong-shaped (``algorithm.overlong``); what was left out is added to ``counts``."""
    algo = run.config.algorithm
    batch, refused = _on_policy(run, trajs)
    batch, excluded = exclude_failures(batch, algo.train_on_failures)
    counts.refused += refused
    counts.excluded += excluded
    if algo.overlong is not None:
        o = algo.overlong
        batch, shaped = shape_overlong(batch, o.max_tokens, o.buffer, o.penalty, o.mask_truncated)
        counts.shaped.update(shaped)
    return batch


def _every_ranks(trajs: list[Trajectory], ranks: Ranks) -> list[Trajectory]:
    """The step's trajectories of every rank, for its metrics (without messages and images)."""
    if not ranks.distributed:
        return trajs
    light = [dataclasses.replace(t, messages=[], images=[], multimodal_inputs={}) for t in trajs]
    return [t for part in gather(light, ranks) for t in part]


def _on_policy(run: Run, trajs: list[Trajectory]) -> tuple[list[Trajectory], int]:
    """The trajectories whose every model token the engine sampled with an allowed weight version
    (the current one, or up to ``algorithm.max_staleness`` older); the others are refused, each
    named in a console line, and counted."""
    current = int(getattr(run.engine, "weight_version", 0))
    refused = unexpected_versions(trajs, current, run.config.algorithm.max_staleness)
    if not refused:
        return trajs, 0
    shown = "; ".join(
        f"{t.group_id}#{t.sample_index}: versions {sorted({v for v in t.policy_versions if v >= 0})}"
        for t in refused[:3]
    )
    console = run.console or Console(stderr=True)
    more = " ..." if len(refused) > 3 else ""
    console.print(
        f"refusing {len(refused)} trajectories not sampled by weight version {current}: {shown}{more}"
    )
    return [t for t in trajs if all(t is not r for r in refused)], len(refused)


async def evaluate(run: Run, step: int, name: str = "") -> dict[str, float]:
    """Roll out the held-out prompts (eval sampling, fixed seeds); their metrics as ``eval/...``
    (rank 0 only)."""
    if not run.eval_samples or not run.ranks.main:
        return {}
    cfg = run.config
    t0 = time.perf_counter()
    trajs, rows = await run_eval(
        run.eval_samples,
        run.spec,
        cfg.eval,
        cfg.seed + EVAL_SEED_OFFSET,  # the same at every evaluation, so they compare
        concurrency=cfg.rollout.concurrency,
        fail_fraction=cfg.rollout.fail_fraction,
        out_path=run.out_dir / "eval" / f"{name or f'step_{step:06d}'}.jsonl",
        on_done=run.phase(f"eval {name or step}", len(run.eval_samples) * cfg.eval.group_size),
    )
    return rollout_metrics(trajs, "eval/") | eval_metrics(rows) | {"time/eval": time.perf_counter() - t0}


def _server_engine(config: TrainConfig, e: VLLMEngineConfig, console: Console, ranks: Ranks) -> Engine:
    """Clients for vLLM servers: ``engine.urls``, else servers started here, logging into
    ``OUT/servers/``. Under torchrun the first rank starts them and every rank rolls out its share of
    the prompts through them (the servers batch every rank's requests together)."""

    def start() -> Engine:
        with console.status(f"starting vLLM for {config.model}") as status:
            log_dir = Path(config.output_dir) / SERVERS
            return local_engine(config.model, e, log_dir=log_dir, say=status.update, seed=config.seed)[0]

    if e.keep_in_flight and ranks.distributed:  # another rank's push would meet this rank's turns
        raise ConfigError("engine.keep_in_flight is not supported under torchrun (several trainers)")
    if e.urls or not ranks.distributed:
        return start()
    engine: Engine | None = None
    shared: list[str] | str | None = None  # the first rank's servers' URLs, or why they did not start
    if ranks.main:
        try:
            engine = start()
            shared = [s.url for s in getattr(engine, "servers", ())]
        except Exception as exc:  # told to every rank, which all stop with it
            shared = f"{type(exc).__name__}: {exc}"
    urls = gather(shared, ranks)[0]
    if not isinstance(urls, list):
        raise EngineError(f"the first rank's vLLM servers did not start: {urls}")
    if engine is not None:
        return engine
    return local_engine(config.model, e.model_copy(update={"urls": urls}), seed=config.seed)[0]


async def _start(run: Run) -> dict[str, float]:
    """The step-0 record: held-out metrics, and with a warm start, those before it as ``base/...``."""
    cfg = run.config.warm_start
    if cfg is None:
        return await evaluate(run, 0)
    record = {f"base/{k}": v for k, v in (await evaluate(run, 0, "base")).items()}
    # every rank replays the same demonstrations: FSDP sums their equal gradients, hence 1 / W
    scale = 1.0 / run.ranks.world if run.sharded is not None else 1.0
    record |= await warm_start(run.policy, run.spec, run.config, run.progress, run.sharded, scale)
    await push_weights(run)
    _save(run, 0)  # a resume never redoes the warm start
    return record | await evaluate(run, 0)


async def push_weights(run: Run) -> None:
    """Put the policy's weights into the engine: the embedded one takes a state dict (with LoRA: the
    adapted layers, merged); vLLM servers load a whole checkpoint, written once for all of them (by
    the first rank under torchrun: the servers are shared)."""
    weights = _gathered_weights(run) if run.sharded else None  # a collective: every rank gathers
    if isinstance(run.engine, HFEngine):
        await run.engine.update_weights(
            weights or serving_weights(run.policy), strict=not is_lora(run.policy)
        )
        return
    if run.ranks.main:
        if run.weights_dir is None:
            chosen = getattr(run.config.engine, "weights_dir", None)
            run.weights_dir = Path(chosen) if chosen else scratch_weights_dir()
        # in a worker thread: the rollouts of overlapped training go on meanwhile
        await asyncio.to_thread(save_weights, weights or full_weights(run.policy), run.weights_dir)
    await _servers_load(run)


def _gathered_weights(run: Run) -> dict[str, torch.Tensor]:
    """The sharded policy's whole weights, on every rank (a collective); LoRA adapters merged in."""
    state = full_state_dict(run.policy)
    return merged_state(state, run.policy) if is_lora(run.policy) else state


async def _servers_load(run: Run) -> None:
    """The servers load the checkpoint in ``run.weights_dir``. Overlapped training: every rank's turns
    in flight stop where they are (each rank aborts its own requests; their tokens are kept) and go
    on from their last token under the new weights (a partial rollout); with ``keep_in_flight`` the
    servers freeze them instead and they go on in the same requests, and no turn starts meanwhile.
    Under torchrun the first rank updates once every rank has paused; the others then take up the
    version the servers report."""
    control, ranks = run.spec.control, run.ranks
    new = int(getattr(run.engine, "weight_version", 0)) + 1
    failure: BaseException | None = None  # raised once every rank has passed both barriers
    try:
        try:
            if control is not None and getattr(run.config.engine, "keep_in_flight", False):
                control.hold()
            elif control is not None:
                await control.pause(as_abortable(run.engine))
        except Exception as exc:
            failure = exc
        await asyncio.to_thread(barrier, ranks)  # every rank has paused; the checkpoint is written
        if ranks.main and failure is None:
            try:
                await as_updatable(run.engine).update_weights(run.weights_dir or "")
            except Exception as exc:
                failure = exc
        await asyncio.to_thread(barrier, ranks)  # the servers serve the new weights (or failed to)
        if failure is not None:
            raise failure
        if not ranks.main:
            await as_following(run.engine).follow_weights(new)
    finally:
        if control is not None:
            control.resume(int(getattr(run.engine, "weight_version", 0)))


def _save(run: Run, step: int) -> None:
    loop = run.config.train
    weights = optimizer = None
    if run.sharded is not None:  # every rank gathers the shards; rank 0 writes the whole
        weights = full_state_dict(run.policy)
        optimizer = full_optimizer_state(run.sharded, run.optimizer) if loop.save_optimizer else None
    if not run.ranks.main:  # every rank holds the same weights: rank 0 writes them
        return
    parts = (run.policy, run.tokenizer, run.optimizer, run.scheduler)
    save_checkpoint(
        run.out_dir,
        step,
        *parts,
        loop.keep_checkpoints,
        with_optimizer=loop.save_optimizer,
        state_dict=weights,
        optimizer_state=optimizer,
    )


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)
