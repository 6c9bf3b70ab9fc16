"""HFEngine: exact logprobs, continuous batching, stops, seeds, weight updates, SmolLM2."""

from __future__ import annotations

import asyncio
import copy
import pickle
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from reference import chat_prompt

from turnrl.app import hf_engine
from turnrl.engines import HFEngine
from turnrl.engines.hf import sample_token
from turnrl.engines.hf.sampling import _draw_rows, sample_tokens
from turnrl.models import load_model, load_tokenizer
from turnrl.rollout.loop import run_trajectory
from turnrl.testing import until
from turnrl.types import Engine, EngineError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture
async def engine(tiny_qwen3_model: Any) -> AsyncIterator[HFEngine]:
    """An engine over the shared tiny model."""
    async with HFEngine(tiny_qwen3_model, seed=0) as eng:
        yield eng


def forward_logprobs(model: Any, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of a fresh full forward pass, at each generated position: [len(tokens), V]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / (temperature or 1.0), -1)


def gathered(logprobs: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """The logprob of each token at its own position."""
    return logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_is_an_engine(tiny_qwen3_model: Any) -> None:
    assert isinstance(HFEngine(tiny_qwen3_model), Engine)


async def test_greedy_logprobs_match_forward_pass(
    engine: HFEngine, tiny_qwen3_model: Any, qwen3_tokenizer: Any
) -> None:
    prompt = chat_prompt(qwen3_tokenizer, "Count to ten.")
    gen = await engine.generate(prompt, GREEDY)
    assert len(gen.token_ids) == len(gen.logprobs) == 12
    ref = forward_logprobs(tiny_qwen3_model, prompt, gen.token_ids, 0.0)
    assert gen.token_ids == ref.argmax(-1).tolist()
    torch.testing.assert_close(torch.tensor(gen.logprobs), gathered(ref, gen.token_ids), atol=1e-4, rtol=0)


async def test_sampled_logprobs_are_full_vocab_not_top_k_renormalized(
    engine: HFEngine, tiny_qwen3_model: Any, qwen3_tokenizer: Any
) -> None:
    prompt = chat_prompt(qwen3_tokenizer, "Tell me a story.")
    sampling = SamplingParams(temperature=0.7, top_k=20, max_tokens=16, seed=1)
    gen = await engine.generate(prompt, sampling)
    ref = forward_logprobs(tiny_qwen3_model, prompt, gen.token_ids, 0.7)
    expected = gathered(ref, gen.token_ids)
    torch.testing.assert_close(torch.tensor(gen.logprobs), expected, atol=1e-4, rtol=0)
    top_values, top_ids = ref.topk(20, -1)
    assert all(t in row for t, row in zip(gen.token_ids, top_ids.tolist(), strict=True))
    renormalized = expected - torch.logsumexp(top_values, -1)
    assert (renormalized - expected).min() > 0.5  # renormalizing over the top 20 would add this much


async def test_top_p_samples_inside_the_nucleus(engine: HFEngine, tiny_qwen3_model: Any) -> None:
    prompt = list(range(1000, 1040))
    gen = await engine.generate(prompt, SamplingParams(temperature=1.0, top_p=0.3, max_tokens=16, seed=2))
    ref = forward_logprobs(tiny_qwen3_model, prompt, gen.token_ids, 1.0)
    for row, token in zip(ref, gen.token_ids, strict=True):
        probs = row.exp()
        mass_above = probs[probs > probs[token]].sum()
        assert mass_above < 0.3


def test_sample_token_frequencies_follow_the_filtered_distribution() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    generator = torch.Generator().manual_seed(0)
    sampling = SamplingParams(temperature=1.0, top_k=2)
    draws = [sample_token(logits, sampling, generator) for _ in range(4000)]
    counts = torch.bincount(torch.tensor([t for t, _ in draws]), minlength=4).float() / len(draws)
    torch.testing.assert_close(counts, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.03, rtol=0)
    first_logprobs = {round(lp, 5) for t, lp in draws if t == 0}
    assert first_logprobs == {round(float(torch.log(torch.tensor(0.5))), 5)}  # full vocab, not renormalized


def test_two_level_draws_are_the_full_inverse_cdf() -> None:
    """The block-then-token search picks what one float64 cumulative sum over the whole vocabulary
    picks for the same uniform number (the float32 weights given), on vocabularies that end in a
    partial block, and never a token of zero weight. The block sums are float32 (a float64 pass over
    the vocabulary is what the two levels avoid), and their rounding depends on the CPU's vector
    width: a draw may differ only where the target lies within 1e-6 of the total mass of the
    boundary between the two tokens (1 of 6,000 draws at 1.3e-9 on AVX-512, none on AVX2)."""
    near = 0
    for vocab in (7, 256, 1000, 49_153):
        logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
        logits[:, ::3] = float("-inf")  # tokens no draw may pick
        logprobs = torch.log_softmax(logits, -1)
        for trial in range(30):
            generators = [torch.Generator().manual_seed(1000 * trial + b) for b in range(6)]
            weights = torch.exp(logprobs).double()
            cdf = torch.cumsum(weights, -1)
            u = torch.stack(
                [
                    torch.rand(
                        (), generator=torch.Generator().manual_seed(1000 * trial + b), dtype=torch.float64
                    )
                    for b in range(6)
                ]
            )
            target = u * cdf[:, -1]
            expected = torch.searchsorted(cdf, target[:, None], right=True)[:, 0].tolist()
            drawn = _draw_rows(logprobs, generators)
            for b, (got, want) in enumerate(zip(drawn, expected, strict=True)):
                if got != want:
                    lo, hi = sorted((got, want))
                    gap = float((cdf[b, lo:hi] - target[b]).abs().max() / cdf[b, -1])
                    assert gap < 1e-6, f"vocab {vocab} trial {trial} row {b}: {got} != {want}, {gap:.2g} away"
                    near += 1
            assert all(int(t) % 3 for t in drawn)
    assert near <= 2, f"{near} of 720 draws off the float64 inverse CDF"


def test_two_level_draw_frequencies_follow_the_distribution() -> None:
    """Sampled at temperature 1 over 1000 tokens whose mass lies in several blocks (the last one
    partial), each token's frequency matches its probability."""
    probs = torch.zeros(1000, dtype=torch.float64)
    probs[[3, 255, 256, 511, 700, 999]] = torch.tensor([0.1, 0.25, 0.05, 0.3, 0.2, 0.1], dtype=torch.float64)
    logits = torch.log(probs).float()
    generator = torch.Generator().manual_seed(7)
    draws = [sample_token(logits, SamplingParams(temperature=1.0), generator)[0] for _ in range(6000)]
    freqs = torch.bincount(torch.tensor(draws), minlength=1000).double() / len(draws)
    torch.testing.assert_close(freqs, probs, atol=0.02, rtol=0)


def test_sampled_logprobs_are_the_log_softmax_at_the_temperature_on_a_large_vocabulary() -> None:
    """On Qwen's vocabulary size (a partial last block) and at several temperatures, each sampled
    token's logprob is ``log_softmax(logits / T)`` at that token, and tokens of zero weight (``-inf``
    logits at block edges) are never drawn."""
    vocab = 151_936
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(3)) * 5
    logits[:, 1::2] = float("-inf")
    logits[:, -1] = float("-inf")
    samplings = [SamplingParams(temperature=t) for t in (1.0, 0.7, 1.3, 1.0, 0.4, 1.0, 2.0, 1.0)]
    for trial in range(10):
        drawn = sample_tokens(
            logits, samplings, [torch.Generator().manual_seed(10 * trial + b) for b in range(8)]
        )
        for b, (token, logprob) in enumerate(drawn):
            assert token % 2 == 0 and token != vocab - 1
            expected = torch.log_softmax(logits[b].double() / samplings[b].temperature, -1)[token]
            assert abs(logprob - float(expected)) < 1e-5


