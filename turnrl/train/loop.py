"""A training run from its first step to its last: one step after another (``trainer.train_step``)
or overlapped with rollouts (``overlap``), held-out evaluation and checkpoints when due.
``app.training`` builds the run and calls ``run_training``."""

from __future__ import annotations

import shutil
from typing import Any

from turnrl.config import VLLMEngineConfig
from turnrl.rollout.spec import close_spec
from turnrl.support.run_folder import drop_aside
from turnrl.train.checkpoint import save
from turnrl.train.metrics import MetricsLog, held_out_summary, make_tracker, plot_rewards, step_warnings
from turnrl.train.overlap import Feed, overlapped_step, start_feed
from turnrl.train.progress import TrainProgress
from turnrl.train.sft import warm_start
from turnrl.train.state import Run
from turnrl.train.trainer import evaluate, train_step
from turnrl.train.weight_sync import push_weights


def is_due(step: int, every: int, last: int) -> bool:
    """Whether something done ``every`` steps (and at the ``last``) is due at ``step``."""
    return step == last or (every > 0 and step % every == 0)


async def run_training(run: Run) -> dict[str, Any]:
    """Train from ``run.step`` to ``train.steps``; the last step's metrics, and the first
    evaluation's as ``start/...``. Closes the engine at the end."""
    config, console, main = run.config, run.console, run.ranks.main
    ranks = f" on {run.ranks.world} ranks" if run.ranks.distributed else ""
    console.print(
        f"{config.model}: {len(run.data.train)} training prompts, {len(run.data.held_out)} held-out{ranks}; "
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
                log.log(0, steps, await start_record(run))
            metrics: dict[str, float] = {}
            feed = start_feed(run, first + 1) if config.train.overlap else None
            for step in range(first + 1, steps + 1):
                metrics = await (overlapped_step(run, step, feed) if feed else train_step(run, step))
                if is_due(step, config.eval.every, steps):
                    metrics |= await evaluate(run, step)
                run.step = step
                log.log(step, steps, metrics)
                for line in step_warnings(step, metrics) if main else ():
                    console.print(line, style="yellow", markup=False, highlight=False)
                if step == first + 1 and main:
                    drop_aside(run.out_dir)  # the run an --overwrite replaced goes only now
                if is_due(step, config.train.save_every, steps):
                    save(run, step)
                run.progress.step_done(step)
    finally:
        if feed is not None:
            await feed.stop()
        run.progress = None
        log.close()
        await close_spec(run.spec)  # a harness's gateway, Ray env workers
        await run.engine.close()
        run.updates.shutdown(wait=False)  # idle: the last update has ended
        engine = config.engine
        if run.weights_dir is not None and not (isinstance(engine, VLLMEngineConfig) and engine.weights_dir):
            shutil.rmtree(run.weights_dir, ignore_errors=True)
    if config.train.plot and main:
        console.print(plot_rewards(log.records, run.out_dir / "rewards.png"))
    first_record = log.records[0] if log.records else {}
    console.print(held_out_summary(log.records))
    return metrics | {f"start/{k}": v for k, v in first_record.items() if k.startswith("eval")}


async def start_record(run: Run) -> dict[str, float]:
    """The step-0 record: held-out metrics, and with a warm start, those before it as ``base/...``."""
    if run.config.warm_start is None:
        return await evaluate(run, 0)
    record = {f"base/{k}": v for k, v in (await evaluate(run, 0, "base")).items()}
    # every rank replays the same demonstrations: FSDP sums their equal gradients, hence 1 / W
    learner = run.learner
    scale = 1.0 / run.ranks.world if learner.sharded is not None else 1.0
    record |= await warm_start(
        learner.policy, run.spec, run.config, run.data.warm_start, run.progress, learner.sharded, scale
    )
    await push_weights(run)
    save(run, 0)  # a resume never redoes the warm start
    return record | await evaluate(run, 0)
