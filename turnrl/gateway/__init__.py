"""The gateway's room: a server that speaks the OpenAI and Anthropic APIs to an agent that already
exists and turns its calls into token-exact trajectories.

It sits beside the rollout loop, above chat, engines and tools: it serves an engine it is handed
(``app`` builds engines from configs, as for rollouts), encodes each request's new messages with the
chat template's deltas (``chat``), parses replies into tool calls with the family's parsers
(``tools``), and records each session's branches with the rollout's token record and JSONL codec
(``rollout``). It may import ``config``, ``rollout``, ``chat``, ``engines``, ``tools``, ``vision``,
``support`` and ``types``, nothing else of turnrl (``tests/test_architecture.py`` holds it to this);
``app`` wires it from a config and ``cli`` starts it.
"""