def test_sample_tokens_draws_each_row_as_if_alone() -> None:
    """A row's token and logprob depend on its logits and generator only: batched sampling (the
    engine's decode step) equals sampling each row by itself, whatever the other rows ask for."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)) * 3
    samplings = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.5),
        SamplingParams(temperature=0.5),
    ]
    for trial in range(20):
        together = sample_tokens(
            logits, samplings, [torch.Generator().manual_seed(100 * trial + b) for b in range(5)]
        )
        alone = [
            sample_token(logits[b], samplings[b], torch.Generator().manual_seed(100 * trial + b))
            for b in range(5)
        ]
        assert [t for t, _ in together] == [t for t, _ in alone]
        torch.testing.assert_close(
            torch.tensor([lp for _, lp in together]), torch.tensor([lp for _, lp in alone]), atol=1e-6, rtol=0
        )
    greedy = together[1][0]
    assert greedy == int(logits[1].argmax())


async def test_packed_weights_serve_the_unpacked_models_tokens(tiny_qwen3_dir: Path) -> None:
    """oneDNN-packed linear layers (the CPU default) give the plain model's greedy tokens and exact
    logprobs; the model itself stays plain for every other caller (the reference forward pass here).
    (Sampled tokens may differ: a random model's distribution is nearly flat over 151k tokens, so
    float32 rounding moves the inverse-CDF boundaries by about one token's width.)"""
    packed_model, plain_model = load_model(str(tiny_qwen3_dir)), load_model(str(tiny_qwen3_dir))
    prompts = [list(range(300 + 7 * i, 340 + 9 * i)) for i in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    sampled = [SamplingParams(temperature=1.0, max_tokens=20, seed=i) for i in range(6)]
    async with (
        HFEngine(packed_model, packed_weights=True) as packed,
        HFEngine(plain_model, packed_weights=False) as plain,
    ):
        fast = await asyncio.gather(*(packed.generate(p, greedy) for p in prompts))
        slow = await asyncio.gather(*(plain.generate(p, greedy) for p in prompts))
        drawn = await asyncio.gather(*(packed.generate(p, s) for p, s in zip(prompts, sampled, strict=True)))
    assert all(
        type(m.forward).__name__ == "_Packed" for m in packed_model.modules() if type(m) is torch.nn.Linear
    )
    for a, b in zip(fast, slow, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    for prompt, gen in zip(prompts, drawn, strict=True):
        ref = gathered(forward_logprobs(packed_model, prompt, gen.token_ids, 1.0), gen.token_ids)
        expected = gathered(forward_logprobs(plain_model, prompt, gen.token_ids, 1.0), gen.token_ids)
        assert torch.equal(ref, expected)  # outside the engine's worker: the plain model's arithmetic
        torch.testing.assert_close(torch.tensor(gen.logprobs), expected, atol=1e-4, rtol=0)


async def test_a_served_model_still_copies_and_pickles(tiny_qwen3_dir: Path) -> None:
    """The packs are the engine's cache, not the model's state: a model an engine served (and one
    it is serving) deep-copies and pickles, and the copies compute what it computes."""
    model = load_model(str(tiny_qwen3_dir))
    ids = torch.tensor([[5, 6, 7, 8]])
    async with HFEngine(model, packed_weights=True) as engine:
        await engine.generate([1, 2, 3], GREEDY)
        serving_copy = copy.deepcopy(model)
    for other in (serving_copy, copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        with torch.no_grad():
            assert torch.equal(other(ids).logits, model(ids).logits)
    async with HFEngine(serving_copy) as copied, HFEngine(model) as original:  # the copy serves too
        a, b = await copied.generate([1, 2, 3], GREEDY), await original.generate([1, 2, 3], GREEDY)
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


async def test_packed_weights_refuses_a_model_it_cannot_pack(tiny_qwen3_dir: Path) -> None:
    model = load_model(str(tiny_qwen3_dir)).to(torch.float16)
    with pytest.raises(EngineError, match="packed_weights needs a float32 or bfloat16 model on CPU"):
        HFEngine(model, packed_weights=True)


async def test_a_bfloat16_model_generates_on_any_processor(tiny_qwen3_dir: Path) -> None:
    # oneDNN packs bfloat16 weights only on processors with its bfloat16 instructions; elsewhere the
    # default must leave packing off rather than fail every request
    model = load_model(str(tiny_qwen3_dir), dtype="bfloat16")
    async with HFEngine(model) as engine:
        out = await engine.generate([1, 2, 3], GREEDY)
    assert len(out.token_ids) == GREEDY.max_tokens and out.finish_reason == "length"
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        with pytest.raises(EngineError, match="bfloat16: a processor with oneDNN's bfloat16 support"):
            HFEngine(model, packed_weights=True)


@pytest.mark.parametrize("max_batch_size", [32, 3])
async def test_concurrent_requests_match_running_alone(
    engine: HFEngine, tiny_qwen3_model: Any, qwen3_tokenizer: Any, max_batch_size: int
) -> None:
    prompts = [chat_prompt(qwen3_tokenizer, "hi " * (3 * i + 1)) for i in range(8)]
    samplings = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i) for i in range(8)]
    alone = [await engine.generate(p, s) for p, s in zip(prompts, samplings, strict=True)]

    async def staggered(eng: HFEngine, i: int) -> Any:
        await asyncio.sleep(0.02 * (i % 3))  # some join while others decode
        return await eng.generate(prompts[i], samplings[i])

    async with HFEngine(tiny_qwen3_model, max_batch_size=max_batch_size) as batched:
        together = await asyncio.gather(*(staggered(batched, i) for i in range(8)))
    for a, b in zip(alone, together, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


async def test_event_loop_runs_while_generating(engine: HFEngine) -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    gen = await engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=60))
    task.cancel()
    assert len(gen.token_ids) == 60
    assert ticks >= 10  # the loop was free while the worker thread decoded


async def test_seed_reproduces_a_sample_even_in_a_batch(engine: HFEngine) -> None:
    prompt = list(range(200, 230))
    sampling = SamplingParams(temperature=1.0, max_tokens=10, seed=7)
    first = await engine.generate(prompt, sampling)
    others = [
        engine.generate(list(range(50 + i, 80 + 2 * i)), SamplingParams(max_tokens=10)) for i in range(4)
    ]
    again, *_ = await asyncio.gather(engine.generate(prompt, sampling), *others)
    assert again.token_ids == first.token_ids
    other_seed = await engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=10, seed=8))
    assert other_seed.token_ids != first.token_ids


