"""The APIs the gateway speaks, registered in one place: ``routes`` serves each dialect at its paths
(and under ``/s/{session}``). A new API is one class with ``paths``, ``serve`` and ``error_body``
(``turnrl.gateway.call.Dialect``), added here."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from turnrl.gateway.anthropic_messages import AnthropicCountTokens, AnthropicMessages
from turnrl.gateway.call import Dialect
from turnrl.gateway.openai_chat import OpenAIChat
from turnrl.gateway.openai_responses import OpenAIResponses

if TYPE_CHECKING:
    from turnrl.gateway.server import Gateway

DIALECTS: tuple[Callable[[Gateway], Dialect], ...] = (
    lambda gateway: OpenAIChat(),
    OpenAIResponses,
    lambda gateway: AnthropicMessages(),
    AnthropicCountTokens,
)
"""Each dialect, made for one gateway (a dialect's state, such as Responses' memory, is that
gateway's)."""


def dialects(gateway: Gateway) -> list[Dialect]:
    """The dialects of ``gateway``, each with its own state."""
    return [make(gateway) for make in DIALECTS]
