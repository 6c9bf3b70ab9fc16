"""The public API is what ``turnrl`` re-exports; this pins it so changes are deliberate."""

from __future__ import annotations

import inspect

import turnrl
from turnrl.env.base import Env


def test_public_names_are_pinned() -> None:
    assert sorted(turnrl.__all__) == sorted(
        [
            "BaseTool",
            "ChatEncoder",
            "CheckResult",
            "Engine",
            "Env",
            "FunctionTool",
            "Generation",
            "Limits",
            "Message",
            "RewardContext",
            "RolloutSpec",
            "RunConfig",
            "Sample",
            "SamplingParams",
            "ScriptedEngine",
            "StepResult",
            "StopReason",
            "ToolEnv",
            "ToolOutput",
            "Trajectory",
            "Turn",
            "check_template",
            "collect",
            "iter_trajectories",
            "load_config",
            "load_tools_config",
            "read_trajectories",
            "register_env",
            "register_reward",
            "run_trajectory",
            "tool",
        ]
    )
    for name in turnrl.__all__:
        assert getattr(turnrl, name) is not None


def test_env_protocol_signatures() -> None:
    assert list(inspect.signature(Env.step).parameters) == ["self", "action"]
    assert list(inspect.signature(Env.format_observation).parameters) == ["self", "observation"]
    assert inspect.iscoroutinefunction(Env.reset) and inspect.iscoroutinefunction(Env.step)
    assert inspect.iscoroutinefunction(Env.close) and inspect.iscoroutinefunction(Env.score)


def test_stop_reasons_cover_the_contract() -> None:
    values = {r.value for r in turnrl.StopReason}
    assert {
        "env_done",
        "no_tool_call",
        "max_turns",
        "token_budget",
        "length",
        "env_error",
        "aborted",
    } <= values
    assert turnrl.StopReason.MAX_TURNS.truncated and not turnrl.StopReason.ENV_DONE.truncated