async def test_stop_token_is_included_with_finish_reason_stop(engine: HFEngine) -> None:
    prompt = list(range(300, 320))
    full = await engine.generate(prompt, GREEDY)
    stop = full.token_ids[4]
    cut = full.token_ids.index(stop) + 1
    gen = await engine.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop,))
    )
    assert gen.finish_reason == "stop"
    assert gen.token_ids == full.token_ids[:cut]
    assert gen.logprobs == pytest.approx(full.logprobs[:cut], abs=1e-4)


async def test_eos_ends_generation(tiny_qwen3_model: Any) -> None:
    prompt = list(range(300, 320))
    async with HFEngine(tiny_qwen3_model) as plain:
        full = await plain.generate(prompt, GREEDY)
    eos = full.token_ids[2]
    async with HFEngine(tiny_qwen3_model, eos_token_ids=[eos]) as eng:
        gen = await eng.generate(prompt, GREEDY)
    assert gen.finish_reason == "stop"
    assert gen.token_ids[-1] == eos
    assert gen.token_ids == full.token_ids[: full.token_ids.index(eos) + 1]


def test_default_eos_ids_come_from_the_generation_config(tiny_qwen3_model: Any, qwen3_tokenizer: Any) -> None:
    assert HFEngine(tiny_qwen3_model).eos_token_ids == {151645, 151643}
    assert HFEngine(tiny_qwen3_model, qwen3_tokenizer).eos_token_ids == {151645, 151643}


