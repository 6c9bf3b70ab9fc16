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
            "EngineError",
            "Env",
            "FunctionTool",
            "Generation",
            "GroupRewardFn",
            "Limits",
            "Message",
            "RewardContext",
            "RewardFn",
            "Rewards",
            "RolloutControl",
            "RolloutSpec",
            "RunConfig",
            "Sample",
            "SamplingParams",
            "StepResult",
            "StopReason",
            "ToolEnv",
            "ToolOutput",
            "Trajectory",
            "Turn",
            "check_template",
            "collect",
            "hf_engine",
            "iter_trajectories",
            "load_config",
            "load_samples",
            "load_tools_config",
            "prepare",
            "read_trajectories",
            "register_env",
            "run",
            "run_trajectory",
            "tool",
            "trajectory_from_json",
            "trajectory_to_json",
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
        "engine_error",
        "internal_error",
        "aborted",
    } <= values
    assert turnrl.StopReason.MAX_TURNS.truncated and not turnrl.StopReason.ENV_DONE.truncated


def test_keyword_only_arguments_after_the_first_few() -> None:
    from turnrl.chat.encoder import ConversationEncoder

    for fn, positional in (
        (turnrl.collect, ["samples", "spec"]),
        (turnrl.iter_trajectories, ["samples", "spec"]),
    ):
        params = inspect.signature(fn).parameters.values()
        assert [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD] == positional
    check = inspect.signature(ConversationEncoder.check).parameters.values()
    assert all(p.kind is p.KEYWORD_ONLY for p in list(check)[4:])


def test_the_test_doubles_live_in_turnrl_testing() -> None:
    import turnrl.testing

    assert "ScriptedEngine" not in turnrl.__all__ and turnrl.testing.ScriptedEngine is not None
