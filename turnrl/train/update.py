"""The update: from a step's training samples to optimizer steps on the policy.

``update`` fills in the old (and reference) logprobs without gradient, then runs ``ppo_epochs`` x
``mini_batches`` optimizer steps, each over micro-batches of at most ``micro_batch_tokens`` padded
tokens, with a token-mean loss and gradient clipping. Under FSDP the ranks' batches are evened out
first (``even_batches``), since every rank must join every sharded forward pass.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from turnrl.support.heap import trim_heap
from turnrl.support.openmp import release_pool
from turnrl.train.batch import Batch
from turnrl.train.config import AlgorithmConfig, OptimConfig, TrainLoopConfig
from turnrl.train.data_parallel import SINGLE, Ranks, clip_gradients, sum_across, sum_gradients
from turnrl.train.fsdp import ShardedPolicy, agree_on_sharing, pad_batches
from turnrl.train.logprobs import token_logprobs
from turnrl.train.loss import LossInputs, importance_stats, policy_loss
from turnrl.types import SamplingParams


class UpdateSections(Protocol):
    """The config sections the update reads (a ``TrainConfig``'s, or a learning gateway's)."""

    @property
    def algorithm(self) -> AlgorithmConfig: ...
    @property
    def optim(self) -> OptimConfig: ...
    @property
    def train(self) -> TrainLoopConfig: ...
    @property
    def sampling(self) -> SamplingParams: ...


@dataclass
class Learner:
    """What the update works on: the policy, its optimizer and where it runs."""

    config: UpdateSections  # a TrainConfig under turnrl train
    policy: Any  # the trained model (float32, dropout off)
    ref: Any | None  # frozen reference for the KL term
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ranks: Ranks = SINGLE  # this process among the data-parallel training processes (torchrun)
    sharded: ShardedPolicy | None = None  # the policy's FSDP root (train.fsdp), whose forward is logprobs

    @property
    def pad_id(self) -> int:
        """The id that pads the batches' rows (the tokenizer's pad token, else 0)."""
        pad = self.tokenizer.pad_token_id
        return int(pad) if pad is not None else 0


def make_optimizer(
    params: list[torch.nn.Parameter], opt: OptimConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over ``params`` as ``opt`` says, and its schedule: a linear warm-up, then constant."""
    optimizer = torch.optim.AdamW(params, opt.lr, opt.betas, weight_decay=opt.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / (opt.warmup_steps + 1))
    )
    return optimizer, scheduler


def trainable_parameters(model: Any, patterns: list[str]) -> list[torch.nn.Parameter]:
    """Freeze the parameters no pattern matches (none given: train all); the trainable ones."""
    for name, param in model.named_parameters():
        param.requires_grad_(not patterns or any(re.search(p, name) for p in patterns))
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"optim.trainable {patterns} matches no parameter of the model")
    return params


def update(learner: Learner, batches: list[Batch], tokens: int) -> dict[str, float]:
    """Old logprobs, then the optimizer steps (``update_policy``); their metrics. Run in the run's
    learner thread, it hands the cores back to the engine when done (``turnrl.support.openmp``),
    and the memory its activations took back to the system (``turnrl.support.heap``)."""
    try:
        prepared = fill_old_logprobs(learner, batches) if batches or learner.sharded is not None else {}
        return prepared | update_policy(learner, batches, tokens)
    finally:
        release_pool()
        trim_heap()


def logprobs_of(learner: Learner, model: Any, batch: Batch) -> torch.Tensor:
    """The batch's loss-token logprobs under ``model``, at the sampling temperature (the sharded
    policy through its FSDP root)."""
    config = learner.config
    forward = learner.sharded if model is learner.policy and learner.sharded is not None else None
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


def fill_old_logprobs(learner: Learner, batches: list[Batch]) -> dict[str, float]:
    """Fill in old (and reference) logprobs; the rollout importance-ratio stats."""
    algo = learner.config.algorithm
    with torch.no_grad():
        for batch, real in even_batches(learner, batches):
            if algo.recompute_old_logprobs:  # FSDP's empty batches only join the sharded forward
                batch.old_logprobs_B_T = logprobs_of(learner, learner.policy, batch)
            if learner.ref is not None and real:
                batch.ref_logprobs_B_T = logprobs_of(learner, learner.ref, batch)
    if not batches:  # under FSDP a rank with nothing to train joined the others' forward passes
        return {}
    old = torch.cat([b.old_logprobs_B_T[b.loss_mask_B_T > 0] for b in batches])
    rollout = torch.cat([b.rollout_logprobs_B_T[b.loss_mask_B_T > 0] for b in batches])
    return importance_stats(old, rollout, torch.ones_like(rollout), algo.loss_options())


def even_batches(learner: Learner, batches: list[Batch]) -> list[tuple[Batch, bool]]:
    """The batches, each marked real; under FSDP, padded with empty ones to the most any rank has,
    and sharing a prefix only at places where every rank's batch does."""
    if learner.sharded is None:
        return [(b, True) for b in batches]
    padded = pad_batches(batches, learner.ranks, learner.pad_id, learner.policy.device)
    return agree_on_sharing(padded, learner.ranks)


def update_policy(learner: Learner, batches: list[Batch], tokens: int) -> dict[str, float]:
    """``ppo_epochs`` x ``mini_batches`` optimizer steps over the micro-batches; loss and grad stats.

    Each optimizer step's loss is a token mean over its share of the step's ``tokens`` loss tokens.
    """
    cfg = learner.config
    minis = [batches[i :: cfg.train.mini_batches] for i in range(cfg.train.mini_batches)]
    if not learner.ranks.distributed:  # ranks take the same optimizer steps, empty or not
        minis = [m for m in minis if m]
    normalizer = tokens / len(minis)  # the step's loss tokens, over every rank
    totals = {"loss": 0.0, "tokens": 0.0, "clipped": 0.0, "kl": 0.0, "grad_norm": 0.0, "steps": 0.0}
    for _ in range(cfg.train.ppo_epochs):
        for mini in minis:
            _optimizer_step(learner, mini, normalizer, totals)
    keys = ("loss", "tokens", "clipped", "kl")
    totals.update(zip(keys, sum_across([totals[k] for k in keys], learner.ranks), strict=True))
    steps, seen = max(totals["steps"], 1.0), max(totals["tokens"], 1.0)
    return {
        "loss/value": totals["loss"] / steps,
        "loss/clip_frac": totals["clipped"] / seen,
        "loss/kl": totals["kl"] / seen,
        "grad_norm": totals["grad_norm"] / steps,
        "lr": float(learner.scheduler.get_last_lr()[0]),
    }


def _optimizer_step(learner: Learner, mini: list[Batch], normalizer: float, totals: dict[str, float]) -> None:
    """One optimizer step over a mini-batch's micro-batches; its sums added to ``totals``."""
    algo = learner.config.algorithm
    learner.optimizer.zero_grad(set_to_none=True)
    for batch, real in even_batches(learner, mini):
        inputs = LossInputs(
            logprobs_of(learner, learner.policy, batch),
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
    params = [p for p in learner.policy.parameters() if p.requires_grad]
    if learner.sharded is None:  # FSDP reduce-scatters the gradients itself
        sum_gradients(params, learner.ranks)
    totals["grad_norm"] += clip_gradients(params, learner.config.optim.grad_clip)
    learner.optimizer.step()
    learner.scheduler.step()
    totals["steps"] += 1
