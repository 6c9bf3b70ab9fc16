"""The gateway: a server that speaks the OpenAI API to an agent that already exists and turns its
calls into token-exact trajectories (``turnrl gateway CONFIG``).

It sits beside the rollout loop, above chat, engines and tools: it serves an engine it is handed
(``app`` builds engines from configs, as for rollouts), encodes each request's new messages with the
chat template's deltas (``chat``), parses replies into tool calls with the family's parsers
(``tools``), and records each session's branches with the rollout's token record and JSONL writer
(``rollout``). It may import ``config``, ``rollout``, ``chat``, ``engines``, ``tools``, ``vision``,
``support`` and ``types``, nothing else of turnrl (``tests/test_architecture.py`` holds it to this);
``app`` wires it from a config and ``cli`` starts it.
"""

from turnrl.gateway.config import GatewayConfig
from turnrl.gateway.session import Branch, Reason, Session
from turnrl.gateway.store import read_branches

__all__ = ["Branch", "GatewayConfig", "Reason", "Session", "read_branches"]
