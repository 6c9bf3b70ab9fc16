"""A test double that answers with scripted replies instead of a model.

Replies are processed like a real engine's samples: generation stops at the first eos or
stop token (included, finish_reason "stop") or at max_tokens ("length"). A reply that ends
without a stop token gets the eos id appended, unless it says ``finish_reason="length"``
(or "abort"). Reply text is encoded with special tokens recognized, so ``"<|im_end|>"`` in
the text is the real eos token: write it only where the script means it.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from turnrl.types import CURRENT_TURN, EngineError, FinishReason, Generation, Message, Sample, SamplingParams


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the scripted engine uses."""

    eos_token_id: Any

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class ScriptedReply:
    """One scripted generation, with the details a plain string or id list cannot say."""

    text: str | None = None  # encoded with the tokenizer; exclusive with token_ids
    token_ids: Sequence[int] | None = None  # used verbatim
    finish_reason: FinishReason | None = None  # "length"/"abort": no eos appended; None/"stop": eos appended
    logprobs: Sequence[float] | None = None  # one per token; default: the engine's constant
    delay_s: float = 0.0  # extra seconds before this reply returns


Reply = str | Sequence[int] | ScriptedReply | BaseException
"""What a script yields: text, token ids, a full ScriptedReply, or an exception to raise."""

ReplyFn = Callable[[list[int], SamplingParams], Reply | Awaitable[Reply]]
"""A script as a function of the prompt ids and sampling params (may be async)."""


@dataclass(frozen=True)
class ScriptedCall:
    """What one generate() call received."""

    prompt_ids: list[int]
    sampling: SamplingParams
    images: tuple[Any, ...]


class ScriptedEngine:
    """Returns scripted generations and records every call; an Engine for unit tests."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        replies: Sequence[Reply] | ReplyFn,
        *,
        eos_token_id: int | None = None,
        logprob: float = -0.5,
        delay_s: float = 0.0,
    ) -> None:
        """``replies`` are used in call order (or computed per call); ``delay_s`` is awaited per call."""
        self._tokenizer = tokenizer
        self._replies = replies if callable(replies) else list(replies)
        eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        if eos is None:
            raise EngineError("ScriptedEngine needs an eos id: the tokenizer has none, pass eos_token_id")
        self.eos_token_id = int(eos)
        self._logprob = logprob
        self._delay_s = delay_s
        self._closed = False
        self.calls: list[ScriptedCall] = []  # every call received, in order

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer replies are encoded with."""
        return self._tokenizer

    @property
    def prompts(self) -> list[list[int]]:
        """The prompt ids of every call, in order."""
        return [call.prompt_ids for call in self.calls]

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[Any] = (),
        *,
        session: str | None = None,
    ) -> Generation:
        """Return the next scripted reply, cut like a real engine's sample."""
        if self._closed:
            raise EngineError("engine is closed")
        prompt = list(prompt_ids)
        self.calls.append(ScriptedCall(prompt, sampling, tuple(images)))
        reply = await self._next_reply(prompt, sampling)
        if isinstance(reply, BaseException):
            raise reply
        scripted = _as_scripted(reply)
        delay = self._delay_s + scripted.delay_s
        if delay > 0:
            await asyncio.sleep(delay)
        return self._generation(scripted, sampling)

    async def close(self) -> None:
        """Refuse further calls."""
        self._closed = True

    async def _next_reply(self, prompt: list[int], sampling: SamplingParams) -> Reply:
        """The script's reply for this call."""
        if callable(self._replies):
            reply = self._replies(prompt, sampling)
            return await reply if inspect.isawaitable(reply) else reply
        index = len(self.calls) - 1
        if index >= len(self._replies):
            raise EngineError(f"script exhausted: call {index + 1} but only {len(self._replies)} replies")
        return self._replies[index]

    def _generation(self, reply: ScriptedReply, sampling: SamplingParams) -> Generation:
        """Encode the reply and apply stop tokens, eos and max_tokens."""
        tokens = self._encode(reply)
        logprobs = list(reply.logprobs) if reply.logprobs is not None else [self._logprob] * len(tokens)
        if len(logprobs) != len(tokens):
            raise EngineError(f"scripted reply has {len(tokens)} tokens but {len(logprobs)} logprobs")
        stop_ids = {self.eos_token_id, *sampling.stop_token_ids}
        reason = reply.finish_reason or "stop"
        cut = next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), None)
        if cut is not None:
            tokens, logprobs, reason = tokens[:cut], logprobs[:cut], "stop"
        elif reason == "stop":
            tokens, logprobs = [*tokens, self.eos_token_id], [*logprobs, self._logprob]
        if len(tokens) > sampling.max_tokens:
            limit = max(sampling.max_tokens, 0)
            tokens, logprobs, reason = tokens[:limit], logprobs[:limit], "length"
        return Generation(tokens, logprobs, reason, {"scripted": True})

    def _encode(self, reply: ScriptedReply) -> list[int]:
        """The reply's token ids, encoding text with special tokens recognized."""
        if (reply.text is None) == (reply.token_ids is None):
            raise EngineError("a ScriptedReply needs exactly one of text and token_ids")
        if reply.token_ids is not None:
            return [int(t) for t in reply.token_ids]
        assert reply.text is not None
        return list(self._tokenizer.encode(reply.text, add_special_tokens=False))


Policy = Callable[[list[Message], list[Any], Sample], Any]
"""An env author's player: ``policy(messages, images, sample)`` returns the turn's text, token ids
or a ScriptedReply (may be async)."""


def policy_replies(policy: Policy) -> ReplyFn:
    """A script that asks ``policy`` for each turn, given the conversation the rollout holds."""

    async def reply(prompt: list[int], sampling: SamplingParams) -> Reply:
        turn = CURRENT_TURN.get()
        if turn is None:
            raise EngineError("a scripted policy plays inside a rollout: no turn is being generated")
        images = [getattr(image, "image", image) for image in turn.images]
        out = policy(list(turn.messages), images, turn.sample)
        if inspect.isawaitable(out):
            out = await out
        if not isinstance(out, str | ScriptedReply | list | tuple):
            name = getattr(policy, "__name__", "policy")
            got = type(out).__name__
            raise EngineError(f"scripted policy {name} returned {got}, expected the turn's text")
        return out

    return reply


def _as_scripted(reply: str | Sequence[int] | ScriptedReply) -> ScriptedReply:
    """Normalize a reply to a ScriptedReply."""
    if isinstance(reply, ScriptedReply):
        return reply
    if isinstance(reply, str):
        return ScriptedReply(text=reply)
    return ScriptedReply(token_ids=list(reply))
