"""Checkpoints: the model as a loadable Hugging Face folder, the optimizer, the step and the RNG states.

``OUT/checkpoints/step_000010/`` holds ``model/`` (``save_pretrained``, tokenizer included, so
``turnrl rollout`` can use it as ``model:``), ``optimizer.pt`` (optimizer and scheduler state),
``rng.pt`` (torch and Python RNG states) and ``state.json`` (the step). A checkpoint is written to
a temporary folder and renamed into place, so a crash never leaves half of one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from turnrl.config import dump_config
from turnrl.run_folder import claim, set_aside
from turnrl.train.config import TrainConfig

CHECKPOINTS = "checkpoints"
RESUME_KEYS = (
    "model",
    "env",
    "data",
    "chat",
    "sampling",
    "limits",
    "rewards",
    "group_rewards",
    "seed",
    "rollout",
    "algorithm",
    "optim",
)


@dataclass
class Resumed:
    """What a checkpoint restores besides the model weights."""

    step: int  # training steps already done
    model_dir: Path  # the saved model folder


def checkpoint_dirs(out_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = out_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / "state.json").is_file())


def save_checkpoint(
    out_dir: Path,
    step: int,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    keep: int,
    with_optimizer: bool = True,
    state_dict: dict[str, torch.Tensor] | None = None,
    optimizer_state: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of ``step`` atomically; keep only the newest ``keep``. Without
    ``with_optimizer`` the optimizer's moments (twice the trained weights' size) are left out.
    ``state_dict`` and ``optimizer_state`` replace the model's and optimizer's own (a sharded
    model's, gathered whole)."""
    final = out_dir / CHECKPOINTS / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / "model", state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp / "model")
    if optimizer_state is None and with_optimizer:
        optimizer_state = optimizer.state_dict()
    torch.save({"optimizer": optimizer_state, "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step}))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in checkpoint_dirs(out_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def restore_training_state(
    path: Path,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    load_optimizer: Callable[[dict[str, Any]], None] | None = None,
) -> int:
    """Load the optimizer (when the checkpoint has it; through ``load_optimizer`` when given),
    scheduler and RNG states; return its step."""
    states = torch.load(path / "optimizer.pt", weights_only=False)
    if states["optimizer"] is not None:
        (load_optimizer or optimizer.load_state_dict)(states["optimizer"])
    scheduler.load_state_dict(states["scheduler"])
    rng = torch.load(path / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    return int(json.loads((path / "state.json").read_text())["step"])


def damage(path: Path) -> str | None:
    """What is wrong with the checkpoint folder ``path`` (a file missing or cut short), or None
    when every file it needs reads: its state, the model's config and weights' headers, the
    optimizer and RNG archives."""
    from safetensors import safe_open

    try:
        int(json.loads((path / "state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"state.json: {exc}"
    model = path / "model"
    if not (model / "config.json").is_file() and not (model / "adapter_config.json").is_file():
        return "model/config.json (or a LoRA checkpoint's adapter_config.json) is missing"
    weights = sorted(model.glob("*.safetensors"))
    if not weights:
        return "model/ has no .safetensors weights"
    for file in weights:
        try:
            with safe_open(str(file), framework="pt") as f:
                list(f.keys())
        except Exception as exc:
            return f"model/{file.name}: {exc}"
    for name in ("optimizer.pt", "rng.pt"):
        if not zipfile.is_zipfile(path / name):
            return f"{name} is missing or cut short"
    return None


def latest(out_dir: Path, say: Callable[[str], None] | None = None) -> Resumed | None:
    """The newest intact checkpoint in ``out_dir``, if any; a damaged newer one is passed over,
    said through ``say``."""
    dirs = checkpoint_dirs(out_dir)
    for path in reversed(dirs):
        wrong = damage(path)
        if wrong is None:
            return Resumed(int(json.loads((path / "state.json").read_text())["step"]), path / "model")
        if say is not None:
            say(f"checkpoint {path} is damaged ({wrong}): trying the one before")
    if dirs:
        raise ValueError(f"cannot resume: every checkpoint in {out_dir / CHECKPOINTS} is damaged")
    return None


def check_resumable(config: TrainConfig, out_dir: Path) -> None:
    """A resume must continue the same run; name the first section that differs."""
    saved_path = out_dir / "config.yaml"
    if not saved_path.exists():
        raise ValueError(f"cannot resume: {saved_path} is missing")
    saved = yaml.safe_load(saved_path.read_text()) or {}
    current = dump_config(config)
    for key in RESUME_KEYS:
        if saved.get(key) != current.get(key):
            raise ValueError(f"cannot resume: config key {key!r} differs from the run in {out_dir}")


OUTPUTS = ("config.yaml", "metrics.jsonl", "rewards.png", CHECKPOINTS, "eval", "rollouts", "tensorboard")


def plan_output(
    config: TrainConfig,
    overwrite: bool,
    resume: bool,
    writer: bool = True,
    say: Callable[[str], None] | None = None,
) -> Resumed | None:
    """Check the output folder; the checkpoint to resume from, if any. The ``writer`` (rank 0)
    locks the folder for the rest of the process: one run writes it at a time."""
    out = Path(config.output_dir)
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    if resume and not (out / "config.yaml").exists():
        raise ValueError(f"cannot resume: {out} holds no training run (no config.yaml); run without --resume")
    if writer:
        claim(out)
    if resume:
        check_resumable(config, out)
        return latest(out, say)
    if not resume and not overwrite and holds_run(out):
        raise ValueError(f"{out} already holds a training run (pass --resume, --overwrite or set output_dir)")
    return None


def holds_run(out: Path) -> bool:
    """Whether ``out`` holds what a training run writes."""
    return any((out / name).exists() for name in OUTPUTS)


def start_output(config: TrainConfig, resumed: Resumed | None) -> None:
    """Prepare the output folder once the run is known to start: a new run moves aside only what a
    training run writes (``OUTPUTS``, into ``.replaced``), never the folder, and saves its config."""
    out = Path(config.output_dir)
    if resumed is None:  # an --overwrite: the old run is kept aside until the new one has trained a step
        set_aside(out, OUTPUTS)
    out.mkdir(parents=True, exist_ok=True)
    if resumed is None or not (out / "config.yaml").exists():
        (out / "config.yaml").write_text(yaml.safe_dump(dump_config(config), sort_keys=False))
