"""The demo model ``smollm2-135m-play``: SmolLM2-135M-Instruct after a short supervised warm start
on the shipped example envs, so the examples show real multi-turn play.

The base model rarely plays them: it talks past guess_number's brackets until ``max_tokens`` and
never calls math_tools' calculator or search_qa's search. The build replays demonstrations through
the real envs (a bisecting guesser; a calculator call on reasoning-gym's ``basic_arithmetic``, then
the answer; a search for the question's description, then the module), keeps those the env rewards,
trains the top layers on them (``sft_epochs``, next-token loss on the model turns only) and saves the
model with SmolLM2's chat template into the turnrl cache. The frozen layers below run once per
demonstration (``FrozenTrunk``); the build says where it is at least every 10 seconds and keeps a
checkpoint every 30, so an interrupted build resumes. Offline and deterministic; the
demonstrated prompts are drawn with other seeds than the examples' (search questions that the
examples ask are left out), so the examples stay held out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
from turnrl.support.cpus import ThreadFit
from turnrl.support.imports import import_object
from turnrl.train.logprobs import hidden_logprobs
from turnrl.train.sft import SftState, demonstrations, sft_epochs
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

    format: int = 2
    base: str = SMOLLM2_135M
    trainable: str = r"layers\.(2[2-9])\.|model\.norm"  # the top 8 of 30 layers: a cheap backward pass
    trunk: int = 22  # the frozen layers below them, run once per demonstration
    length_window: int = 4  # batches sorted by length in runs of 4 (a third less padding)
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
    fit = ThreadFit(PROGRESS_EVERY_S)  # what other processes leave: measured from here on
    tokenizer = load_tokenizer(RECIPE.base)
    trajs: list[Trajectory] = []
    for game in GAMES:
        found = asyncio.run(_demonstrations(game, tokenizer))
        say(f"demo model: {len(found)} rewarded demonstrations of {game.env}")
        trajs += found
    torch.manual_seed(RECIPE.seed)
    with _heartbeat(say, lambda: f"demo model: loading {RECIPE.base} ({time.perf_counter() - t0:.0f} s)"):
        model = load_model(RECIPE.base)
    trainable = re.compile(RECIPE.trainable)
    for name, param in model.named_parameters():
        param.requires_grad_(bool(trainable.search(name)))
    model.train()
    resume = _load_partial(model)
    steps = RECIPE.epochs * -(-len(trajs) // RECIPE.batch_size)
    done = [len(resume.losses) if resume else 0]
    if resume is not None:
        say(f"demo model: resuming the interrupted build after SFT step {done[0]}/{steps}")
    first, started = done[0], time.perf_counter()

    def where() -> str:
        now = time.perf_counter()
        left = (now - started) / max(1, done[0] - first) * (steps - done[0]) if done[0] > first else None
        eta = f", about {left:.0f} s left" if left is not None else ""
        return f"demo model: SFT step {done[0]}/{steps} ({now - t0:.0f} s{eta})"

    def fit_threads() -> None:  # on a busy machine, threads that wait on each other are slower than one
        if (cpus := fit()) is not None:
            plural = "s" * (fit.threads > 1)
            say(f"demo model: {fit.threads} compute thread{plural} ({cpus:.1f} of {fit.free.cpus} CPUs free)")

    def step() -> None:
        done[0] += 1
        fit_threads()

    saved = [time.perf_counter()]

    def checkpoint(state: SftState) -> None:  # every 30 s: an interrupted build loses less
        if time.perf_counter() - saved[0] >= CHECKPOINT_EVERY_S and len(state.losses) < steps:
            _save_partial(model, state)
            saved[0] = time.perf_counter()

    try:
        fit_threads()
        with _heartbeat(say, where, every_s=PROGRESS_EVERY_S, first=True):
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
                forward=FrozenTrunk(model, RECIPE.trunk),
                resume=resume,
                checkpoint=checkpoint,
                length_window=RECIPE.length_window,
            )
    finally:
        fit.restore()  # the rest of a run that built it first
    say(f"demo model: loss {losses[0]:.3f} -> {losses[-1]:.3f} ({time.perf_counter() - t0:.0f} s)")
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    shutil.rmtree(_partial_dir(), ignore_errors=True)


PROGRESS_EVERY_S = 10.0
CHECKPOINT_EVERY_S = 30.0


@contextmanager
def _heartbeat(
    say: Callable[[str], None],
    line: Callable[[], str],
    every_s: float = PROGRESS_EVERY_S,
    first: bool = False,
) -> Iterator[None]:
    """Say ``line()`` every ``every_s`` seconds while the block runs (and once at its start with
    ``first``), so that slow work on a busy machine never looks hung."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every_s):
            say(line())

    if first:
        say(line())
    thread = threading.Thread(target=beat, name="demo-model-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class FrozenTrunk:
    """The logprobs of ``sft_epochs`` for a model whose bottom ``trunk`` layers are frozen: the
    first pass over a demonstration keeps what those layers give it, and later epochs start from
    there, so the frozen layers run once per demonstration instead of once per epoch (the same
    numbers: nothing below the cut learns)."""

    def __init__(self, model: Any, trunk: int) -> None:
        self.model = model
        self.body = model.get_decoder()
        self.trunk = trunk
        self.kept: dict[tuple[int, ...], Any] = {}

    def __call__(self, input_ids_B_T: Any, attention_mask_B_T: Any, want_B_T: Any, **options: Any) -> Any:
        lengths = attention_mask_B_T.sum(dim=1).tolist()
        keys = [tuple(row[:n].tolist()) for row, n in zip(input_ids_B_T, lengths, strict=True)]
        if all(key in self.kept for key in keys):
            cut = self.kept[keys[0]]
            start_B_T_H = cut.new_zeros(*input_ids_B_T.shape, cut.shape[-1])
            for b, key in enumerate(keys):
                start_B_T_H[b, : len(key)] = self.kept[key]
            full = self.body.layers
            self.body.layers = full[self.trunk :]
            try:
                hidden = self.body(
                    inputs_embeds=start_B_T_H, attention_mask=attention_mask_B_T
                ).last_hidden_state
            finally:
                self.body.layers = full
        else:
            out = self.body(
                input_ids=input_ids_B_T, attention_mask=attention_mask_B_T, output_hidden_states=True
            )
            hidden, cut = out.last_hidden_state, out.hidden_states[self.trunk].detach()
            for b, key in enumerate(keys):
                self.kept[key] = cut[b, : len(key)].clone()
        chunk_size, keep_mib = options.get("chunk_size", 256), options.get("keep_mib", 0.0)
        return hidden_logprobs(
            self.model, hidden, input_ids_B_T, want_B_T, chunk_size=chunk_size, keep_mib=keep_mib
        )


def _partial_dir() -> Path:
    return demo_model_dir().parent / f".{SMOLLM2_PLAY}.partial"


def _save_partial(model: Any, state: SftState) -> None:
    """The trainable weights and the optimizer's state, written whole or not at all."""
    import torch

    folder = _partial_dir()
    folder.mkdir(parents=True, exist_ok=True)
    weights = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    tmp = folder / "state.pt.tmp"
    torch.save({"recipe": _recipe(), "weights": weights, "sft": dataclasses.asdict(state)}, tmp)
    os.replace(tmp, folder / "state.pt")


def _load_partial(model: Any) -> SftState | None:
    """The state an interrupted build of this recipe left, its weights put back into ``model``."""
    import torch

    path = _partial_dir() / "state.pt"
    try:
        saved = torch.load(path, weights_only=True)
    except Exception:  # none, torn or from another torch: start over
        return None
    if saved.get("recipe") != _recipe():
        return None
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in saved["weights"].items():
            params[name].copy_(value)
    return SftState(**saved["sft"])


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