async def test_max_tokens_gives_finish_reason_length(engine: HFEngine) -> None:
    gen = await engine.generate([1, 2, 3], SamplingParams(temperature=1.0, max_tokens=5))
    assert (len(gen.token_ids), gen.finish_reason) == (5, "length")
    empty = await engine.generate([1, 2, 3], SamplingParams(max_tokens=0))
    assert (empty.token_ids, empty.finish_reason) == ([], "length")


async def test_update_weights_changes_outputs(tiny_qwen3_dir: Path) -> None:
    model = load_model(str(tiny_qwen3_dir))
    prompt = list(range(400, 430))
    async with HFEngine(model) as eng:
        before = await eng.generate(prompt, GREEDY)
        generator = torch.Generator().manual_seed(0)
        noisy = {
            k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()
        }
        assert await eng.update_weights(noisy) == 1
        after = await eng.generate(prompt, GREEDY)
    assert after.token_ids != before.token_ids
    assert after.info is not None and after.info["weight_versions"] == [1, 1]
    ref = forward_logprobs(model, prompt, after.token_ids, 0.0)
    torch.testing.assert_close(
        torch.tensor(after.logprobs), gathered(ref, after.token_ids), atol=1e-4, rtol=0
    )


async def test_update_weights_waits_for_the_step_and_running_requests_go_on(tiny_qwen3_dir: Path) -> None:
    model = load_model(str(tiny_qwen3_dir))
    async with HFEngine(model) as eng:
        running = asyncio.create_task(
            eng.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=150))
        )
        await until(lambda: eng.tokens_sampled >= 5, what="the request to be decoding")
        await eng.update_weights(model.state_dict())
        gen = await running
    assert gen.finish_reason == "length" and len(gen.token_ids) == 150
    assert gen.info is not None and gen.info["weight_versions"] == [0, 1]


