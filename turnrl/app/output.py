"""The output-folder rule, one for every run that writes a folder (rollout, train, eval).

``open_output`` runs before any model loads: ``--resume`` and ``--overwrite`` exclude each other; a
resume needs the run it continues, and a config that keeps that run's resume keys; a new run never
writes over another unless told to (``--overwrite``); the folder is locked (one writer per run
folder) and must be writable. ``start_output`` runs once every input is valid: a new run moves
aside only what a run of its kind writes (kept until the new run has done something good, see
``support.run_folder``) and saves its config.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from turnrl.app.parts import RunError
from turnrl.config import dump_config
from turnrl.support.run_folder import claim, set_aside

CONFIG = "config.yaml"


@dataclass(frozen=True)
class RunKind:
    """What a kind of run writes, and what a resume of it must keep."""

    name: str  # said in messages: "rollout", "training run"
    marker: str  # the file a resume needs
    outputs: tuple[str, ...]  # everything it writes (what --overwrite moves aside)
    holds: tuple[str, ...]  # any of these says a folder holds such a run
    resume_keys: tuple[str, ...]  # config keys (dotted: a key of a section) a resume must keep


_SAME_ROLLOUT = ("model", "env", "data", "chat", "sampling", "limits", "rewards", "group_rewards", "seed")
ROLLOUT = RunKind(
    "rollout",
    "trajectories.jsonl",
    ("trajectories.jsonl", "turns.jsonl", "summary.json", CONFIG),
    ("trajectories.jsonl",),
    (*_SAME_ROLLOUT, "rollout.group_size"),
)
_TRAINING_OUTPUTS = (CONFIG, "metrics.jsonl", "rewards.png", "checkpoints", "eval", "rollouts", "tensorboard")
TRAINING = RunKind(
    "training run",
    CONFIG,
    _TRAINING_OUTPUTS,
    _TRAINING_OUTPUTS,
    (*_SAME_ROLLOUT, "rollout", "algorithm", "optim"),
)
# a learning gateway's rewards, checkpoint and steps are in learn/ (turnrl.app.learning.LEARN_DIR)
GATEWAY = RunKind("gateway run", "calls.jsonl", ("calls.jsonl", CONFIG, "learn"), ("calls.jsonl",), ())
# an evaluation is re-run at will: it replaces the one before (``overwrite=True``), one at a time
EVAL = RunKind("evaluation", "eval.jsonl", ("eval.jsonl", "eval.json"), ("eval.jsonl",), ())


def open_output(
    out: Path, kind: RunKind, config: BaseModel, overwrite: bool, resume: bool, writer: bool = True
) -> None:
    """Check ``out`` for a run of ``kind`` with ``config``; the ``writer`` (every process but the
    other ranks of a torchrun) locks it for the rest of the process. Raises ``RunError``."""
    if resume and overwrite:
        raise RunError("--resume and --overwrite exclude each other")
    if resume and not (out / kind.marker).exists():
        raise RunError(
            f"cannot resume: {out} holds no {kind.name} ({kind.marker} does not exist); run without --resume"
        )
    if writer:
        claim(out)  # one writer per run folder, from here to the end of this process
    if resume:
        check_resumable(config, out, kind.resume_keys)
    elif not overwrite and holds_run(out, kind):
        raise RunError(f"{out} already holds a {kind.name} (pass --resume, --overwrite or set output_dir)")
    if writer:
        check_writable(out)


def holds_run(out: Path, kind: RunKind) -> bool:
    """Whether ``out`` holds what a run of ``kind`` writes."""
    return any((out / name).exists() for name in kind.holds)


def check_resumable(config: BaseModel, out: Path, keys: tuple[str, ...]) -> None:
    """A resume must run what the first run ran; name the first key that differs."""
    saved_path = out / CONFIG
    if not saved_path.exists():
        raise RunError(f"cannot resume: {saved_path} is missing")
    saved = yaml.safe_load(saved_path.read_text()) or {}
    current = dump_config(config)
    for key in keys:
        if _lookup(saved, key) != _lookup(current, key):
            raise RunError(f"cannot resume: config key {key!r} differs from the run in {out}")


def _lookup(config: Mapping[str, Any], dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def check_writable(out: Path) -> None:
    """Fail now, before any model loads, when the output folder cannot be written."""
    made = [p for p in (out, *out.parents) if not p.exists()]  # left as they were found
    probe = out / ".turnrl-write-probe"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise RunError(f"cannot write to the output folder {out}: {exc.strerror or exc}") from None
    finally:
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()


def start_output(out: Path, kind: RunKind, config: BaseModel, resume: bool) -> None:
    """The run starts: a new one moves aside what a run of ``kind`` wrote (an --overwrite keeps the
    old run there until the new one has done something good) and saves its config."""
    if not resume:
        set_aside(out, kind.outputs)
    out.mkdir(parents=True, exist_ok=True)
    if not resume or not (out / CONFIG).exists():
        (out / CONFIG).write_text(yaml.safe_dump(dump_config(config), sort_keys=False))
