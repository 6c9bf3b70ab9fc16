"""The application layer: configs into engines, env factories, samples, rollout specs and training
runs; and the models that take part in a rollout without being trained (simulated users, LLM judges),
built from configs like the rest.

The part that knows every other part; ``cli`` and ``integrations`` build on it.
"""

from turnrl.app.chat_models import ChatModel, ChatReply, EngineChat, OpenAIChat, chat_model
from turnrl.app.engines import (
    EngineBuild,
    EngineSetupError,
    build_engine,
    hf_engine,
    local_engine,
    server_engine,
)
from turnrl.app.judge import Judge, JudgeError, JudgeFeedback
from turnrl.app.llm_user import LLMUser
from turnrl.app.parts import RunError, build_env_factory, build_rewards, build_spec, load_samples
from turnrl.app.run import Prepared, prepare, run, run_prepared

__all__ = [
    "ChatModel",
    "ChatReply",
    "EngineBuild",
    "EngineChat",
    "EngineSetupError",
    "Judge",
    "JudgeError",
    "JudgeFeedback",
    "LLMUser",
    "OpenAIChat",
    "Prepared",
    "RunError",
    "build_engine",
    "build_env_factory",
    "build_rewards",
    "build_spec",
    "chat_model",
    "hf_engine",
    "load_samples",
    "local_engine",
    "prepare",
    "run",
    "run_prepared",
    "server_engine",
]
