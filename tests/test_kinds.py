"""An env or an agent harness, told apart in one place (``app.kinds``); what replaces the turn loop
is a ``Runner`` with ``close``, and ``close_spec`` stops what a spec holds."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from turnrl.app.kinds import HarnessEnv, LoopEnv, env_kind
from turnrl.app.parts import RunError, build_spec
from turnrl.chat.encoder import ChatEncoder
from turnrl.config import EnvConfig, HarnessConfig, RunConfig
from turnrl.engines.scripted import ScriptedEngine
from turnrl.rollout.collector import iter_trajectories
from turnrl.rollout.loop import run_trajectory
from turnrl.rollout.spec import RolloutSpec, Runner, close_spec
from turnrl.testing import EchoEnv
from turnrl.types import Limits, Sample, SamplingParams, StopReason, Trajectory

SAMPLE = Sample("s", [{"role": "user", "content": "hi"}])


def spec_for(tokenizer: Any, env_factory: Any, runner: Runner | None = None) -> RolloutSpec:
    engine = ScriptedEngine(tokenizer, ["Hello."])
    return RolloutSpec(
        env_factory, engine, ChatEncoder(tokenizer), SamplingParams(max_tokens=8), Limits(), runner=runner
    )


class CountingRunner:
    """A runner of its own: two trajectories per member, and a record of its close."""

    def __init__(self) -> None:
        self.closed = 0

    async def __call__(self, sample: Sample, index: int, spec: RolloutSpec) -> list[Trajectory]:
        first = await run_trajectory(
            sample, dataclasses.replace(spec, env_factory=EchoEnv, runner=None), index
        )
        return [first, first]

    async def close(self) -> None:
        self.closed += 1


class StoppingFactory:
    """An env factory that holds workers (as the Ray one does)."""

    def __init__(self) -> None:
        self.stopped = 0

    def __call__(self, sample: Sample) -> EchoEnv:
        return EchoEnv(sample)

    def shutdown(self) -> None:
        self.stopped += 1


def test_env_kind_tells_an_env_from_a_harness() -> None:
    env = env_kind(EnvConfig(name="turnrl.testing:EchoEnv"))
    harness = env_kind(HarnessConfig(kind="harness", command=["my-agent", "--fast"], reward="m:f"))
    assert isinstance(env, LoopEnv) and env.title == "turnrl.testing:EchoEnv"
    assert isinstance(harness, HarnessEnv) and harness.title == "my-agent --fast"
    entry, factory = env.inputs()
    assert entry is not None and factory is not None and isinstance(factory(SAMPLE), EchoEnv)
    assert harness.inputs() == (None, None)  # no env to build: a runner runs it


def test_a_harness_with_no_rows_or_a_missing_command_stops_before_any_model_loads() -> None:
    harness = env_kind(
        HarnessConfig(kind="harness", command=["no-such-agent-xyz"], reward="m:f", sandbox="none")
    )
    with pytest.raises(RunError, match="no data"):
        harness.check([], None)
    with pytest.raises(RunError, match="no-such-agent-xyz"):
        harness.check([SAMPLE], None)


def test_a_harness_spec_gets_a_runner_and_no_env(qwen3_tokenizer: Any, tmp_path: Path) -> None:
    config = RunConfig.model_validate(
        {
            "model": "m",
            "env": {"kind": "harness", "command": ["true"], "reward": "json:dumps", "sandbox": "none"},
            "output_dir": str(tmp_path),
        }
    )
    kind = env_kind(config.env)
    _, factory = kind.inputs()
    spec = build_spec(config, ScriptedEngine(qwen3_tokenizer, []), qwen3_tokenizer, factory)
    assert spec.env_factory is None and spec.runner is None
    spec = kind.complete(spec, config.model, tmp_path)
    from turnrl.harness import HarnessRunner

    runner = spec.runner
    assert isinstance(runner, HarnessRunner)
    assert runner.gateway.sealed and runner.gateway.engine is spec.engine  # the app wired its gateway
    asyncio.run(close_spec(spec))


def test_the_turn_loop_without_an_env_factory_ends_as_env_error(qwen3_tokenizer: Any) -> None:
    traj = asyncio.run(run_trajectory(SAMPLE, spec_for(qwen3_tokenizer, None)))
    assert traj.stop_reason == StopReason.ENV_ERROR and "no env_factory" in (traj.error or "")


def test_a_runner_replaces_the_turn_loop_and_close_spec_stops_it_and_the_env_workers(
    qwen3_tokenizer: Any,
) -> None:
    runner, factory = CountingRunner(), StoppingFactory()
    spec = spec_for(qwen3_tokenizer, factory, runner)

    async def go() -> list[Trajectory]:
        try:
            return [t async for t in iter_trajectories([SAMPLE], spec, group_size=2)]
        finally:
            await close_spec(spec)

    trajs = asyncio.run(go())
    assert len(trajs) == 4 and sorted(t.sample_index for t in trajs) == [0, 0, 1, 1]
    assert runner.closed == 1 and factory.stopped == 1
