"""Environments: the Env protocol, the tool-calling env, and the registry of envs by name."""

from turnrl.env.base import Env, EnvFactory
from turnrl.env.registry import EnvEntry, register_env, resolve_env
from turnrl.env.tool_env import ToolEnv
from turnrl.types import Observation, StepResult

__all__ = [
    "Env",
    "EnvEntry",
    "EnvFactory",
    "Observation",
    "StepResult",
    "ToolEnv",
    "register_env",
    "resolve_env",
]
