"""A user simulated by a second model: verl's interaction, answering as a persona.

In an interaction YAML::

    interaction:
      - name: customer
        class_name: turnrl.app.LLMUser
        config:
          model: smollm2-135m                 # any engine kind: {model, engine: {kind: vllm, ...}}
          # base_url: http://127.0.0.1:8000/v1  (an OpenAI-compatible chat endpoint instead)
          persona: "You are a customer whose order {order_id} arrived broken. ..."
          stop_phrase: "###DONE###"          # the user ends the conversation by saying it
          max_user_turns: 4                  # messages it writes after the row's opening one
          sampling: {temperature: 0.7, max_tokens: 96}

The persona is formatted with the row's ``interaction_kwargs``. The user model sees the
conversation with the roles swapped (the policy's turns as ``user``, its own as ``assistant``),
tool calls and results left out, and the persona as its system prompt.
"""

from __future__ import annotations

import uuid
from typing import Any

from turnrl.app.chat_models import ChatModel, Placeholders, chat_model
from turnrl.tools.parsers import ToolParser, get_parser
from turnrl.types import Message

SWAPPED = {"assistant": "user", "user": "assistant"}


class LLMUser:
    """verl's ``BaseInteraction`` lifecycle, answered by a chat model."""

    def __init__(self, config: dict[str, Any], model: ChatModel | None = None) -> None:
        self.config = dict(config)
        self.name: str = str(config.get("name", "user"))
        self.persona = str(config.get("persona", "You are a user talking to an assistant."))
        self.stop_phrase = str(config.get("stop_phrase", "###DONE###"))
        self.max_user_turns = int(config.get("max_user_turns", 4))
        self.parser = get_parser(str(config.get("parser", "hermes")))  # the policy's call format
        self.model = model or chat_model(config)
        self._turns: dict[str, int] = {}
        self.stats = {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0}

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Begin one conversation."""
        instance_id = instance_id or uuid.uuid4().hex
        self._turns[instance_id] = 0
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """The user's next message; it ends the conversation by saying the stop phrase, or once it
        has written ``max_user_turns`` messages (the row's opening message not counted): the agent
        answers each of them, and no message is generated only to be thrown away."""
        self._turns[instance_id] = turns = self._turns.get(instance_id, 0) + 1
        if turns > self.max_user_turns:
            return True, "", 0.0, {"user_turn": turns - 1, "ended": "max_user_turns"}
        system = self.persona.format_map(Placeholders(kwargs))
        view: list[Message] = [{"role": "system", "content": system}, *_swapped(messages, self.parser)]
        reply = await self.model.chat(view)
        self.stats["calls"] += 1
        self.stats["prompt_tokens"] += reply.prompt_tokens
        self.stats["completion_tokens"] += reply.completion_tokens
        text = reply.text
        done = self.stop_phrase in text
        text = text.replace(self.stop_phrase, "").strip() or "Thank you, goodbye."
        meta = {"user_turn": turns, "prompt_tokens": reply.prompt_tokens, "tokens": reply.completion_tokens}
        return done, text, 0.0, meta

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        """Forget the conversation."""
        self._turns.pop(instance_id, None)


def _swapped(messages: list[dict[str, Any]], parser: ToolParser) -> list[Message]:
    """The conversation from the user's side: roles swapped, the system prompt, tool calls and tool
    results left out, consecutive messages of one role merged (chat templates want alternation)."""
    out: list[Message] = []
    for message in messages:
        role = SWAPPED.get(str(message.get("role")))
        content = message.get("content")
        if role is None or not isinstance(content, str) or not content.strip():
            continue
        text = parser.parse(content).content  # what a user sees: no reasoning, no tool calls
        if not text:
            continue
        if out and out[-1]["role"] == role:
            out[-1]["content"] = f"{out[-1]['content']}\n{text}"
        else:
            out.append({"role": role, "content": text})
    if out and out[0]["role"] == "assistant":  # a conversation must open with the (swapped) user
        out.insert(0, {"role": "user", "content": "(The conversation starts.)"})
    return out