async def test_bad_state_dict_raises_and_engine_goes_on(engine: HFEngine) -> None:
    with pytest.raises(RuntimeError):
        await engine.update_weights({"nope": torch.zeros(1)})
    assert engine.weight_version == 0
    assert len((await engine.generate([1, 2], GREEDY)).token_ids) == 12


async def test_close_aborts_running_requests(tiny_qwen3_model: Any) -> None:
    eng = HFEngine(tiny_qwen3_model)
    running = asyncio.create_task(eng.generate([1, 2, 3], SamplingParams(max_tokens=20000)))
    await until(lambda: eng.tokens_sampled >= 5, what="the request to be decoding")
    await eng.close()
    gen = await running
    assert gen.finish_reason == "abort"
    assert 0 < len(gen.token_ids) == len(gen.logprobs) < 20000
    with pytest.raises(EngineError, match="closed"):
        await eng.generate([1, 2, 3], GREEDY)


async def test_cancelled_request_leaves_the_batch(engine: HFEngine) -> None:
    task = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(max_tokens=20000)))
    await until(lambda: engine.tokens_sampled >= 5, what="the request to be decoding")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gen = await asyncio.wait_for(engine.generate([4, 5, 6], GREEDY), timeout=10)
    assert len(gen.token_ids) == 12


@pytest.mark.parametrize(
    ("prompt", "images", "match"),
    [([], (), "empty"), ([1, 2], ("img",), "text-only"), ([10**7], (), "vocabulary")],
)
async def test_bad_requests_raise_engine_error(
    engine: HFEngine, prompt: list[int], images: Any, match: str
) -> None:
    with pytest.raises(EngineError, match=match):
        await engine.generate(prompt, GREEDY, images)


@pytest.mark.slow
async def test_smollm2_gguf_answers_with_its_chat_template() -> None:
    tokenizer = load_tokenizer("smollm2-135m")
    assert tokenizer.chat_template
    prompt = chat_prompt(tokenizer, "What is the capital of France?")
    async with hf_engine("smollm2-135m") as eng:
        gen = await eng.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16))
    assert "Paris" in tokenizer.decode(gen.token_ids)
    assert gen.finish_reason == "stop" and gen.token_ids[-1] == tokenizer.eos_token_id


