"""ScriptedEngine: scripted replies cut like real samples, calls recorded."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from turnrl.engines import ScriptedEngine, ScriptedReply
from turnrl.types import Engine, EngineError, SamplingParams

IM_END = 151645
SAMPLING = SamplingParams(max_tokens=64)


def test_is_an_engine(qwen3_tokenizer: Any) -> None:
    assert isinstance(ScriptedEngine(qwen3_tokenizer, []), Engine)


async def test_text_reply_gets_eos_and_constant_logprobs(qwen3_tokenizer: Any) -> None:
    engine = ScriptedEngine(qwen3_tokenizer, ["Hello there"])
    gen = await engine.generate([1, 2, 3], SAMPLING)
    assert gen.token_ids == [*qwen3_tokenizer.encode("Hello there"), IM_END]
    assert gen.logprobs == [-0.5] * len(gen.token_ids)
    assert gen.finish_reason == "stop"
    assert engine.prompts == [[1, 2, 3]]
    assert engine.calls[0].sampling == SAMPLING


async def test_eos_text_is_the_real_eos_and_cuts_the_reply(qwen3_tokenizer: Any) -> None:
    engine = ScriptedEngine(qwen3_tokenizer, ["Hi<|im_end|>", "A<|im_end|>ignored"])
    first, second = [await engine.generate([1], SAMPLING) for _ in range(2)]
    assert first.token_ids == [*qwen3_tokenizer.encode("Hi"), IM_END]
    assert second.token_ids == [*qwen3_tokenizer.encode("A"), IM_END]


async def test_length_reply_has_no_eos(qwen3_tokenizer: Any) -> None:
    engine = ScriptedEngine(qwen3_tokenizer, [ScriptedReply(text="cut off", finish_reason="length")])
    gen = await engine.generate([1], SAMPLING)
    assert (gen.token_ids, gen.finish_reason) == (qwen3_tokenizer.encode("cut off"), "length")


async def test_max_tokens_truncates(qwen3_tokenizer: Any) -> None:
    engine = ScriptedEngine(qwen3_tokenizer, [[5, 6, 7, 8]])
    gen = await engine.generate([1], SamplingParams(max_tokens=3))
    assert (gen.token_ids, gen.finish_reason) == ([5, 6, 7], "length")


async def test_stop_token_ids_cut_token_replies(qwen3_tokenizer: Any) -> None:
    engine = ScriptedEngine(
        qwen3_tokenizer, [ScriptedReply(token_ids=[5, 6, 7, 8], logprobs=[-1, -2, -3, -4])]
    )
    gen = await engine.generate([1], SamplingParams(stop_token_ids=(7,)))
    assert (gen.token_ids, gen.logprobs, gen.finish_reason) == ([5, 6, 7], [-1, -2, -3], "stop")


async def test_callable_script_sees_the_prompt(qwen3_tokenizer: Any) -> None:
    async def reply(prompt: list[int], sampling: SamplingParams) -> str:
        return f"{len(prompt)} tokens"

    engine = ScriptedEngine(qwen3_tokenizer, reply)
    gen = await engine.generate([1, 2, 3, 4], SAMPLING)
    assert qwen3_tokenizer.decode(gen.token_ids) == "4 tokens<|im_end|>"


async def test_errors_exhaustion_and_close(qwen3_tokenizer: Any) -> None:
    engine = ScriptedEngine(qwen3_tokenizer, [EngineError("boom")])
    with pytest.raises(EngineError, match="boom"):
        await engine.generate([1], SAMPLING)
    with pytest.raises(EngineError, match="exhausted"):
        await engine.generate([1], SAMPLING)
    await engine.close()
    with pytest.raises(EngineError, match="closed"):
        await engine.generate([1], SAMPLING)


async def test_delay_lets_calls_overlap(qwen3_tokenizer: Any) -> None:
    engine = ScriptedEngine(qwen3_tokenizer, lambda prompt, sampling: "ok", delay_s=0.2)
    in_flight_at_first_return: list[int] = []

    async def call(i: int) -> None:
        await engine.generate([i], SAMPLING)
        if not in_flight_at_first_return:
            in_flight_at_first_return.append(len(engine.calls))

    await asyncio.gather(*(call(i) for i in range(5)))
    # when the first call returned, all five had been received: they waited out their delays together
    assert in_flight_at_first_return == [5]
    assert sorted(p[0] for p in engine.prompts) == [0, 1, 2, 3, 4]
