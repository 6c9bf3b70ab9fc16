"""The one async interface every engine implements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one generation."""

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus sampling; 1.0 keeps the whole distribution
    top_k: int = 0  # 0 keeps every token
    max_tokens: int = 256  # per generation; the rollout lowers it to the remaining budget
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens, on top of the model's eos ids
    seed: int | None = None  # per-request seed, where the engine supports it

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """A copy with another max_tokens."""
        return replace(self, max_tokens=max_tokens)


@dataclass
class Generation:
    """What the engine sampled for one request.

    ``token_ids`` are exactly the sampled tokens, including the stop token when the
    generation ended on one (``finish_reason == "stop"``). ``logprobs[i]`` is the
    log-probability of ``token_ids[i]`` under ``softmax(logits / temperature)`` over the
    full vocabulary, before top-k / top-p filtering (greedy: temperature 1), which is the
    distribution a trainer recomputes with a forward pass.
    """

    token_ids: list[int]  # sampled token ids, stop token included
    logprobs: list[float]  # one per token in token_ids
    finish_reason: FinishReason  # stop: eos or stop token; length: max_tokens; abort: cut off
    info: dict[str, Any] | None = None  # engine-specific extras (server, timings...)
    versions: list[int] | None = None  # per token: the weight version that sampled it, if known


@runtime_checkable
class Engine(Protocol):
    """Generates from token ids; many callers may await it concurrently."""

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[Any] = (),
        *,
        session: str | None = None,
    ) -> Generation:
        """Sample a continuation of ``prompt_ids``.

        The rollout passes its live token list without copying; the caller appends to it
        after the call returns, so an engine that keeps the ids beyond the call must copy them.
        ``session`` names the trajectory (every turn of it passes the same one), so engines
        behind a load balancer can keep its turns on one server's prefix cache; others ignore it.
        """
        ...

    async def close(self) -> None:
        """Release the engine's resources."""
        ...


class EngineError(RuntimeError):
    """The engine failed for a request and retrying will not help."""
