"""``turnrl train``: a training run wired from its config, as ``app.run`` wires a rollout.

``build_run`` checks the output folder (``app.output``), loads the data, the env, the policy, its
reference and optimizer, and the rollout engine (the embedded one on a copy of the policy, or vLLM
servers), and restores a checkpoint on ``--resume``; ``train`` runs it (``train.loop``). Started by
``torchrun``, each process is one data-parallel rank (see ``train.data_parallel``).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import io
import random
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from transformers.utils import logging as hf_logging

from turnrl.app.engines import hf_engine_options, local_engine
from turnrl.app.kinds import env_kind
from turnrl.app.output import TRAINING, open_output, start_output
from turnrl.app.parts import build_spec, load_samples
from turnrl.app.preflight import check_template
from turnrl.app.run import SERVERS
from turnrl.config import ConfigError, HFEngineConfig, VLLMEngineConfig
from turnrl.engines.hf import HFEngine
from turnrl.models import ModelSpec, load_model, load_tokenizer, load_vision_processor, resolve_model
from turnrl.rollout.control import RolloutControl
from turnrl.rollout.spec import RolloutSpec
from turnrl.support.errors import describe
from turnrl.support.run_folder import FAILED, put_back, release
from turnrl.support.stopping import bounded_stops
from turnrl.train.checkpoint import Resumed, latest, restore_training_state
from turnrl.train.config import TrainConfig, policy_device
from turnrl.train.data_parallel import SINGLE, Ranks, barrier, close_ranks, gather, init_ranks, launched_ranks
from turnrl.train.fsdp import load_optimizer_state, shard_policy
from turnrl.train.loop import run_training
from turnrl.train.lora import saved_adapter, wrap_lora
from turnrl.train.state import Data, Run
from turnrl.train.update import Learner, make_optimizer, trainable_parameters
from turnrl.types import Engine, EngineError, server_urls


def train(
    config: TrainConfig, *, overwrite: bool = False, resume: bool = False, console: Console | None = None
) -> dict[str, Any]:
    """Run ``train_async`` to completion."""
    return asyncio.run(train_async(config, overwrite=overwrite, resume=resume, console=console))


@bounded_stops  # a Ctrl-C that does not stop the run in time is forced
async def train_async(
    config: TrainConfig, *, overwrite: bool = False, resume: bool = False, console: Console | None = None
) -> dict[str, Any]:
    """Train for ``train.steps`` steps; the last step's metrics, and the first eval as ``start/...``."""
    config, ranks = _join_ranks(config)
    console = console or Console(stderr=True)
    if not ranks.main:  # rank 0 reports for all
        console = Console(file=io.StringIO())
    out = Path(config.output_dir)
    try:
        with console.status(f"loading {config.model} and checking the run's inputs"):
            run = build_run(config, overwrite, resume, console, ranks)
        return await run_training(run)
    except BaseException:
        if ranks.main and put_back(out, TRAINING.outputs):
            console.print(
                f"{out}: the new run stopped before its first step, so the run it replaced is put back; "
                f"what the new one wrote is in {out / FAILED}"
            )
        raise
    finally:
        close_ranks(ranks)
        if ranks.main:
            release(out)


def _join_ranks(config: TrainConfig) -> tuple[TrainConfig, Ranks]:
    """This process's rank (one process: ``SINGLE``) and the config with its device."""
    if config.train.fsdp and launched_ranks() <= 1:
        raise ValueError("train.fsdp shards the policy across processes: start the run with torchrun")
    ranks, device = init_ranks(policy_device(config))
    update: dict[str, Any] = {"train": config.train.model_copy(update={"device": device})}
    if isinstance(config.engine, HFEngineConfig):
        update["engine"] = config.engine.model_copy(update={"device": device})
    return config.model_copy(update=update), ranks


