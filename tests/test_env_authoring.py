"""For env authors: a scripted policy from the config drives an env through many turns from the CLI,
the config's folder is importable, collect() takes a seed, rows come from JSONL, Parquet and saved
Hugging Face datasets, and each row may name its env."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from turnrl import ChatEncoder, Env, Limits, RolloutSpec, Sample, SamplingParams, StepResult, collect
from turnrl.app.parts import build_env_factory, load_samples
from turnrl.config import DataConfig, EnvConfig
from turnrl.data import DataError
from turnrl.engines.scripted import ScriptedEngine, policy_replies
from turnrl.env.builtin.guess_number import GuessNumberEnv
from turnrl.env.registry import resolve_env
from turnrl.testing import EchoEnv
from turnrl.types import StopReason

REPO = Path(__file__).resolve().parents[1]
PLAYERS = REPO / "examples" / "players.py"  # bisect: a player of guess_number that reads the conversation


def turnrl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnrl.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_a_scripted_policy_from_the_config_plays_an_env_through_the_cli(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    folder = tmp_path / "my_env"  # the config's folder, not the working directory
    folder.mkdir()
    (folder / "my_player.py").write_text(PLAYERS.read_text())
    config = {
        "model": str(tiny_qwen3_dir),
        "engine": {"kind": "scripted", "policy": "my_player:bisect"},  # found beside the config
        "env": {"name": "guess_number", "kwargs": {"hi": 100}},
        "data": {"kwargs": {"size": 4, "hi": 100}},
        "sampling": {"max_tokens": 32},
        "limits": {"max_turns": 10, "max_context_tokens": 2048},
        "rollout": {"group_size": 2, "log_turns": True},
        "output_dir": str(tmp_path / "run"),
    }
    (folder / "play.yaml").write_text(yaml.safe_dump(config))
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    result = turnrl("rollout", str(folder / "play.yaml"), cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    trajs = [json.loads(line) for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 8
    for t in trajs:  # bisection finds any secret in 1..100 within 7 guesses: many real turns
        assert t["stop_reason"] == "env_done" and t["reward"] > 0 and t["metrics"]["check/ok"] is True
        assert t["num_turns"] == len([x for x in t["turns"] if x["role"] == "assistant"])
    assert max(t["num_turns"] for t in trajs) >= 4
    turns = (tmp_path / "run" / "turns.jsonl").read_text().splitlines()
    assert len(turns) == sum(len(t["turns"]) for t in trajs)


def test_a_policy_module_that_is_nowhere_names_where_it_was_looked_for(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    config = {
        "model": str(tiny_qwen3_dir),
        "engine": {"kind": "scripted", "policy": "nowhere_player:bisect"},
        "env": {"name": "guess_number"},
        "output_dir": str(tmp_path / "run"),
    }
    (tmp_path / "play.yaml").write_text(yaml.safe_dump(config))
    result = turnrl("rollout", str(tmp_path / "play.yaml"), cwd=tmp_path)
    assert result.returncode != 0
    line = result.stderr.strip().splitlines()[-1]
    assert "engine.policy 'nowhere_player:bisect': no module named 'nowhere_player'" in line
    assert f"searched {tmp_path.resolve()}" in line
    assert not (tmp_path / "run" / "trajectories.jsonl").exists()


async def test_a_policy_that_fails_ends_its_trajectory_with_the_reason(qwen3_tokenizer: Any) -> None:
    def broken(messages: Any, images: Any, sample: Any) -> Any:
        return {"not": "text"}

    spec = RolloutSpec(
        env_factory=lambda s: GuessNumberEnv(s),
        engine=ScriptedEngine(qwen3_tokenizer, policy_replies(broken)),
        encoder=ChatEncoder(qwen3_tokenizer),
        sampling=SamplingParams(max_tokens=8),
        limits=Limits(max_turns=3),
    )
    rows = GuessNumberEnv.dataset(size=1)
    (traj,) = await collect([Sample(rows[0]["id"], rows[0]["prompt"], metadata=rows[0])], spec)
    assert traj.stop_reason is StopReason.ENGINE_ERROR
    assert traj.error is not None and "scripted policy broken returned dict" in traj.error


class SeedEnv(Env):
    seen: ClassVar[list[int | None]] = []

    async def step(self, action: str) -> StepResult:
        SeedEnv.seen.append(self.sample.seed)
        return StepResult(None, done=True)


async def test_collect_takes_a_seed(qwen3_tokenizer: Any) -> None:
    spec = RolloutSpec(
        env_factory=SeedEnv,
        engine=ScriptedEngine(qwen3_tokenizer, lambda prompt, sampling: f"seed {sampling.seed}"),
        encoder=ChatEncoder(qwen3_tokenizer),
        sampling=SamplingParams(max_tokens=32),
        limits=Limits(max_turns=1),
    )
    samples = [Sample("a", [{"role": "user", "content": "hi"}])]

    async def run(seed: int | None) -> tuple[list[int | None], list[str]]:
        SeedEnv.seen = []
        trajs = await collect(samples, spec, group_size=2, seed=seed)
        return sorted(SeedEnv.seen, key=str), sorted(t.turns[0].text for t in trajs)

    unseeded = await run(None)
    first, again, other = await run(5), await run(5), await run(6)
    assert unseeded[0] == [None, None]
    assert first == again and first != other  # env seeds and request seeds derive from it
    assert len(set(first[0])) == 2 and all(isinstance(s, int) for s in first[0])


# ---------------------------------------------------------------- rows from files and datasets

ROWS = [
    {"id": "r0", "prompt": "Say hi.", "data_source": "greet", "env": "echo", "reward_model": {"truth": "hi"}},
    {"id": "r1", "prompt": [{"role": "user", "content": "Guess."}], "env": "guess_number", "hi": 4},
    {"id": "r2", "prompt": "Plain.", "tools": ["calculator"], "tools_kwargs": {"calculator": {"x": 1}}},
]


def _check_rows(samples: list[Sample]) -> None:
    assert [s.id for s in samples] == ["r0", "r1", "r2"]
    assert [s.env for s in samples] == ["echo", "guess_number", None]
    assert samples[0].data_source == "greet" and samples[0].metadata["reward_model"] == {"truth": "hi"}
    assert samples[1].prompt == [{"role": "user", "content": "Guess."}] and samples[1].metadata["hi"] == 4
    assert samples[2].tools == ["calculator"] and samples[2].tools_kwargs == {"calculator": {"x": 1}}


def test_rows_load_from_jsonl_parquet_and_saved_datasets(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    entry = resolve_env("turnrl.testing:EchoEnv")
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    _check_rows(load_samples(DataConfig(path=str(jsonl)), entry))
    # Parquet and datasets hold one type per column: rows as verl writes them (every key, messages)
    columns = {k: None for r in ROWS for k in r} | {"tools_kwargs": {"calculator": {"x": 0}}}
    same = [columns | r | {"prompt": [{"role": "user", "content": "Hi."}]} for r in ROWS]
    table = datasets.Dataset.from_list(same)
    table.to_parquet(str(tmp_path / "rows.parquet"))
    from_parquet = load_samples(DataConfig(path=str(tmp_path / "rows.parquet")), entry)
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table, "test": table.select([0])}).save_to_disk(str(tmp_path / "dict"))
    from_disk = load_samples(DataConfig(path=str(tmp_path / "saved")), entry)
    for samples in (from_parquet, from_disk):
        assert [s.id for s in samples] == ["r0", "r1", "r2"] and [s.env for s in samples][:2] == ROWS_ENVS
        assert samples[1].metadata["hi"] == 4 and samples[2].tools_kwargs["calculator"]["x"] == 1
    test_split = load_samples(DataConfig(path=str(tmp_path / "dict"), split="test"), entry)
    assert [s.id for s in test_split] == ["r0"]
    with pytest.raises(DataError, match=r"has no split 'dev' \(splits: train, test\)"):
        load_samples(DataConfig(path=str(tmp_path / "dict"), split="dev"), entry)
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"junk\.parquet is not readable Parquet"):
        load_samples(DataConfig(path=str(tmp_path / "junk.parquet")), entry)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="is not a saved Hugging Face dataset"):
        load_samples(DataConfig(path=str(tmp_path / "empty")), entry)


ROWS_ENVS = ["echo", "guess_number"]


async def test_each_row_plays_in_the_env_it_names(qwen3_tokenizer: Any) -> None:
    config = EnvConfig(
        name="turnrl.testing:EchoEnv",
        kwargs={"done_after": 1, "reply": "default"},
        routes={"echo": {"name": "turnrl.testing:EchoEnv", "kwargs": {"done_after": 2, "reply": "routed"}}},
    )
    factory = build_env_factory(config)
    prompt = [{"role": "user", "content": "Play."}]
    samples = [
        Sample("plain", prompt),
        Sample("routed", prompt, env="echo"),
        Sample("named", prompt, env="guess_number", metadata={"hi": 2, "seed": 1}),
        Sample("unknown", prompt, env="no_such_env"),
    ]
    spec = RolloutSpec(
        env_factory=factory,
        engine=ScriptedEngine(qwen3_tokenizer, lambda prompt, sampling: "[1]"),
        encoder=ChatEncoder(qwen3_tokenizer),
        sampling=SamplingParams(max_tokens=8),
        limits=Limits(max_turns=3, final_observation=True),
    )
    trajs = {t.group_id: t for t in await collect(samples, spec)}
    assert isinstance(factory(samples[0]), EchoEnv) and isinstance(factory(samples[2]), GuessNumberEnv)
    assert trajs["plain"].num_turns == 1 and "default (turn 1)" in trajs["plain"].turns[-1].text
    assert trajs["routed"].num_turns == 2 and "routed (turn 2)" in trajs["routed"].turns[-1].text
    assert trajs["named"].stop_reason in (StopReason.ENV_DONE, StopReason.MAX_TURNS)
    assert trajs["unknown"].stop_reason is StopReason.ENV_ERROR
    assert trajs["unknown"].error is not None and "unknown env 'no_such_env'" in trajs["unknown"].error
    assert all(t.metrics.get("check/ok", True) for t in trajs.values())


def test_routes_cannot_go_to_ray_workers() -> None:
    from turnrl.app.parts import RunError

    config = EnvConfig(
        name="turnrl.testing:EchoEnv", routes={"x": {"name": "guess_number"}}, ray={"enabled": True}
    )
    with pytest.raises(RunError, match=r"env\.routes runs envs in this process"):
        build_env_factory(config)


class RiddleEnv(Env):
    """Builds its prompt in reset() from the row's fields: its rows need no 'prompt'."""

    async def reset(self) -> list[dict[str, Any]]:
        return [
            {"role": "user", "content": f"What is {self.sample.metadata['a']} + {self.sample.metadata['b']}?"}
        ]

    async def step(self, action: str) -> StepResult:
        right = str(self.sample.metadata["a"] + self.sample.metadata["b"]) in action
        return StepResult(None, 1.0 if right else 0.0, True)


async def test_an_env_that_builds_its_prompt_needs_no_prompt_column(
    qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": "r0", "a": 2, "b": 3}\n{"id": "r1", "a": 4, "b": 4}\n')
    samples = load_samples(DataConfig(path=str(rows)), resolve_env("test_env_authoring:RiddleEnv"))
    assert [s.prompt for s in samples] == [[], []]
    spec = RolloutSpec(
        env_factory=RiddleEnv,
        engine=ScriptedEngine(qwen3_tokenizer, ["5", "9"]),
        encoder=ChatEncoder(qwen3_tokenizer),
        sampling=SamplingParams(max_tokens=8),
        limits=Limits(max_turns=1),
    )
    trajs = await collect(samples, spec)
    assert sorted(t.reward for t in trajs) == [0.0, 1.0] and all(
        t.stop_reason == StopReason.ENV_DONE for t in trajs
    )
    assert trajs[0].messages[0]["content"].startswith("What is")
    # an env that starts from the row's prompt still says, before any work, that a row has none
    with pytest.raises(DataError, match=r"data row 0 of .* has no 'prompt'"):
        load_samples(DataConfig(path=str(rows)), resolve_env("turnrl.testing:EchoEnv"))