async def session_rollouts(model: Any, tokenizer: Any, cache_tokens: int) -> tuple[list[Any], dict[str, int]]:
    """Four 3-turn trajectories (model, echo, model, echo, model) through one engine."""
    from turnrl.chat.encoder import ChatEncoder
    from turnrl.rollout.loop import RolloutSpec
    from turnrl.testing import EchoEnv
    from turnrl.types import Limits, Sample

    engine = HFEngine(model, tokenizer, seed=0, prefix_cache_tokens=cache_tokens)
    stops = tuple(range(0, 151000, 5))  # the random model ends its turns on these
    spec = RolloutSpec(
        env_factory=EchoEnv,
        engine=engine,
        encoder=ChatEncoder(tokenizer, {"enable_thinking": False}),
        sampling=SamplingParams(temperature=1.0, max_tokens=24, seed=7, stop_token_ids=stops),
        limits=Limits(max_turns=3, max_context_tokens=1024),
    )
    samples = [Sample(f"s{i}", [{"role": "user", "content": f"Story {i}, please."}]) for i in range(4)]
    try:
        trajs = await asyncio.gather(*(run_trajectory(s, spec) for s in samples))
    finally:
        await engine.close()
    return list(trajs), engine.prefix_stats


async def test_later_turns_reuse_their_sessions_kv(tiny_qwen3_model: Any, qwen3_tokenizer: Any) -> None:
    cached, stats = await session_rollouts(tiny_qwen3_model, qwen3_tokenizer, 32768)
    plain, plain_stats = await session_rollouts(tiny_qwen3_model, qwen3_tokenizer, 0)
    turns = sum(t.num_turns for t in cached)
    assert turns >= 8 and plain_stats["hits"] == 0
    assert stats["hits"] == turns - len(cached)  # every turn after the first
    assert stats["prefilled_tokens"] + stats["reused_tokens"] == plain_stats["prefilled_tokens"]
    assert stats["prefilled_tokens"] < plain_stats["prefilled_tokens"] / 2
    # The same samples up to float rounding: the KV of a reused prefix and of a full prefill differ
    # in the last bits, which can flip one temperature-1 draw that falls on a CDF boundary; the
    # sequences then part there. Up to that point tokens and logprobs agree, and most agree whole.
    identical = 0
    for a, b in zip(cached, plain, strict=True):
        n = next(
            (i for i, (x, y) in enumerate(zip(a.response_ids, b.response_ids, strict=False)) if x != y), None
        )
        shared = n if n is not None else min(len(a.response_ids), len(b.response_ids))
        torch.testing.assert_close(
            torch.tensor(a.rollout_logprobs[:shared]),
            torch.tensor(b.rollout_logprobs[:shared]),
            atol=1e-4,
            rtol=0,
        )
        identical += a.response_ids == b.response_ids
    assert identical >= len(cached) - 1


