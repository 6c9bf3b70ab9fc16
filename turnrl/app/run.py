"""A whole ``turnrl rollout`` run from a config: validate everything, then collect with a progress bar."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from turnrl.app.engines import build_engine
from turnrl.app.kinds import env_kind
from turnrl.app.output import ROLLOUT, open_output, start_output
from turnrl.app.parts import RunError, build_spec, load_samples
from turnrl.app.preflight import check_template
from turnrl.config import RunConfig
from turnrl.record.codec import json_line
from turnrl.record.writer import JsonlWriter
from turnrl.rollout.collector import collect, keep_turns_of, recover, starts_a_run
from turnrl.rollout.failures import FAILURES, check_failures
from turnrl.rollout.metrics import run_reward, summarize, turn_record
from turnrl.rollout.spec import RolloutSpec, TurnHook, close_spec
from turnrl.support.progress import LoggedProgress
from turnrl.support.run_folder import FAILED, drop_aside, put_back, release
from turnrl.support.stopping import bounded_stops
from turnrl.types import Sample, Trajectory, Turn

TRAJECTORIES = "trajectories.jsonl"
TURNS = "turns.jsonl"
SUMMARY = "summary.json"
SERVERS = "servers"  # logs of the servers a run starts


@dataclass
class Prepared:
    """A validated run, ready to collect."""

    config: RunConfig
    samples: list[Sample]
    spec: RolloutSpec
    out_dir: Path
    resume: bool = False


def prepare(
    config: RunConfig, overwrite: bool = False, resume: bool = False, console: Console | None = None
) -> Prepared:
    """Validate env, data, rewards and output folder, then load the model (or start its servers,
    which log into ``OUT/servers/``). Writes nothing else."""
    kind = env_kind(config.env)
    entry, env_factory = kind.inputs()
    samples = load_samples(config.data, entry)
    out_dir = Path(config.output_dir)
    open_output(out_dir, ROLLOUT, config, overwrite, resume)
    kind.check(samples, env_factory)
    console = console or Console(stderr=True)
    with console.status(f"loading {config.model}") as status:
        engine, tokenizer = build_engine(config, out_dir / SERVERS, say=status.update)
    spec = kind.complete(build_spec(config, engine, tokenizer, env_factory), config.model, out_dir)
    try:
        check_template(spec.encoder, samples[0])
    except RunError:
        asyncio.run(engine.close())
        raise
    return Prepared(config, samples, spec, out_dir, resume)


def _progress(console: Console) -> Progress:
    return LoggedProgress(
        TextColumn("[bold]rollout"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "reward {task.fields[reward]} (runs not failed)  turns {task.fields[turns]:.1f}  "
            "failed {task.fields[failed]}"
        ),
        TimeElapsedColumn(),
        console=console,
    )


class _Tally:
    """Running numbers for the progress bar, per run (an agent run's branches count once): the
    reward over the runs that did not fail (a failed one's 0 says nothing of the model), and how
    many failed. The summary's ``reward/mean`` counts failed runs as their 0; its
    ``reward/scored_mean`` is the bar's."""

    def __init__(self, trajs: list[Trajectory]) -> None:
        self.count = self.scored = self.failed = 0
        self.reward = self.turns = 0.0
        for traj in trajs:
            self.add(traj)

    def add(self, traj: Trajectory) -> dict[str, Any]:
        """Count one more trajectory (a run's first); the bar's fields."""
        if not starts_a_run(traj):
            return self.fields()
        self.count += 1
        self.turns += traj.run.calls if traj.run is not None else traj.num_turns
        if traj.stop_reason in FAILURES:
            self.failed += 1
        else:
            self.scored += 1
            self.reward += run_reward(traj)
        return self.fields()

    def fields(self) -> dict[str, Any]:
        """The bar's fields now."""
        reward = f"{self.reward / self.scored:.3f}" if self.scored else "-"
        return {"reward": reward, "turns": self.turns / max(self.count, 1), "failed": self.failed}


def _turn_logger(prepared: Prepared) -> tuple[TurnHook | None, JsonlWriter | None]:
    if not prepared.config.rollout.log_turns:
        return None, None
    writer = JsonlWriter(prepared.out_dir / TURNS, fsync=False)

    def log(sample: Sample, index: int, turn_index: int, turn: Turn) -> None:
        writer.write_record(turn_record(sample.id, index, turn_index, turn))

    return log, writer


def _start_output(prepared: Prepared, console: Console) -> list[Trajectory]:
    """Create the output folder; on resume, recover what is on disk (the turn log cut to the
    finished trajectories' turns), else start empty."""
    out = prepared.out_dir
    start_output(out, ROLLOUT, prepared.config, prepared.resume)
    if not prepared.resume:
        return []
    done, _ = recover(out / TRAJECTORIES, say=console.print)
    keep_turns_of(out / TURNS, {(t.group_id, t.sample_index) for t in done})
    return done


@bounded_stops  # a Ctrl-C that does not stop the run in time is forced
async def run_prepared(prepared: Prepared, console: Console | None = None) -> dict[str, Any]:
    """Collect every trajectory, writing each as it finishes; return the run summary. Stops with
    ``RunFailed`` (what was written kept) when more than ``rollout.fail_fraction`` of them failed."""
    console = console or Console(stderr=True)
    cfg = prepared.config
    finished = _start_output(prepared, console)
    skip = {(t.group_id, t.sample_index) for t in finished}
    if prepared.resume:
        console.print(f"resuming: {len(skip)} trajectories already on disk")
    prepared.spec.on_turn, turn_writer = _turn_logger(prepared)
    tally = _Tally(finished)
    good = any(t.stop_reason not in FAILURES for t in finished)
    try:
        with _progress(console) as bar:
            total = len(prepared.samples) * cfg.rollout.group_size
            task = bar.add_task("rollout", total=total, completed=len(skip), **tally.fields())

            def on_done(traj: Trajectory) -> None:
                nonlocal good
                finished.append(traj)
                bar.update(task, advance=int(starts_a_run(traj)), **tally.add(traj))
                if not good and traj.stop_reason not in FAILURES:
                    good = True
                    drop_aside(prepared.out_dir)  # the run an --overwrite replaced goes only now

            try:
                await collect(
                    prepared.samples,
                    prepared.spec,
                    group_size=cfg.rollout.group_size,
                    concurrency=cfg.rollout.concurrency,
                    out_path=prepared.out_dir / TRAJECTORIES,
                    on_done=on_done,
                    skip=skip,
                )
            finally:
                await close_spec(prepared.spec)  # a harness's gateway, Ray env workers
                await prepared.spec.engine.close()
                if turn_writer:
                    turn_writer.close()
        summary = summarize(finished)
        (prepared.out_dir / SUMMARY).write_text(json.dumps(json.loads(json_line(summary)), indent=2))
    finally:
        if not good and put_back(prepared.out_dir, ROLLOUT.outputs):
            console.print(
                f"{prepared.out_dir}: the new run has no usable trajectory, so the run it replaced is put "
                f"back; what the new one wrote is in {prepared.out_dir / FAILED}"
            )
        release(prepared.out_dir)
    check_failures(finished, cfg.rollout.fail_fraction, "the rollout")
    return summary


def run(
    config: RunConfig, overwrite: bool = False, resume: bool = False, console: Console | None = None
) -> dict[str, Any]:
    """Prepare and run."""
    return asyncio.run(run_prepared(prepare(config, overwrite, resume, console), console))
