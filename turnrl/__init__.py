"""turnrl: exact-token multi-turn agentic RL rollouts for LLMs and VLMs.

The names here are the public API (pinned by ``tests/test_public_api.py``). The public
subpackages are documented in the docs' API page: ``turnrl.types`` (the protocol),
``turnrl.env``, ``turnrl.tools``, ``turnrl.engines``, ``turnrl.rollout``, ``turnrl.app``,
``turnrl.train``, ``turnrl.integrations`` and ``turnrl.testing`` (test doubles).
"""

from turnrl.app import hf_engine, load_samples, prepare, run
from turnrl.chat import ChatEncoder, CheckResult, check_template
from turnrl.config import RunConfig, load_config
from turnrl.env import Env, ToolEnv, register_env
from turnrl.env.rewards import GroupRewardFn, RewardContext, RewardFn, Rewards
from turnrl.rollout import (
    Limits,
    RolloutControl,
    RolloutSpec,
    collect,
    iter_trajectories,
    read_trajectories,
    run_trajectory,
    trajectory_from_json,
    trajectory_to_json,
)
from turnrl.tools import BaseTool, FunctionTool, ToolOutput, load_tools_config, tool
from turnrl.types import (
    Engine,
    EngineError,
    Generation,
    Message,
    Sample,
    SamplingParams,
    StepResult,
    StopReason,
    Trajectory,
    Turn,
)

__version__ = "0.2.0"

__all__ = [
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
