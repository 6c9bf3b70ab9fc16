"""Supervised warm-start: demonstrations played through the real env, then next-token loss on the model turns.

A demonstration is the list of assistant texts of one episode (``demos(sample) -> [str, ...]``).
Each is replayed by a ``ScriptedEngine`` through the same turn loop, env and chat encoding as
the rollouts (for an agent harness: through the agent and its gateway session, as its runs go), so
the warm-start tokens are laid out exactly as the model will later see them.
Only demonstrations the env rewards (``reward > 0``) are kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from turnrl.engines.scripted import ScriptedEngine
from turnrl.rollout.loop import run_trajectory
from turnrl.rollout.spec import RolloutSpec
from turnrl.support.imports import import_object
from turnrl.train.batch import TrainSample, batches_of, build_samples, packs
from turnrl.train.config import TrainConfig
from turnrl.train.data_parallel import clip_gradients
from turnrl.train.logprobs import token_logprobs
from turnrl.train.progress import TrainProgress
from turnrl.types import Sample, Trajectory

REPLAYS_AT_ONCE = 8  # an agent harness's demonstrations replayed concurrently (each is a process)

Demos = Callable[[Sample], Sequence[str]]
"""The assistant texts of one demonstrated episode of a sample."""


@dataclasses.dataclass
class SftState:
    """Where ``sft_epochs`` stands after a step: the optimizer's state and the loss of every step
    so far (their count is the steps done)."""

    optimizer: dict[str, Any]
    losses: list[float]


async def replay(
    samples: Sequence[Sample],
    demos: Demos,
    spec: RolloutSpec,
    on_done: Callable[[Trajectory], None] | None = None,
) -> list[Trajectory]:
    """Each sample's demonstration played through the env, under the rollout's limits (through the
    agent itself for an agent harness: its branches)."""
    tokenizer: Any = spec.encoder.template.tokenizer
    gate = asyncio.Semaphore(REPLAYS_AT_ONCE if spec.runner else 1)

    async def one(sample: Sample) -> list[Trajectory]:
        async with gate:
            engine = ScriptedEngine(tokenizer, list(demos(sample)), logprob=0.0)
            scripted = dataclasses.replace(spec, engine=engine)
            if spec.runner is not None:
                played = await spec.runner(sample, 0, scripted)
            else:
                played = [await run_trajectory(sample, scripted)]
            if on_done is not None:
                on_done(played[-1])
            return played

    return [traj for played in await asyncio.gather(*(one(s) for s in samples)) for traj in played]


async def demonstrations(samples: Sequence[Sample], demos: Demos, spec: RolloutSpec) -> list[Trajectory]:
    """The replayed demonstrations the env rewards (``reward > 0``)."""
    return [traj for traj in await replay(samples, demos, spec) if traj.score > 0]


def sft_epochs(
    model: Any,
    trajs: Sequence[Trajectory],
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    micro_batch_tokens: int,
    chunk_size: int,
    seed: int,
    keep_mib: float = 0.0,
    on_step: Callable[[], None] | None = None,
    forward: Callable[..., torch.Tensor] | None = None,
    grad_scale: float = 1.0,
    packed: bool = False,
    resume: SftState | None = None,
    checkpoint: Callable[[SftState], None] | None = None,
    length_window: int = 0,
) -> list[float]:
    """AdamW on the token-mean negative log-likelihood of the model tokens; the loss of each step.
    ``forward`` computes the logprobs (default ``token_logprobs`` of ``model``; a sharded policy's
    root under FSDP); each loss is multiplied by ``grad_scale`` before its backward pass; ``packed``:
    micro-batches as packed rows (see ``batches_of``); ``keep_mib``: see ``token_logprobs``.
    ``checkpoint`` is given the state after every step; ``resume`` continues from one (the model's
    trainable weights already restored by the caller): its steps are skipped, in the same order.
    ``length_window``: after each epoch's shuffle, every run of that many batches is sorted by length,
    so that a batch pads its rows to less (0: not sorted)."""
    logprobs = forward or functools.partial(token_logprobs, model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    if resume is not None:
        optimizer.load_state_dict(resume.optimizer)
    samples = build_samples("trajectory", trajs, [[0.0] * t.num_turns for t in trajs])
    rng = random.Random(seed)
    losses = list(resume.losses) if resume is not None else []
    step = 0
    for _ in range(epochs):
        order = list(samples)
        rng.shuffle(order)
        if length_window:
            span = length_window * batch_size
            order = [x for i in range(0, len(order), span) for x in sorted(order[i : i + span], key=_length)]
        for start in range(0, len(order), batch_size):
            step += 1
            if step <= len(losses):  # done before the resume
                continue
            parts = batches_of(order[start : start + batch_size], micro_batch_tokens, 0, packed)
            batches = [b.to(model.device) for b in parts]
            tokens = float(sum(b.num_tokens for b in batches))
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for b in batches:
                mask = b.loss_mask_B_T
                logp = logprobs(
                    b.input_ids_B_T,
                    b.attention_mask_B_T,
                    mask > 0,
                    chunk_size=chunk_size,
                    keep_mib=keep_mib,
                    multimodal=b.multimodal,
                    position_ids_B_T=b.position_ids_B_T,
                )
                loss = -(logp * mask).sum() / tokens
                (loss * grad_scale).backward()
                total += float(loss.detach())
            clip_gradients(params, 1.0)
            optimizer.step()
            losses.append(total)
            if on_step is not None:
                on_step()
            if checkpoint is not None:
                checkpoint(SftState(optimizer.state_dict(), list(losses)))
    return losses


def _length(sample: TrainSample) -> int:
    return len(sample.input_ids)


async def warm_start(
    model: Any,
    spec: RolloutSpec,
    config: TrainConfig,
    samples: list[Sample],
    progress: TrainProgress | None = None,
    forward: Callable[..., torch.Tensor] | None = None,
    grad_scale: float = 1.0,
) -> dict[str, float]:
    """Replay ``config.warm_start``'s demonstrations of ``samples`` (its data) through the env, then
    train ``model`` on them (``forward`` and ``grad_scale``: see ``sft_epochs``)."""
    cfg = config.warm_start
    assert cfg is not None
    t0 = time.perf_counter()
    if progress is not None:
        progress.phase("warm start: replay", len(samples))
    done = progress.trajectory_done if progress is not None else None
    played = await replay(samples, import_object(cfg.demos, "warm_start.demos"), spec, done)
    trajs = [traj for traj in played if traj.score > 0]
    if not trajs:
        stops = Counter(t.stop_reason.value for t in played)
        raise ValueError(
            f"warm start: the env rewarded none of the {len(played)} demonstrations (stops: {dict(stops)})"
        )
    if progress is not None:
        progress.phase("warm start: SFT", cfg.epochs * -(-len(trajs) // cfg.batch_size))
    losses = sft_epochs(
        model,
        trajs,
        epochs=cfg.epochs,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        micro_batch_tokens=config.train.micro_batch_tokens,
        chunk_size=config.train.logprob_chunk,
        seed=config.seed,
        keep_mib=config.train.logprob_keep_mib,
        on_step=progress.advance if progress is not None else None,
        forward=forward,
        grad_scale=grad_scale,
        packed=packs(config.train.pack, model),
    )
    return {
        "warm_start/demos": len(trajs),
        "warm_start/demo_turns": statistics.fmean(t.num_turns for t in trajs),
        "warm_start/loss_first": losses[0],
        "warm_start/loss_last": losses[-1],
        "time/warm_start": time.perf_counter() - t0,
    }
