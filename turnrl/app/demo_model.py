"""The demo model ``smollm2-135m-play``: SmolLM2-135M-Instruct after a short supervised warm start
on the shipped example envs, so the examples show real multi-turn play.

The base model rarely plays them: it talks past guess_number's brackets until ``max_tokens`` and
never calls math_tools' calculator or search_qa's search. The build replays demonstrations through
the real envs (a bisecting guesser; a calculator call on reasoning-gym's ``basic_arithmetic``, then
the answer; a search for the question's description, then the module), keeps those the env rewards,
trains the top layers on them (``sft_epochs``, next-token loss on the model turns only) and saves the
model with SmolLM2's chat template into the turnrl cache. Offline and deterministic; the
demonstrated prompts are drawn with other seeds than the examples' (search questions that the
examples ask are left out), so the examples stay held out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnrl.app.parts import build_env_factory, load_samples
from turnrl.chat.encoder import ChatEncoder
from turnrl.config import DataConfig, EnvConfig
from turnrl.env.registry import resolve_env
from turnrl.models import SMOLLM2_135M, SMOLLM2_PLAY
from turnrl.models.files import build_once
from turnrl.models.loading import load_model, load_tokenizer
from turnrl.rollout.spec import RolloutSpec
from turnrl.support.cache import cache_dir
from turnrl.support.imports import import_object
from turnrl.train.sft import demonstrations, sft_epochs
from turnrl.types import Limits, Sample, SamplingParams, Trajectory

_MARKER = "turnrl_demo_model.json"


@dataclass(frozen=True)
class Game:
    """One env's demonstrations: its env, its demonstrated rows, the demos function."""

    env: str
    data: dict[str, Any]
    demos: str
    held_out: dict[str, Any] = field(default_factory=dict)  # the example's rows, never demonstrated


GAMES = (
    Game(
        "guess_number", {"size": 40, "hi": 20, "seed": 101}, "turnrl.env.builtin.guess_number:demonstration"
    ),
    Game(
        "math_tools",
        {"tasks": ["basic_arithmetic"], "size": 40, "seed": 101},
        "turnrl.env.builtin.math_tools:demonstration",
    ),
    Game(
        "search_qa",
        {"size": 56, "seed": 101},
        "turnrl.env.builtin.search_qa:demonstration",
        held_out={"size": 32, "seed": 0},
    ),
)


@dataclass(frozen=True)
class Recipe:
    """How the demo model is trained (its folder is rebuilt when this changes)."""

    format: int = 1
    base: str = SMOLLM2_135M
    trainable: str = r"layers\.(2[2-9])\.|model\.norm"  # the top 8 of 30 layers: a cheap backward pass
    epochs: int = 2
    batch_size: int = 8
    lr: float = 1e-4
    seed: int = 0


RECIPE = Recipe()


def demo_model_dir() -> Path:
    """Where ``smollm2-135m-play`` is built."""
    return cache_dir() / SMOLLM2_PLAY


def is_built() -> bool:
    """Whether the demo model is built, with this recipe."""
    marker = demo_model_dir() / _MARKER
    return marker.is_file() and json.loads(marker.read_text()) == _recipe()


def _recipe() -> dict[str, Any]:
    return {**dataclasses.asdict(RECIPE), "games": [dataclasses.asdict(g) for g in GAMES]}


def build_demo_model(say: Callable[[str], None] = print) -> Path:
    """Build ``smollm2-135m-play`` unless it is built (a few minutes on 2 cores); its folder."""
    return build_once(demo_model_dir(), _recipe(), _MARKER, lambda tmp: _write(tmp, say))


def _write(out: Path, say: Callable[[str], None]) -> None:
    import torch

    t0 = time.perf_counter()
    tokenizer = load_tokenizer(RECIPE.base)
    trajs: list[Trajectory] = []
    for game in GAMES:
        found = asyncio.run(_demonstrations(game, tokenizer))
        say(f"demo model: {len(found)} rewarded demonstrations of {game.env}")
        trajs += found
    torch.manual_seed(RECIPE.seed)
    model = load_model(RECIPE.base)
    trainable = re.compile(RECIPE.trainable)
    for name, param in model.named_parameters():
        param.requires_grad_(bool(trainable.search(name)))
    model.train()
    steps = RECIPE.epochs * -(-len(trajs) // RECIPE.batch_size)
    done = [0]

    started = time.perf_counter()

    def step() -> None:  # every step is said (a few seconds each), with the time left
        done[0] += 1
        now = time.perf_counter()
        left = (now - started) / done[0] * (steps - done[0])
        say(f"demo model: SFT step {done[0]}/{steps} ({now - t0:.0f} s, about {left:.0f} s left)")

    losses = sft_epochs(
        model,
        trajs,
        epochs=RECIPE.epochs,
        batch_size=RECIPE.batch_size,
        lr=RECIPE.lr,
        micro_batch_tokens=4096,
        chunk_size=256,
        seed=RECIPE.seed,
        on_step=step,
    )
    say(f"demo model: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def demo_samples(game: Game) -> list[Sample]:
    """The game's demonstrated rows: those with a demonstration, none of the example's own."""
    entry = resolve_env(game.env)
    asked = load_samples(DataConfig(kwargs=game.held_out), entry) if game.held_out else []
    held_out = {_key(s) for s in asked}
    demos = import_object(game.demos, "demos")
    samples = load_samples(DataConfig(kwargs=game.data), entry)
    return [s for s in samples if _key(s) not in held_out and demos(s)]


async def _demonstrations(game: Game, tokenizer: Any) -> list[Trajectory]:
    """The game's demonstrations the env rewards."""
    spec = RolloutSpec(
        env_factory=build_env_factory(EnvConfig(name=game.env)),
        engine=None,  # type: ignore[arg-type]  # replaced by each demonstration's scripted engine
        encoder=ChatEncoder(tokenizer),
        sampling=SamplingParams(max_tokens=128),
        limits=Limits(max_turns=8, max_context_tokens=4096),
    )
    return await demonstrations(demo_samples(game), import_object(game.demos, "demos"), spec)


def _key(sample: Sample) -> str:
    return str(sample.prompt[-1]["content"])
