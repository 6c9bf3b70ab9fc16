"""turnrl: exact-token multi-turn agentic RL rollouts for LLMs and VLMs."""

from turnrl.chat import ChatEncoder, CheckResult, check_template
from turnrl.config import RunConfig, load_config
from turnrl.engines import Engine, Generation, SamplingParams, ScriptedEngine
from turnrl.env import Env, StepResult, ToolEnv, register_env
from turnrl.rewards import RewardContext, register_reward
from turnrl.rollout import Limits, RolloutSpec, collect, iter_trajectories, read_trajectories, run_trajectory
from turnrl.tools import BaseTool, FunctionTool, ToolOutput, load_tools_config, tool
from turnrl.types import Message, Sample, StopReason, Trajectory, Turn

__version__ = "0.1.0"

__all__ = [
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
