"""A whole rollout run from a config: validate everything, then collect with a progress bar."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from turnrl.chat.encoder import ChatEncoder
from turnrl.config import DataConfig, RunConfig
from turnrl.data import read_rows, to_samples
from turnrl.engines.base import Engine
from turnrl.env.registry import EnvEntry, resolve_env
from turnrl.imports import import_object
from turnrl.rewards import register_reward
from turnrl.rollout.collector import collect, summarize
from turnrl.rollout.loop import RolloutSpec
from turnrl.types import Sample, Trajectory

TRAJECTORIES = "trajectories.jsonl"


class RunError(ValueError):
    """A run that cannot start; the message says why."""


@dataclass
class Prepared:
    """A validated run, ready to collect."""

    config: RunConfig
    samples: list[Sample]
    spec: RolloutSpec
    out_dir: Path


def load_samples(data: DataConfig, entry: EnvEntry) -> list[Sample]:
    """Samples from a file, a generator, or the env's own data."""
    if data.path:
        return to_samples(read_rows(data.path), data.path, data.limit)
    if data.generator:
        rows = import_object(data.generator, "data generator")(**data.kwargs)
        return to_samples(rows, data.generator, data.limit)
    if entry.dataset is None:
        raise RunError("no data: set data.path or data.generator (this env has no data of its own)")
    return to_samples(entry.dataset(**data.kwargs), "the env's data", data.limit)


def build_engine(config: RunConfig) -> tuple[Engine, Any]:
    """The engine and the tokenizer for ``config.model``."""
    from turnrl.engines.hf import HFEngine

    engine = HFEngine.from_spec(
        config.model,
        max_batch_size=config.engine.max_batch_size,
        dtype=config.engine.dtype,
        device=config.engine.device,
    )
    return engine, engine.tokenizer


def prepare(config: RunConfig, overwrite: bool = False) -> Prepared:
    """Validate env, data, rewards and output folder, then load the model. Writes nothing."""
    entry = resolve_env(config.env.name)
    samples = load_samples(config.data, entry)
    for source, fn_spec in config.rewards.items():
        register_reward(source, import_object(fn_spec, f"reward for {source!r}"))
    out_dir = Path(config.output_dir)
    if (out_dir / TRAJECTORIES).exists() and not overwrite:
        raise RunError(f"{out_dir / TRAJECTORIES} already exists (pass --overwrite or set output_dir)")
    engine, tokenizer = build_engine(config)
    spec = RolloutSpec(
        env_factory=entry.bind(config.env.kwargs),
        engine=engine,
        encoder=ChatEncoder(tokenizer, config.chat.template_kwargs),
        sampling=config.sampling.params(seed=config.rollout.seed),
        limits=config.limits.limits(),
        check=config.chat.check,
    )
    return Prepared(config, samples, spec, out_dir)


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]rollout"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]:.3f}  turns {task.fields[turns]:.1f}"),
        TimeElapsedColumn(),
        console=console,
    )


async def run_prepared(prepared: Prepared, console: Console | None = None) -> dict[str, Any]:
    """Collect every trajectory, writing each as it finishes; return the run summary."""
    console = console or Console(stderr=True)
    cfg = prepared.config
    out = prepared.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / TRAJECTORIES).unlink(missing_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    total = len(prepared.samples) * cfg.rollout.n
    finished: list[Trajectory] = []
    with _progress(console) as bar:
        task = bar.add_task("rollout", total=total, reward=0.0, turns=0.0)

        def on_done(traj: Trajectory) -> None:
            finished.append(traj)
            n = len(finished)
            bar.update(
                task,
                advance=1,
                reward=sum(t.reward for t in finished) / n,
                turns=sum(t.num_turns for t in finished) / n,
            )

        try:
            await collect(
                prepared.samples,
                prepared.spec,
                cfg.rollout.n,
                cfg.rollout.concurrency,
                out / TRAJECTORIES,
                on_done,
            )
        finally:
            await prepared.spec.engine.close()
    summary = summarize(finished)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def run(config: RunConfig, overwrite: bool = False, console: Console | None = None) -> dict[str, Any]:
    """Prepare and run."""
    return asyncio.run(run_prepared(prepare(config, overwrite), console))
