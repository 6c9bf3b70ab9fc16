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

from turnrl.train.fsdp import full_optimizer_state, full_state_dict
from turnrl.train.state import Run

CHECKPOINTS = "checkpoints"


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


def save(run: Run, step: int) -> None:
    """Write the run's checkpoint of ``step`` (under FSDP every rank gathers; rank 0 writes)."""
    learner, loop = run.learner, run.config.train
    weights = optimizer = None
    if learner.sharded is not None:  # every rank gathers the shards; rank 0 writes the whole
        weights = full_state_dict(learner.policy)
        optimizer = full_optimizer_state(learner.sharded, learner.optimizer) if loop.save_optimizer else None
    if not run.ranks.main:  # every rank holds the same weights: rank 0 writes them
        return
    save_checkpoint(
        run.out_dir,
        step,
        learner.policy,
        learner.tokenizer,
        learner.optimizer,
        learner.scheduler,
        loop.keep_checkpoints,
        with_optimizer=loop.save_optimizer,
        state_dict=weights,
        optimizer_state=optimizer,
    )
