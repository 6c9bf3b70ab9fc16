"""The demo model ``smollm2-135m-play``, built by the CLI as a new user would (offline, cached per
machine), plays the shipped examples for real: it finishes guess_number games within their turns
and calls the calculator and the search tool before answering, where the base model does neither."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from turnrl.app import demo_model
from turnrl.app.parts import load_samples
from turnrl.config import DataConfig
from turnrl.env.builtin.guess_number import demonstration, secret_for
from turnrl.env.registry import resolve_env
from turnrl.models import SMOLLM2_PLAY, ModelNotFoundError, resolve_model
from turnrl.types import Sample

REPO = Path(__file__).resolve().parents[1]


def turnrl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnrl.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=1500
    )


def run_example(name: str, out: Path, *overrides: str) -> tuple[list[dict[str, Any]], str]:
    sets = [w for o in (f"output_dir={out}", *overrides) for w in ("--set", o)]
    result = turnrl("rollout", f"examples/{name}.yaml", *sets)
    assert result.returncode == 0, result.stderr[-2000:]
    trajs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    return trajs, result.stderr


@pytest.fixture(scope="module")
def guess_games(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The guess_number example as a new user runs it: on a new machine this first run builds the
    demo model (a few minutes), later runs find it built."""
    trajs, said = run_example("guess_number", tmp_path_factory.mktemp("guess"))
    assert demo_model.is_built() and (demo_model.demo_model_dir() / "model.safetensors").is_file()
    assert "building smollm2-135m-play once" in said or "demo model:" not in said
    return trajs


def test_the_demo_model_finishes_guessing_games(guess_games: list[dict[str, Any]]) -> None:
    trajs = guess_games  # the example as shipped: 8 games x 2
    stops = [t["stop_reason"] for t in trajs]
    assert len(trajs) == 16 and stops.count("env_done") >= 8 and stops.count("length") <= 2, stops
    assert sum(t["reward"] for t in trajs) / len(trajs) >= 0.3
    assert max(t["num_turns"] for t in trajs) >= 3 and all(t["metrics"]["check/ok"] for t in trajs)


def test_the_cli_builds_the_demo_model_once(guess_games: list[dict[str, Any]]) -> None:
    result = turnrl("demo-model")
    assert result.returncode == 0 and "smollm2-135m-play is built" in result.stderr, result.stderr[-2000:]


def test_the_demo_model_calls_its_tools_before_answering(guess_games: Any, tmp_path: Path) -> None:
    for name, size in (("math_tools", "data.kwargs.size=2"), ("search_qa", "data.kwargs.size=4")):
        trajs, _ = run_example(name, tmp_path / name, size)  # math: 2 arithmetic + 2 word problems
        called = [t for t in trajs if t["info"].get("num_tool_calls", 0) > 0]
        assert len(called) >= 6, (name, [t["messages"][-1]["content"] for t in trajs])
        answered = [t for t in called if "<answer>" in t["messages"][-1]["content"]]
        assert len(answered) >= 4 and sum(t["reward"] for t in trajs) > 0, name
        assert all(t["metrics"]["check/ok"] for t in trajs)


def test_the_examples_prompts_are_never_demonstrated() -> None:
    entry = resolve_env("search_qa")
    asked = {s.prompt[-1]["content"] for s in load_samples(DataConfig(kwargs={"size": 8, "seed": 0}), entry)}
    game = next(g for g in demo_model.GAMES if g.env == "search_qa")
    demonstrated = {s.prompt[-1]["content"] for s in demo_model.demo_samples(game)}
    assert len(demonstrated) > 40 and not asked & demonstrated
    math = next(g for g in demo_model.GAMES if g.env == "math_tools")
    assert math.data["seed"] != 0  # the example draws seed 0


def test_a_bisection_demonstration_finds_every_secret() -> None:
    for seed in range(200):
        sample = Sample("g", [{"role": "user", "content": "guess"}], metadata={"seed": seed, "hi": 20})
        guesses = demonstration(sample)
        assert guesses[-1] == f"[{secret_for(seed, 20)}]" and len(guesses) <= 5


def test_an_unbuilt_demo_model_says_how_to_build_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNRL_CACHE_DIR", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match=r"not built yet: `turnrl demo-model` builds it"):
        resolve_model(SMOLLM2_PLAY)
