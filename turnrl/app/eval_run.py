"""``turnrl eval CONFIG [--checkpoint DIR]``: the held-out set of a train config, rolled out by the
config's model or a checkpoint of it; mean reward and pass@k per data source with 95% intervals."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from turnrl.app.engines import build_engine
from turnrl.app.kinds import env_kind
from turnrl.app.output import EVAL, open_output
from turnrl.app.parts import RunError, build_spec, load_samples
from turnrl.app.preflight import check_template
from turnrl.app.run import SERVERS
from turnrl.rollout.collector import starts_a_run
from turnrl.rollout.failures import FAILURES
from turnrl.rollout.spec import close_spec
from turnrl.support.progress import LoggedProgress
from turnrl.support.run_folder import release
from turnrl.support.stopping import bounded_stops
from turnrl.train.config import TrainConfig
from turnrl.train.evaluation import (
    EVAL_SEED_OFFSET,
    EvalRow,
    prompt_rows,
    prompt_table,
    report_table,
    run_eval,
)
from turnrl.types import Trajectory

EVAL_FILE = "eval.jsonl"  # the trajectories; eval.json beside it holds the numbers


def checkpoint_model(checkpoint: Path, base: str, out_dir: Path) -> str:
    """The model folder of a checkpoint (``step_N/``, its ``model/``, or any saved model folder).
    LoRA adapters are merged into the config's model once, into ``out_dir/merged_model``."""
    folder = checkpoint / "model" if (checkpoint / "model").is_dir() else checkpoint
    if (folder / "adapter_config.json").is_file():
        return str(_merge_adapters(folder, base, out_dir / "merged_model"))
    if not (folder / "config.json").is_file():
        raise RunError(f"no model in {checkpoint} (expected a checkpoint step folder or a model folder)")
    return str(folder)


def _merge_adapters(adapters: Path, base: str, out: Path) -> Path:
    from peft import PeftModel

    from turnrl.models import load_model, load_tokenizer

    merged = PeftModel.from_pretrained(load_model(base), str(adapters)).merge_and_unload()
    merged.save_pretrained(out)
    load_tokenizer(base).save_pretrained(out)
    return out


def _progress(console: Console) -> Progress:
    return LoggedProgress(
        TextColumn("[bold]eval"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]}  failed {task.fields[failed]}"),
        TimeElapsedColumn(),
        console=console,
    )


@bounded_stops  # a Ctrl-C that does not stop the run in time is forced
async def evaluate_config(
    config: TrainConfig, checkpoint: Path | None, out_dir: Path, console: Console
) -> tuple[list[Trajectory], list[EvalRow]]:
    """Validate, load, roll out the held-out prompts and write ``out_dir/eval.jsonl`` and ``eval.json``."""
    if config.eval.data is None:
        raise RunError("the config has no held-out set: set eval.data (e.g. --set eval.data.path=FILE)")
    kind = env_kind(config.env)
    entry, env_factory = kind.inputs()
    samples = load_samples(config.eval.data, entry)
    open_output(out_dir, EVAL, config, overwrite=True, resume=False)  # locked: one evaluation at a time
    kind.check(samples, env_factory)
    if checkpoint is not None:
        with console.status(f"reading {checkpoint}"):
            model = checkpoint_model(checkpoint, config.model, out_dir)
        config = config.model_copy(update={"model": model})
    with console.status(f"loading {config.model}") as status:
        engine, tokenizer = build_engine(config, out_dir / SERVERS, say=status.update)
    spec = kind.complete(build_spec(config, engine, tokenizer, env_factory), config.model, out_dir)
    total = len(samples) * config.eval.group_size
    seen: list[float] = []
    failed: list[Trajectory] = []
    try:
        check_template(spec.encoder, samples[0])
        with _progress(console) as bar:
            task = bar.add_task("eval", total=total, reward="-", failed=0)

            def on_done(traj: Trajectory) -> None:
                if not starts_a_run(traj):  # an agent harness run's later branch: the run counted
                    return
                if traj.stop_reason in FAILURES:  # its 0 says nothing of the model
                    failed.append(traj)
                else:
                    seen.append(traj.score)
                mean = f"{sum(seen) / len(seen):.3f}" if seen else "-"
                bar.update(task, advance=1, reward=mean, failed=len(failed))

            return await run_eval(
                samples,
                spec,
                config.eval,
                config.seed + EVAL_SEED_OFFSET,  # the trainer's evaluation seeds: the numbers compare
                concurrency=config.rollout.concurrency,
                fail_fraction=config.rollout.fail_fraction,
                out_path=out_dir / EVAL_FILE,
                on_done=on_done,
            )
    finally:
        release(out_dir)
        await close_spec(spec)  # a harness's gateway, Ray env workers
        await engine.close()


def evaluate(
    config: TrainConfig, checkpoint: str | None, out: str | None, console: Console, per_prompt: bool = False
) -> Path:
    """Run ``turnrl eval``; print the table (and a row per prompt: ``per_prompt``); the folder written."""
    ckpt = Path(checkpoint) if checkpoint else None
    if ckpt is not None and not ckpt.is_dir():
        raise RunError(f"no checkpoint folder at {ckpt}")
    out_dir = Path(out) if out else (ckpt / "eval" if ckpt else Path(config.output_dir) / "eval" / "model")
    trajs, rows = asyncio.run(evaluate_config(config, ckpt, out_dir, console))
    if not rows:
        raise RunError("no trajectory was rolled out (is the held-out set empty?)")
    title = f"{env_kind(config.env).title} on {ckpt or config.model}"
    if per_prompt:
        console.print(prompt_table(prompt_rows(trajs, config.eval.k, config.eval.pass_reward), title))
    console.print(report_table(rows, title))
    return out_dir
