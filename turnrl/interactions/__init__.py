"""Models that take part in a rollout without being trained: simulated users and LLM judges.

They speak text (chat messages in, a reply out) through any engine kind turnrl runs (the embedded
one, vLLM, servers by URL) or any OpenAI-compatible chat endpoint.
"""

from turnrl.interactions.chat_model import ChatModel, ChatReply, EngineChat, OpenAIChat, chat_model
from turnrl.interactions.user import LLMUser

__all__ = ["ChatModel", "ChatReply", "EngineChat", "LLMUser", "OpenAIChat", "chat_model"]
