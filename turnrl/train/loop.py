"""``turnrl train``: the run from start to end, one step after another (``trainer.train_step``)
or overlapped with rollouts (``overlap``), in one process or as a data-parallel rank."""

from __future__ import annotations

import asyncio
import io
import shutil
from pathlib import Path
from typing import Any

from rich.console import Console

from turnrl.config import HFEngineConfig
from turnrl.run_folder import FAILED, drop_aside, put_back, release
from turnrl.train.checkpoint import OUTPUTS
from turnrl.train.config import TrainConfig, policy_device
from turnrl.train.data_parallel import Ranks, close_ranks, init_ranks, launched_ranks
from turnrl.train.metrics import MetricsLog, held_out_summary, make_tracker, plot_rewards
from turnrl.train.overlap import Feed, overlapped_step, start_feed
from turnrl.train.progress import TrainProgress
from turnrl.train.trainer import Run, _due, _save, _start, build_run, evaluate, push_weights, train_step


async def train_async(
    config: TrainConfig, *, overwrite: bool = False, resume: bool = False, console: Console | None = None
) -> dict[str, Any]:
    """Train for ``train.steps`` steps; the last step's metrics, and the first eval as ``start/...``.
    Started by ``torchrun``, each process is one data-parallel rank (see ``data_parallel``)."""
    config, ranks = _join_ranks(config)
    console = console or Console(stderr=True)
    if not ranks.main:  # rank 0 reports for all
        console = Console(file=io.StringIO())
    try:
        with console.status(f"loading {config.model} and checking the run's inputs"):
            run = build_run(config, overwrite, resume, console, ranks)
        return await _train_loop(run)
    except BaseException:
        out = Path(config.output_dir)
        if ranks.main and put_back(out, OUTPUTS):
            console.print(
                f"{out}: the new run stopped before its first step, so the run it replaced is put back; "
                f"what the new one wrote is in {out / FAILED}"
            )
        raise
    finally:
        close_ranks(ranks)
        if ranks.main:
            release(Path(config.output_dir))


def _join_ranks(config: TrainConfig) -> tuple[TrainConfig, Ranks]:
    """This process's rank (one process: ``SINGLE``) and the config with its device."""
    if config.train.fsdp and launched_ranks() <= 1:
        raise ValueError("train.fsdp shards the policy across processes: start the run with torchrun")
    ranks, device = init_ranks(policy_device(config))
    update: dict[str, Any] = {"train": config.train.model_copy(update={"device": device})}
    if isinstance(config.engine, HFEngineConfig):
        update["engine"] = config.engine.model_copy(update={"device": device})
    return config.model_copy(update=update), ranks


async def _train_loop(run: Run) -> dict[str, Any]:
    config, console, main = run.config, run.console or Console(stderr=True), run.ranks.main
    ranks = f" on {run.ranks.world} ranks" if run.ranks.distributed else ""
    console.print(
        f"{config.model}: {len(run.samples)} training prompts, {len(run.eval_samples)} held-out{ranks}; "
        f"writing {run.out_dir}"
    )
    tracker = (
        make_tracker(config.train.tracker, run.out_dir, config.model_dump(mode="json")) if main else None
    )
    log = MetricsLog(run.out_dir, console, tracker, run.step if run.resumed else None, write=main)
    steps, first = config.train.steps, run.step
    run.progress = TrainProgress(console, steps, first)
    feed: Feed | None = None
    try:
        with run.progress:
            if run.resumed:  # the engine serves the base model: give it the checkpoint's weights
                await push_weights(run)
            else:
                log.log(0, steps, await _start(run))
            metrics: dict[str, float] = {}
            feed = start_feed(run, first + 1) if config.train.overlap else None
            for step in range(first + 1, steps + 1):
                metrics = await (overlapped_step(run, step, feed) if feed else train_step(run, step))
                if _due(step, config.eval.every, steps):
                    metrics |= await evaluate(run, step)
                run.step = step
                log.log(step, steps, metrics)
                if step == first + 1 and main:
                    drop_aside(run.out_dir)  # the run an --overwrite replaced goes only now
                if _due(step, config.train.save_every, steps):
                    _save(run, step)
                run.progress.step_done(step)
    finally:
        if feed is not None:
            await feed.stop()
        run.progress = None
        log.close()
        await run.engine.close()
        if run.weights_dir is not None and not getattr(config.engine, "weights_dir", None):
            shutil.rmtree(run.weights_dir, ignore_errors=True)
    if config.train.plot and main:
        console.print(plot_rewards(log.records, run.out_dir / "rewards.png"))
    first_record = log.records[0] if log.records else {}
    console.print(held_out_summary(log.records))
    return metrics | {f"start/{k}": v for k, v in first_record.items() if k.startswith("eval")}


def train(
    config: TrainConfig, *, overwrite: bool = False, resume: bool = False, console: Console | None = None
) -> dict[str, Any]:
    """Run ``train_async`` to completion."""
    return asyncio.run(train_async(config, overwrite=overwrite, resume=resume, console=console))