def build_run(
    config: TrainConfig, overwrite: bool, resume: bool, console: Console, ranks: Ranks = SINGLE
) -> Run:
    """Check the output folder, load data, models, optimizer and engine; restore a checkpoint."""
    out = Path(config.output_dir)
    open_output(out, TRAINING, config, overwrite, resume, writer=ranks.main)
    resumed = latest(out, console.print) if resume else None
    barrier(ranks)  # every rank has checked the folder before rank 0 writes to it
    hf_logging.disable_progress_bar()
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    kind = env_kind(config.env)
    entry, env_factory = kind.inputs()
    data = Data(
        load_samples(config.data, entry),
        load_samples(config.eval.data, entry) if config.eval.data else [],
        load_samples(config.warm_start.data, entry) if config.warm_start else [],
    )
    kind.check(data.train, env_factory)
    spec = resolve_model(config.model)
    learner, engine = _learner_and_engine(config, spec, resumed, console, ranks)
    rollout = _rollout_spec(config, build_spec(config, engine, learner.tokenizer, env_factory), engine)
    rollout = kind.complete(rollout, config.model, out)
    check_template(rollout.encoder, data.train[0])
    if ranks.main:
        start_output(out, TRAINING, config, resume)  # every input is valid: now the folder may change
    barrier(ranks)  # rank 0 has emptied the folder before any rank writes its rollouts there
    run = Run(learner, engine, rollout, data, out, console)
    if resumed:
        load = functools.partial(load_optimizer_state, learner.sharded, learner.optimizer)
        run.step = restore_training_state(
            resumed.model_dir.parent, learner.optimizer, learner.scheduler, load if learner.sharded else None
        )
        run.resumed = True
        console.print(f"resuming from {resumed.model_dir.parent} (step {run.step})")
    return run


def _learner_and_engine(
    config: TrainConfig, spec: ModelSpec, resumed: Resumed | None, console: Console, ranks: Ranks
) -> tuple[Learner, Engine]:
    """The policy (a checkpoint's on resume), its reference, optimizer and scheduler; the engine,
    built on the plain policy before LoRA wraps it (a resume pushes its weights later)."""
    tokenizer = load_tokenizer(spec)
    device = policy_device(config)
    opt = config.optim
    adapters = resumed.model_dir if resumed and saved_adapter(resumed.model_dir) else None
    policy = load_model(str(resumed.model_dir) if resumed and not adapters else spec, device=device)
    ref = load_model(spec, device=device).requires_grad_(False) if config.algorithm.kl_coef > 0 else None
    engine = _engine(config, policy, spec, tokenizer, console, ranks)
    if opt.lora is not None:
        policy = wrap_lora(policy, opt.lora, adapters)
    else:
        trainable_parameters(policy, opt.trainable)
    sharded = shard_policy(policy, ranks) if config.train.fsdp else None
    params = [p for p in policy.parameters() if p.requires_grad]  # sharded ones under FSDP
    optimizer, scheduler = make_optimizer(params, opt)
    return Learner(config, policy, ref, tokenizer, optimizer, scheduler, ranks, sharded), engine


def _rollout_spec(config: TrainConfig, spec: RolloutSpec, engine: Engine) -> RolloutSpec:
    """The run's rollout spec as training needs it: each turn's inference-time context recorded for
    ``algorithm.samples: inference``, off-policy tokens masked if asked, and a pause/resume control
    for server engines under overlapped training (their turns pause for a weight update)."""
    spec = dataclasses.replace(
        spec,
        inference_contexts=spec.inference_contexts or config.algorithm.samples == "inference",
        mask_offpolicy=config.algorithm.offpolicy_tokens == "mask",
    )
    if config.train.overlap and not isinstance(engine, HFEngine):
        spec = dataclasses.replace(spec, control=RolloutControl())
    return spec


def _engine(
    config: TrainConfig, policy: Any, spec: ModelSpec, tokenizer: Any, console: Console, ranks: Ranks
) -> Engine:
    """The rollout engine for the plain (not yet LoRA-wrapped) policy: the embedded one on a copy of
    it, or vLLM servers (``training_server_engine``)."""
    e = config.engine
    if isinstance(e, VLLMEngineConfig):
        return training_server_engine(config, e, console, ranks)
    if not isinstance(e, HFEngineConfig):  # refused by TrainConfig; here for the type checker
        raise TypeError(f"turnrl train cannot update the weights of engine.kind {e.kind!r}")
    engine_model = torch.nn.Module.to(copy.deepcopy(policy), dtype=getattr(torch, e.dtype))
    return HFEngine(
        engine_model, tokenizer, vision=load_vision_processor(spec, tokenizer), **hf_engine_options(e)
    )


def training_server_engine(
    config: TrainConfig, e: VLLMEngineConfig, console: Console, ranks: Ranks
) -> Engine:
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
            shared = server_urls(engine)
        except Exception as exc:  # told to every rank, which all stop with it
            shared = describe(exc)
    urls = gather(shared, ranks)[0]
    if not isinstance(urls, list):
        raise EngineError(f"the first rank's vLLM servers did not start: {urls}")
    if engine is not None:
        return engine
    return local_engine(config.model, e.model_copy(update={"urls": urls}), seed=config.seed)[0]