async def test_weight_updates_drop_kept_kv(tiny_qwen3_dir: Path) -> None:
    model, tokenizer = load_model(str(tiny_qwen3_dir)), load_tokenizer(str(tiny_qwen3_dir))
    engine = HFEngine(model, tokenizer, seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    try:
        prompt = chat_prompt(tokenizer, "Hello")
        first = await engine.generate(prompt, greedy, session="a")
        follow = [*prompt, *first.token_ids, 151645, 198]
        second = await engine.generate(follow, greedy, session="a")
        assert engine.prefix_stats["hits"] == 1
        longer = [*follow, *second.token_ids, 151645, 198]
        third = await engine.generate(longer, greedy, session="a")  # extends the last turn: a hit
        assert engine.prefix_stats["hits"] == 2
        await engine.update_weights({k: v * 1.01 for k, v in model.state_dict().items()})
        again = await engine.generate([*longer, *third.token_ids, 13], greedy, session="a")
        assert engine.prefix_stats["hits"] == 2  # the kept KV was computed with the old weights
        assert again.token_ids
        await engine.generate([*longer, *third.token_ids, 13, *again.token_ids, 13], greedy, session="b")
        assert engine.prefix_stats["hits"] == 2  # another session's KV is not used
    finally:
        await engine.close()


async def test_prompts_prefilled_together_match_each_alone(tiny_qwen3_dir: Path) -> None:
    """Second turns of sessions with kept KV of different lengths, and fresh prompts, arrive at
    once and are prefilled in one padded forward pass (kept KV and new tokens padded apart): each
    gets the greedy tokens and logprobs it gets alone, without kept KV."""
    model = load_model(str(tiny_qwen3_dir))
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    firsts = [list(range(100 + 13 * i, 110 + 19 * i)) for i in range(4)]
    shapes: list[tuple[int, ...]] = []  # of the token ids of each forward pass (the embedding's input)
    model.model.embed_tokens.register_forward_hook(lambda _m, args, _out: shapes.append(tuple(args[0].shape)))

    async with HFEngine(model, seed=0) as engine:
        turns = [await engine.generate(p, greedy, session=f"s{i}") for i, p in enumerate(firsts)]
        seconds = [
            [*p, *t.token_ids, *range(500, 503 + 4 * i)]
            for i, (p, t) in enumerate(zip(firsts, turns, strict=True))
        ]
        fresh = [list(range(700, 709)), list(range(800, 831))]
        shapes.clear()
        together = await asyncio.gather(
            *(engine.generate(p, greedy, session=f"s{i}") for i, p in enumerate(seconds)),
            *(engine.generate(p, greedy) for p in fresh),
        )
        assert engine.prefix_stats["hits"] == 4
    assert max(rows for rows, steps in shapes if steps > 1) >= 4  # prefilled together, not one by one
    async with HFEngine(load_model(str(tiny_qwen3_dir)), prefix_cache_tokens=0) as plain:
        alone = [await plain.generate(p, greedy) for p in [*seconds, *fresh]]
    for a, b in zip(together, alone, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_prefill_groups_keep_their_padded_size_within_the_budget() -> None:
    """Rows are grouped shortest first while rows x padded width fits the budget; a row longer than
    the budget goes alone."""
    from turnrl.engines.hf.prefill import Row, chunks
    from turnrl.engines.hf.requests import Request

    def row(n: int) -> Row:
        request = Request(list(range(n)), GREEDY, frozenset(), 4, torch.Generator(), None, None)  # type: ignore[arg-type]
        return Row(request, [])

    groups = chunks([row(n) for n in (50, 10, 30, 20, 300, 40)], 100)
    assert [[len(r.request.prompt_ids) for r in g] for g in groups] == [[10, 20, 30], [40, 50], [300]]


FAMILIES = {
    "llama": {"attention_bias": True, "mlp_bias": True},  # biases on every product
    "mistral": {"sliding_window": None},
    "qwen2": {},  # query, key and value biases
    "qwen3": {},  # query and key norms
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_fused_forward_serves_the_modeling_codes_tokens(family: str) -> None:
    """On every family the engine's own forward serves (random tiny models of the real modeling
    code), fused and packed serving gives the modeling code's greedy tokens and logprobs: prompts
    of different lengths prefilled together, decoded together, and a second turn on kept KV."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from turnrl.engines.hf.fused import fusable

    config = AutoConfig.for_model(
        family, vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        **FAMILIES[family],
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(std=0.5)  # initialized to zero, which would not test them
    assert fusable(model)
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    prompts = [list(range(5 + i, 20 + 7 * i)) for i in range(5)]
    results = {}
    for packed in (True, False):
        async with HFEngine(model, eos_token_ids=[], packed_weights=packed) as engine:
            assert (engine._scheduler.fused is not None) == packed
            firsts = await asyncio.gather(
                *(engine.generate(p, greedy, session=str(i)) for i, p in enumerate(prompts))
            )
            follow = [[*p, *g.token_ids, 300, 301] for p, g in zip(prompts, firsts, strict=True)]
            seconds = await asyncio.gather(
                *(engine.generate(p, greedy, session=str(i)) for i, p in enumerate(follow))
            )
            assert engine.prefix_stats["hits"] == len(prompts)
        results[packed] = [*firsts, *seconds]
    for fused, plain in zip(results[True], results[False], strict=True):
        assert fused.token_ids == plain.token_ids
        torch.testing.assert_close(
            torch.tensor(fused.logprobs), torch.tensor(plain.logprobs), atol=1e-4, rtol=0
        )
