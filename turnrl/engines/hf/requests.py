"""What the engine's worker thread is handed: generation requests and weight updates, each
with the caller's event loop and future, and settling those futures from the worker thread."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from turnrl.types import FinishReason, Generation, SamplingParams, TokenSink
from turnrl.vision.processor import ImageInput


@dataclass(eq=False)
class Request:
    """One generate() call as the worker sees it."""

    prompt_ids: list[int]
    sampling: SamplingParams
    stop_ids: frozenset[int]  # eos ids plus the request's stop_token_ids
    max_new_tokens: int  # max_tokens, lowered to fit the context window
    generator: torch.Generator  # the request's own when seeded, else the engine's
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Generation]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # weight version of each sampled token
    cancelled: bool = False  # set by the caller's task when it stops waiting
    images: list[ImageInput] = field(default_factory=list)  # the prompt's images, in order
    session: str | None = None  # the trajectory it belongs to (its KV may be kept for the next turn)
    rope_delta: int = 0  # multimodal RoPE: text positions after images are shifted by this much
    sink: TokenSink | None = None  # the caller's streamed call: each token as it is sampled

    def add_token(self, token: int, logprob: float, version: int) -> FinishReason | None:
        """Record a sampled token; the finish reason when it ends the generation."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if self.sink is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is reading any more
                self.loop.call_soon_threadsafe(self.sink, (token,))
        if token in self.stop_ids:
            return "stop"
        return "length" if len(self.token_ids) >= self.max_new_tokens else None

    def finish(self, reason: FinishReason) -> None:
        """Hand the generation to the waiting caller."""
        span = [self.versions[0], self.versions[-1]] if self.versions else []
        info = {"prompt_tokens": len(self.prompt_ids), "weight_versions": span}
        result = Generation(list(self.token_ids), list(self.logprobs), reason, info, list(self.versions))
        resolve(self.loop, self.future, result)


@dataclass(eq=False)
class WeightUpdate:
    """A state dict waiting to be loaded between two steps."""

    state_dict: Mapping[str, torch.Tensor]
    strict: bool
    version: int | None  # the version to set; None: the current one plus one
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[int]


def resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], value: Any) -> None:
    """Set a result (or an exception) on a future owned by another thread's loop."""

    def settle() -> None:
        if future.done():
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
        loop.call_soon_threadsafe(settle)
