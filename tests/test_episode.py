"""The episode around the turn loop: the JSONL record's schema, group rewards, env seeds, and
internal errors kept apart from env errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from turnrl.chat.encoder import ChatEncoder
from turnrl.env.base import Env
from turnrl.env.rewards import RewardContext, Rewards
from turnrl.record.codec import trajectory_from_json, trajectory_to_json
from turnrl.record.seeds import env_seed
from turnrl.rollout.collector import collect, read_trajectories
from turnrl.rollout.loop import RolloutSpec, run_trajectory
from turnrl.testing import EchoEnv, ScriptedEngine
from turnrl.types import (
    SCHEMA_VERSION,
    AgentRun,
    Limits,
    Sample,
    SamplingParams,
    SessionBranch,
    StepResult,
    StopReason,
    Trajectory,
)

GOLDEN = Path(__file__).parent / "golden" / "trajectory_schema.json"
PROMPT = [{"role": "user", "content": "Say a, then b."}]


def spec_for(tokenizer: Any, replies: list[Any], env: Any = None, **kw: Any) -> RolloutSpec:
    return RolloutSpec(
        env_factory=env or (lambda s: EchoEnv(s, done_after=2)),
        engine=ScriptedEngine(tokenizer, replies),
        encoder=ChatEncoder(tokenizer),
        sampling=SamplingParams(max_tokens=32, seed=kw.pop("seed", 7)),
        limits=Limits(max_turns=4),
        **kw,
    )


def _shape(value: Any) -> Any:
    """A JSON value's schema: objects by key, lists by their first item, scalars by type."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__


async def test_the_jsonl_record_matches_the_pinned_schema(qwen3_tokenizer: Any) -> None:
    traj = await run_trajectory(Sample("s", PROMPT), spec_for(qwen3_tokenizer, ["a", "b"]))
    record = json.loads(json.dumps(trajectory_to_json(traj)))
    assert record["schema_version"] == SCHEMA_VERSION
    shape = _shape({k: v for k, v in record.items() if k not in ("metrics", "info")})
    shape["metrics"] = sorted(record["metrics"])  # keys only: values vary by run
    # Changing this schema is a format change: bump SCHEMA_VERSION and update the golden file.
    assert shape == json.loads(GOLDEN.read_text())
    back = trajectory_from_json(record)
    assert back.response_ids == traj.response_ids and back.stop_reason == traj.stop_reason


def test_records_of_schema_1_still_read() -> None:
    old = {"id": "a/0", "group_id": "a", "data_source": "d", "stop_reason": "max_turns", "turns": []}
    traj = trajectory_from_json(old)
    assert traj.stop_reason == StopReason.MAX_TURNS and traj.response_ids == []


def test_a_schema_4_branch_reads_into_its_typed_fields() -> None:
    # schema 4 carried a session branch's links, its agent run and its exclusion as info keys
    turns = [{"role": "assistant", "start": 0, "end": 1, "text": "a", "info": {"call": 3, "note": 1}}]
    info = {"session": "s1", "branch": 2, "parent": 0, "reason": "retry", "shared_tokens": 5, "fork_at": 5}
    info |= {"forest": {"trunk": 4, "unchosen": 1}, "run": {"exit_code": 0, "seconds": 1.5, "calls": 4}}
    info |= {"run_reward": 0.5, "exclude": "unchosen", "num_tool_calls": 2}
    old = {"schema_version": 4, "group_id": "a", "data_source": "d", "stop_reason": "agent_done"}
    traj = trajectory_from_json(old | {"id": "a/0/2", "turns": turns, "info": info, "response_ids": [7]})
    assert traj.branch == SessionBranch("s1", 2, 0, "retry", 5, 5, trunk_tokens=4, unchosen_tokens=1)
    assert traj.run == AgentRun(0, 1.5, 4, reward=0.5) and traj.exclude == "unchosen"
    assert traj.turns[0].call == 3 and traj.turns[0].info == {"note": 1}
    assert traj.info == {"num_tool_calls": 2}  # what stays free-form
    again = trajectory_from_json(json.loads(json.dumps(trajectory_to_json(traj))))
    assert again == traj  # and schema 5 writes them as fields


async def test_a_bug_is_an_internal_error_not_an_env_error(qwen3_tokenizer: Any) -> None:
    def broken_hook(*args: Any) -> None:
        raise KeyError("bug in a hook")

    spec = spec_for(qwen3_tokenizer, ["a", "b"], on_turn=broken_hook)
    traj = await run_trajectory(Sample("s", PROMPT), spec)
    assert traj.stop_reason == StopReason.INTERNAL_ERROR
    assert traj.error is not None and traj.error.startswith("internal: KeyError")
    assert traj.response_ids  # what was recorded before the bug comes back


class SeedEnv(Env):
    seeds: ClassVar[list[int | None]] = []

    async def step(self, action: str) -> StepResult:
        SeedEnv.seeds.append(self.sample.seed)
        return StepResult("", done=True)


async def test_each_env_gets_its_own_reproducible_seed(qwen3_tokenizer: Any) -> None:
    samples = [Sample("p", PROMPT), Sample("q", PROMPT)]
    seen = []
    for _ in range(2):
        SeedEnv.seeds = []
        await collect(samples, spec_for(qwen3_tokenizer, ["a"] * 6, SeedEnv), group_size=3, concurrency=1)
        seen.append(sorted(s for s in SeedEnv.seeds if s is not None))
    assert len(seen[0]) == 6 and len(set(seen[0])) == 6  # one per trajectory, all distinct
    assert seen[0] == seen[1]  # the same on a rerun
    assert env_seed(None, samples[0], 0) is None  # an unseeded run leaves envs unseeded


async def test_group_rewards_score_a_whole_group_at_once(qwen3_tokenizer: Any, tmp_path: Path) -> None:
    calls: list[list[str]] = []

    def rank(contexts: list[RewardContext]) -> list[float]:
        calls.append([c.trajectory.id for c in contexts])
        assert all(c.env is None for c in contexts)
        return [float(c.trajectory.sample_index) for c in contexts]

    rewards = Rewards(by_source={"default": lambda ctx: 5.0}, groups={"default": rank})
    spec = spec_for(qwen3_tokenizer, ["a"] * 8, lambda s: EchoEnv(s, done_after=1), rewards=rewards)
    out = tmp_path / "t.jsonl"
    trajs = await collect([Sample("p", PROMPT), Sample("q", PROMPT)], spec, group_size=4, out_path=out)
    assert sorted(len(c) for c in calls) == [4, 4]  # each group once, whole
    assert sorted(t.reward for t in trajs) == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert all(t.metrics["reward/per_trajectory"] == 5.0 for t in trajs)
    assert [t.reward for t in read_trajectories(out)] == [t.reward for t in trajs]  # written rescored


async def test_a_failing_group_reward_says_why(qwen3_tokenizer: Any) -> None:
    rewards = Rewards(groups={"default": lambda contexts: [1.0]})  # one value for a group of two
    spec = spec_for(qwen3_tokenizer, ["a"] * 4, lambda s: EchoEnv(s, done_after=1), rewards=rewards)
    trajs: list[Trajectory] = await collect([Sample("p", PROMPT)], spec, group_size=2)
    assert all(
        t.reward == 0.0 and "returned 1 rewards for a group of 2" in t.metrics["reward_error"] for t in trajs
    )
