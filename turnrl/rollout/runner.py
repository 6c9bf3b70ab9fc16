"""A whole rollout run from a config: validate everything, then collect with a progress bar."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from turnrl.chat.encoder import ChatEncoder
from turnrl.config import DataConfig, EngineConfig, RunConfig
from turnrl.data import read_rows, to_samples
from turnrl.engines.base import Engine
from turnrl.env.base import EnvFactory
from turnrl.env.registry import EnvEntry, resolve_env
from turnrl.imports import import_object
from turnrl.models import load_vision_processor
from turnrl.rewards import register_reward
from turnrl.rollout.collector import JsonlWriter, collect, recover
from turnrl.rollout.loop import RolloutSpec, TurnHook
from turnrl.rollout.metrics import summarize, turn_record
from turnrl.types import Sample, Trajectory, Turn

TRAJECTORIES = "trajectories.jsonl"
TURNS = "turns.jsonl"
SUMMARY = "summary.json"


class RunError(ValueError):
    """A run that cannot start; the message says why."""


@dataclass
class Prepared:
    """A validated run, ready to collect."""

    config: RunConfig
    samples: list[Sample]
    spec: RolloutSpec
    out_dir: Path
    resume: bool = False


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
    """The engine and the tokenizer for ``config.model``: in this process, or on Ray (``engine.ray``)."""
    if config.engine.ray.enabled:
        return _ray_engine(config)
    return local_engine(config.model, config.engine)


def local_engine(model: str, e: EngineConfig) -> tuple[Engine, Any]:
    """The engine ``e`` describes, in this process (servers: their clients), and the tokenizer."""
    if e.kind == "hf":
        from turnrl.engines.hf import HFEngine

        engine = HFEngine.from_spec(model, max_batch_size=e.max_batch_size, dtype=e.dtype, device=e.device)
        return engine, engine.tokenizer
    from turnrl.models import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(model)
    if e.kind == "vllm":
        from turnrl.engines.vllm_inproc import VLLMEngine

        return VLLMEngine(resolve_model(model).path, **e.vllm_kwargs), tokenizer
    return server_engine(e, tokenizer), tokenizer


def _ray_engine(config: RunConfig) -> tuple[Engine, Any]:
    """Engine actors on Ray and / or the engines of a registry (``engine.ray``)."""
    from turnrl.models import load_tokenizer

    try:
        from turnrl.distributed.registry_engine import ray_engine
    except ImportError as exc:
        raise RunError(f"engine.ray.enabled needs ray: pip install 'turnrl[ray]' ({exc})") from None
    tokenizer = load_tokenizer(config.model)
    try:
        return ray_engine(config.model, config.engine, tokenizer), tokenizer
    except TimeoutError as exc:
        raise RunError(str(exc)) from None


def server_engine(e: EngineConfig, tokenizer: Any) -> Engine:
    """OpenAI-compatible or SGLang servers; several URLs go behind a load balancer."""
    from turnrl.engines.balancer import BalancedEngine
    from turnrl.engines.openai import OpenAIEngine
    from turnrl.engines.sglang import SGLangEngine

    if not e.urls:
        raise RunError(f"engine.kind {e.kind!r} needs engine.urls (the servers' base URLs)")
    eos = [i for i in (tokenizer.eos_token_id,) if i is not None]
    key = os.environ.get(e.api_key_env) if e.api_key_env else None
    common: dict[str, Any] = {
        "eos_token_ids": eos,
        "api_key": key,
        "timeout_s": e.timeout_s,
        "max_retries": e.max_retries,
        "retry_budget_s": e.retry_budget_s,
    }
    engines: list[Engine] = [
        SGLangEngine(url, **common)
        if e.kind == "sglang"
        else OpenAIEngine(url, e.served_model, dialect=e.dialect, **common)
        for url in e.urls
    ]
    if len(engines) == 1:
        return engines[0]
    return BalancedEngine(
        engines, max_sticky_turns=e.max_sticky_turns, load_factor=e.load_factor, cooloff_s=e.cooloff_s
    )


def build_env_factory(config: RunConfig, entry: EnvEntry) -> EnvFactory:
    """The env factory: in-process, or each env built and run in a Ray worker actor."""
    if not config.env.ray.enabled:
        return entry.bind(config.env.kwargs)
    entry.bind(config.env.kwargs)  # check the kwargs here, before any worker starts
    try:
        from turnrl.distributed import ray_env_factory
    except ImportError as exc:
        raise RunError(f"env.ray.enabled needs ray: pip install 'turnrl[ray]' ({exc})") from None
    return ray_env_factory(entry.factory, config.env.kwargs, config.env.ray)


RESUME_KEYS = ("model", "env", "data", "chat", "sampling", "limits", "rewards")


def _check_resumable(config: RunConfig, out_dir: Path) -> None:
    """A resume must run what the first run ran; name the first key that differs."""
    saved_path = out_dir / "config.yaml"
    if not saved_path.exists():
        raise RunError(f"cannot resume: {saved_path} is missing")
    saved = yaml.safe_load(saved_path.read_text()) or {}
    current = config.model_dump()
    for key in (*RESUME_KEYS, "rollout"):
        a, b = saved.get(key), current.get(key)
        if key == "rollout" and isinstance(a, dict) and isinstance(b, dict):
            a, b = {k: a.get(k) for k in ("n", "seed")}, {k: b.get(k) for k in ("n", "seed")}
        if a != b:
            raise RunError(f"cannot resume: config key {key!r} differs from the run in {out_dir}")


def prepare(config: RunConfig, overwrite: bool = False, resume: bool = False) -> Prepared:
    """Validate env, data, rewards and output folder, then load the model. Writes nothing."""
    entry = resolve_env(config.env.name)
    samples = load_samples(config.data, entry)
    for source, fn_spec in config.rewards.items():
        register_reward(source, import_object(fn_spec, f"reward for {source!r}"))
    out_dir = Path(config.output_dir)
    exists = (out_dir / TRAJECTORIES).exists()
    if resume and overwrite:
        raise RunError("--resume and --overwrite exclude each other")
    if resume and exists:
        _check_resumable(config, out_dir)
    elif exists and not overwrite:
        raise RunError(
            f"{out_dir / TRAJECTORIES} already exists (pass --resume, --overwrite or set output_dir)"
        )
    engine, tokenizer = build_engine(config)
    spec = RolloutSpec(
        env_factory=build_env_factory(config, entry),
        engine=engine,
        encoder=ChatEncoder(
            tokenizer, config.chat.template_kwargs, load_vision_processor(config.model, tokenizer)
        ),
        sampling=config.sampling.params(seed=config.rollout.seed),
        limits=config.limits.limits(),
        check=config.chat.check,
    )
    return Prepared(config, samples, spec, out_dir, resume)


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]rollout"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]:.3f}  turns {task.fields[turns]:.1f}"),
        TimeElapsedColumn(),
        console=console,
    )


class _Tally:
    """Running means for the progress bar."""

    def __init__(self, trajs: list[Trajectory]) -> None:
        self.count = len(trajs)
        self.reward = sum(t.reward for t in trajs)
        self.turns = sum(t.num_turns for t in trajs)

    def add(self, traj: Trajectory) -> tuple[float, float]:
        """Count one more trajectory; return the mean reward and mean turns."""
        self.count += 1
        self.reward += traj.reward
        self.turns += traj.num_turns
        return self.reward / self.count, self.turns / self.count


def _turn_logger(prepared: Prepared) -> tuple[TurnHook | None, JsonlWriter | None]:
    if not prepared.config.rollout.log_turns:
        return None, None
    writer = JsonlWriter(prepared.out_dir / TURNS, fsync=False)

    def log(sample: Sample, index: int, turn_index: int, turn: Turn) -> None:
        writer.write_record(turn_record(sample.id, index, turn_index, turn))

    return log, writer


def _start_output(prepared: Prepared) -> list[Trajectory]:
    """Create the output folder; on resume, recover what is on disk, else start empty."""
    out = prepared.out_dir
    out.mkdir(parents=True, exist_ok=True)
    if prepared.resume:
        done, _ = recover(out / TRAJECTORIES)
        return done
    (out / TRAJECTORIES).unlink(missing_ok=True)
    (out / TURNS).unlink(missing_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(prepared.config.model_dump(), sort_keys=False))
    return []


async def run_prepared(prepared: Prepared, console: Console | None = None) -> dict[str, Any]:
    """Collect every trajectory, writing each as it finishes; return the run summary."""
    console = console or Console(stderr=True)
    cfg = prepared.config
    finished = _start_output(prepared)
    skip = {(t.group_id, t.sample_index) for t in finished}
    if prepared.resume:
        console.print(f"resuming: {len(skip)} trajectories already on disk")
    prepared.spec.on_turn, turn_writer = _turn_logger(prepared)
    tally = _Tally(finished)
    with _progress(console) as bar:
        total = len(prepared.samples) * cfg.rollout.n
        task = bar.add_task("rollout", total=total, completed=len(skip), reward=0.0, turns=0.0)

        def on_done(traj: Trajectory) -> None:
            finished.append(traj)
            reward, turns = tally.add(traj)
            bar.update(task, advance=1, reward=reward, turns=turns)

        try:
            out = prepared.out_dir / TRAJECTORIES
            await collect(
                prepared.samples, prepared.spec, cfg.rollout.n, cfg.rollout.concurrency, out, on_done, skip
            )
        finally:
            await prepared.spec.engine.close()
            if turn_writer:
                turn_writer.close()
            shutdown = getattr(prepared.spec.env_factory, "shutdown", None)
            if callable(shutdown):
                shutdown()  # stop the Ray env workers
    summary = summarize(finished)
    (prepared.out_dir / SUMMARY).write_text(json.dumps(summary, indent=2))
    return summary


def run(
    config: RunConfig, overwrite: bool = False, resume: bool = False, console: Console | None = None
) -> dict[str, Any]:
    """Prepare and run."""
    return asyncio.run(run_prepared(prepare(config, overwrite, resume), console))
