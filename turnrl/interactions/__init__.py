"""Models that take part in a rollout without being trained: simulated users and LLM judges.

They speak text (chat messages in, a reply out) through any engine kind turnrl runs (the embedded
one, vLLM, servers by URL) or any OpenAI-compatible chat endpoint. The public names of
``turnrl.app.chat_models``, ``turnrl.app.llm_user`` and ``turnrl.app.judge`` (built from configs,
so they live with the app's wiring); ``class_name: turnrl.interactions.LLMUser`` in an
interaction YAML.
"""

from turnrl.app.chat_models import ChatModel, ChatReply, EngineChat, OpenAIChat, chat_model
from turnrl.app.judge import Judge, JudgeError, JudgeFeedback
from turnrl.app.llm_user import LLMUser

__all__ = [
    "ChatModel",
    "ChatReply",
    "EngineChat",
    "Judge",
    "JudgeError",
    "JudgeFeedback",
    "LLMUser",
    "OpenAIChat",
    "chat_model",
]
