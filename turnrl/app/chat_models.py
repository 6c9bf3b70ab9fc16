"""Text-level chat for models that are not trained on: a token engine behind its chat template, or
an OpenAI-compatible ``/chat/completions`` endpoint."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import TypeAdapter, ValidationError

from turnrl.app.engines import local_engine
from turnrl.chat.template import ChatTemplate
from turnrl.config import ConfigError, EngineConfig, first_error
from turnrl.types import Engine, Message, SamplingParams


@dataclass
class ChatReply:
    """One reply, with what it cost."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0


class ChatModel(Protocol):
    """Chat messages in, the reply's text out."""

    async def chat(self, messages: Sequence[Message], max_tokens: int | None = None) -> ChatReply: ...

    async def close(self) -> None: ...


class EngineChat:
    """A token engine (embedded, vLLM, servers) behind its model's chat template."""

    def __init__(self, engine: Engine, tokenizer: Any, sampling: SamplingParams, **template_kwargs: Any):
        self.engine = engine
        self.template = ChatTemplate(tokenizer, template_kwargs or None)
        self.sampling = sampling
        self._tokenizer = tokenizer

    async def chat(self, messages: Sequence[Message], max_tokens: int | None = None) -> ChatReply:
        """Render ``messages`` with the generation prompt, generate, decode without special tokens."""
        ids = self.template.encode(self.template.render(messages, None, True))
        sampling = self.sampling
        if max_tokens is not None:
            sampling = dataclasses.replace(sampling, max_tokens=max_tokens)
        gen = await self.engine.generate(ids, sampling)
        text = self._tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        return ChatReply(str(text).strip(), len(ids), len(gen.token_ids))

    async def close(self) -> None:
        """Nothing: the engine is shared (cached per config) and lives with the process."""


class OpenAIChat:
    """An OpenAI-compatible chat endpoint (vLLM, SGLang, llama.cpp, a hosted API): text only."""

    def __init__(
        self,
        base_url: str,
        model: str,
        sampling: SamplingParams,
        api_key_env: str | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        import httpx

        key = os.environ.get(api_key_env, "") if api_key_env else ""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.sampling = sampling
        self.client = httpx.AsyncClient(timeout=timeout_s, headers=headers)

    async def chat(self, messages: Sequence[Message], max_tokens: int | None = None) -> ChatReply:
        """One ``/chat/completions`` request; an HTTP or format error raises with the reason."""
        body = {
            "model": self.model,
            "messages": list(messages),
            "max_tokens": max_tokens or self.sampling.max_tokens,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
        }
        response = await self.client.post(self.url, json=body)
        if response.status_code != 200:
            raise RuntimeError(
                f"chat endpoint {self.url} answered {response.status_code}: {response.text[:200]}"
            )
        data = response.json()
        try:
            text = data["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise RuntimeError(f"chat endpoint {self.url} gave no message: {str(data)[:200]}") from None
        usage = data.get("usage") or {}
        return ChatReply(
            text.strip(), int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
        )

    async def close(self) -> None:
        """Close the HTTP connections."""
        await self.client.aclose()


def chat_model(config: Mapping[str, Any]) -> ChatModel:
    """A chat model from a config mapping: ``{base_url, model, api_key_env}`` for an endpoint, else
    ``{model, engine: {kind: ...}, sampling: {...}, template_kwargs: {...}}`` for a token engine
    (default: the embedded one). Engines are built once per config and process."""
    sampling = _sampling(config.get("sampling") or {})
    if config.get("base_url"):
        return OpenAIChat(
            str(config["base_url"]),
            str(config.get("model") or "default"),
            sampling,
            config.get("api_key_env"),
            float(config.get("timeout_s", 120.0)),
        )
    if not config.get("model"):
        raise ConfigError("a chat model needs 'model' (with an optional engine) or 'base_url'")
    engine, tokenizer = _engine(
        str(config["model"]), json.dumps(config.get("engine") or {"kind": "hf"}, sort_keys=True)
    )
    return EngineChat(engine, tokenizer, sampling, **dict(config.get("template_kwargs") or {}))


def _sampling(raw: Mapping[str, Any]) -> SamplingParams:
    data = {"max_tokens": 256, **raw}
    try:
        return TypeAdapter(SamplingParams).validate_python(data)
    except ValidationError as exc:
        raise ConfigError(first_error(exc, data).replace("config", "chat model sampling", 1)) from None


class Placeholders(dict[str, Any]):
    """A ``format_map`` mapping that leaves unknown ``{fields}`` of a prompt as they are."""

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


@functools.lru_cache(maxsize=8)
def _engine(model: str, engine: str) -> tuple[Engine, Any]:
    """The engine of a chat model, built once per (model, engine config as JSON) and process."""
    data = json.loads(engine)
    try:
        e = TypeAdapter(EngineConfig).validate_python(data)
    except ValidationError as exc:
        said = first_error(exc, data).replace("config key '", "chat model engine key '", 1)
        raise ConfigError(said) from None
    if e.kind == "scripted":
        raise ConfigError("a chat model's engine needs a model: kind scripted has none")
    return local_engine(model, e)
