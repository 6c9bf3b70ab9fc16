"""The slime integration against a real loopback HTTP server speaking SGLang's native /generate.

The server (``slime_server.SGLangServer``) runs turnrl's embedded engine on the tiny Qwen3 here;
``test_integration_vllm`` backs it with a real vLLM server. slime's ``Sample`` is the real class
when slime is importable (it is not on PyPI: install it from its repository, or put its source on
PYTHONPATH); otherwise ``slime_server.ContractSample``, the same fields and ``Status`` enum.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from slime_server import Sample, SGLangServer
from slime_server import slime_sampling as sampling_params

from turnrl.engines.hf import HFEngine
from turnrl.engines.sglang import SGLangEngine
from turnrl.integrations.agent_settings import (
    SettingsError,
    chat_encoder,
    env_factory,
    load_settings,
    trainer_limits,
    turn_max_tokens,
)
from turnrl.integrations.slime import close_engines, fill, generate, status_name
from turnrl.models import load_model
from turnrl.rollout.loop import RolloutSpec, run_trajectory
from turnrl.types import Limits, SamplingParams, StopReason, Trajectory
from turnrl.types import Sample as TurnrlSample

ODD = list(range(1, 151_700, 2))  # slime's --rollout-stop-token-ids here: turns end after a few tokens


@pytest.fixture(scope="module")
def server(tiny_qwen3_dir: Path, qwen3_tokenizer: Any) -> Iterator[SGLangServer]:
    engine = HFEngine(load_model(str(tiny_qwen3_dir)), qwen3_tokenizer, max_batch_size=4)
    srv = SGLangServer(engine, qwen3_tokenizer)
    yield srv
    srv.close()


@pytest.fixture
async def closing() -> Any:
    yield
    await close_engines()


@pytest.fixture(scope="module")
def turnrl_yaml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("turnrl") / "echo.yaml"
    path.write_text(
        "model: tiny-qwen3\n"  # model, data, engine, rollout: slime's business, ignored here
        "env: {name: 'turnrl.testing:EchoEnv', kwargs: {done_after: 3, reward: 1.0}}\n"
        "chat: {template_kwargs: {enable_thinking: false}}\n"
        "limits: {max_turns: 4}\n"
        "rollout: {n: 8}\n"
    )
    return path


def slime_args(server: SGLangServer, tiny_qwen3_dir: Path, turnrl_yaml: Path, **more: Any) -> Any:
    """What slime's parser gives (the turnrl_* keys come from --custom-config-path)."""
    return SimpleNamespace(
        sglang_router_ip="127.0.0.1",
        sglang_router_port=server.port,
        hf_checkpoint=str(tiny_qwen3_dir),
        rollout_max_context_len=None,
        turnrl_config=str(turnrl_yaml),
        turnrl=more.pop("turnrl", None),
        **more,
    )


def slime_sampling(
    max_new_tokens: int, seed: int | None = 11, stop: list[int] | None = ODD
) -> dict[str, Any]:
    """slime's sampling params, with this module's stop ids."""
    return sampling_params(max_new_tokens, seed, stop)


async def turnrl_itself(
    server: SGLangServer, tokenizer: Any, sample: TurnrlSample, index: int, env: Any, budget: int, turns: int
) -> Trajectory:
    """The same episode run by turnrl alone, through its own SGLangEngine on the same server."""
    engine = SGLangEngine(f"http://127.0.0.1:{server.port}", eos_token_ids=[tokenizer.eos_token_id])
    spec = RolloutSpec(
        env_factory=env_factory(load_settings(), env),
        engine=engine,
        encoder=chat_encoder(tokenizer, {"enable_thinking": False}),
        sampling=SamplingParams(max_tokens=budget, stop_token_ids=tuple(ODD), seed=11),
        limits=Limits(max_turns=turns, max_context_tokens=2**62, max_response_tokens=budget),
        rewards=load_settings().reward_routing(),
    )
    try:
        return await run_trajectory(sample, spec, index)
    finally:
        await engine.close()


async def test_multi_turn_samples_equal_turnrls_own_trajectories(
    server: SGLangServer, tiny_qwen3_dir: Path, turnrl_yaml: Path, qwen3_tokenizer: Any, closing: Any
) -> None:
    args = slime_args(server, tiny_qwen3_dir, turnrl_yaml)
    echo = Sample(group_index=4, index=17, prompt=[{"role": "user", "content": "Tell a story."}])
    game = Sample(
        group_index=5,
        index=20,
        prompt=[{"role": "user", "content": "Guess my number from 1 to 5, in brackets."}],
        label="3",
        metadata={"seed": 3, "turnrl_env": {"name": "guess_number", "kwargs": {"hi": 5}}},
    )
    budget = 160
    for sample, env, want_source in ((echo, None, "step"), (game, game.metadata["turnrl_env"], "env")):
        start = len(server.requests)
        out = await generate(args, sample, slime_sampling(budget))
        assert out is sample
        mine = TurnrlSample(
            str(sample.group_index), sample.prompt, metadata={**sample.metadata, "label": sample.label}
        )
        env = env or {"name": "turnrl.testing:EchoEnv", "kwargs": {"done_after": 3, "reward": 1.0}}
        ref = await turnrl_itself(server, qwen3_tokenizer, mine, sample.index, env, budget, 4)
        turns = sample.metadata["turnrl"]["num_turns"]
        assert turns >= 2 and turns == ref.num_turns
        assert sample.tokens == ref.prompt_ids + ref.response_ids
        assert (
            sample.response_length
            == len(ref.response_ids)
            == len(sample.loss_mask)
            == len(sample.rollout_log_probs)
        )
        assert sample.loss_mask == ref.loss_mask and sample.rollout_log_probs == ref.rollout_logprobs
        assert 0 in sample.loss_mask and 1 in sample.loss_mask
        assert sample.response == qwen3_tokenizer.decode(ref.response_ids)
        assert sample.weight_versions == ["7"] * turns
        requests = server.requests[start : start + turns]
        assert [r["sampling_params"]["sampling_seed"] for r in requests] == [
            r["sampling_params"]["sampling_seed"] for r in server.requests[start + turns : start + 2 * turns]
        ]  # slime's seed became turnrl's per-turn seeds, exactly as turnrl seeds them itself
        assert len({r["sampling_params"]["sampling_seed"] for r in requests}) == turns
        prompt = len(ref.prompt_ids)
        for r in requests:  # the whole budget, minus what the response already holds
            assert r["sampling_params"]["max_new_tokens"] == budget - (len(r["input_ids"]) - prompt)
            assert r["sampling_params"]["spaces_between_special_tokens"] is False  # passed through
        stop = StopReason(sample.metadata["turnrl"]["stop_reason"])
        if want_source == "step":  # EchoEnv: done at its 3rd step with reward 1.0
            assert stop == StopReason.ENV_DONE and sample.status == Sample.Status.COMPLETED
            assert turns == 3 and sample.reward == 1.0
        else:  # the game scores itself: 0.9 ** (guesses - 1) when found, else 0
            assert sample.reward == ref.reward == (0.9 ** (turns - 1) if stop == StopReason.ENV_DONE else 0.0)
            assert sample.status == (
                Sample.Status.COMPLETED if stop == StopReason.ENV_DONE else Sample.Status.TRUNCATED
            )


@pytest.fixture(scope="module")
def vlm_server() -> Iterator[SGLangServer]:
    """The SGLang-schema server on the tiny Qwen2-VL (embedded engine), taking ``image_data``."""
    from turnrl.app import hf_engine

    engine = hf_engine("tiny-qwen2-vl", seed=0)
    srv = SGLangServer(engine, engine.tokenizer)
    yield srv
    srv.close()


async def test_vlm_samples_carry_every_image_and_the_inputs_slime_trains_on(
    vlm_server: SGLangServer, closing: Any
) -> None:
    """FrozenLake: a board image in every observation, plus one image of slime's own at the
    prompt's ``<image>``; the sample equals turnrl's own trajectory of the same episode."""
    from PIL import Image

    from turnrl.env.builtin.frozen_lake import FrozenLakeEnv
    from turnrl.integrations.slime import with_image_parts
    from turnrl.models import load_vision_processor, resolve_model

    folder = resolve_model("tiny-qwen2-vl").path
    row = FrozenLakeEnv.dataset(size=1, seed=0)[0]
    picture = Image.new("RGB", (56, 56), (200, 30, 30))
    prompt = [dict(m) for m in row["prompt"]]
    prompt[-1]["content"] = "<image>\n" + prompt[-1]["content"]
    fields = {k: v for k, v in row.items() if k not in ("id", "prompt")}
    sample = Sample(
        group_index=0, index=2, prompt=prompt, metadata=fields, multimodal_inputs={"images": [picture]}
    )
    env = {"name": "frozen_lake"}
    args = SimpleNamespace(
        sglang_router_ip="127.0.0.1",
        sglang_router_port=vlm_server.port,
        hf_checkpoint=folder,
        rollout_max_context_len=None,
        turnrl_config=None,
        turnrl={"env": env, "limits": {"max_turns": 3}},
    )
    seven = list(range(0, 151_000, 7))  # the random model's turns end at every 7th id
    start = len(vlm_server.requests)
    await generate(args, sample, slime_sampling(400, seed=5, stop=seven))

    tokenizer = vlm_server.tokenizer
    vision = load_vision_processor(folder, tokenizer)
    assert vision is not None
    messages = with_image_parts(prompt, [picture])
    engine = SGLangEngine(f"http://127.0.0.1:{vlm_server.port}", eos_token_ids=[tokenizer.eos_token_id])
    spec = RolloutSpec(
        env_factory=env_factory(load_settings(), env),
        engine=engine,
        encoder=chat_encoder(tokenizer, {}, vision),
        sampling=SamplingParams(max_tokens=400, stop_token_ids=tuple(seven), seed=5),
        limits=Limits(max_turns=3, max_context_tokens=2**62, max_response_tokens=400),
    )
    try:
        ref = await run_trajectory(TurnrlSample("0", messages, metadata=fields), spec, 2)
    finally:
        await engine.close()
    turns = sample.metadata["turnrl"]["num_turns"]
    assert turns >= 2 and turns == ref.num_turns and ref.metrics["check/ok"]
    assert sample.tokens == ref.prompt_ids + ref.response_ids and sample.loss_mask == ref.loss_mask
    assert sample.rollout_log_probs == ref.rollout_logprobs
    assert sample.multimodal_inputs is not None and sample.multimodal_train_inputs is not None
    images = sample.multimodal_inputs["images"]
    assert any(i is picture for i in images) and len(images) == len(ref.images) == 1 + turns  # + boards
    grid = sample.multimodal_train_inputs["image_grid_thw"]
    assert grid.tolist() == ref.multimodal_inputs["image_grid_thw"].tolist() and grid.shape[0] == len(images)
    pixels = sample.multimodal_train_inputs["pixel_values"]
    assert pixels.shape[0] == int(grid.prod(dim=1).sum())
    assert sample.tokens.count(vision.image_token_id) == int(grid.prod(dim=1).sum()) // vision.merge_size**2
    sent = [len(r.get("image_data") or []) for r in vlm_server.requests[start : start + turns]]
    assert sent == [2 + k for k in range(turns)]  # every turn carries every image so far


def test_slime_images_go_where_the_prompt_says_image() -> None:
    from turnrl.integrations.slime import with_image_parts

    a, b = object(), object()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "<image> vs <image>?"},
    ]
    assert with_image_parts(messages, [a, b])[1]["content"] == [
        {"type": "image", "image": a},
        {"type": "text", "text": " vs "},
        {"type": "image", "image": b},
        {"type": "text", "text": "?"},
    ]
    plain = with_image_parts([{"role": "user", "content": "What is it?"}], [a])
    assert plain[0]["content"] == [{"type": "image", "image": a}, {"type": "text", "text": "What is it?"}]
    with pytest.raises(ValueError, match="2 <image> placeholders for 1 images"):
        with_image_parts(messages, [a])
    assert messages[1]["content"] == "<image> vs <image>?"  # the caller's messages are left alone


async def test_the_response_stops_at_slimes_max_new_tokens(
    server: SGLangServer, tiny_qwen3_dir: Path, turnrl_yaml: Path, closing: Any
) -> None:
    env = {"name": "turnrl.testing:EchoEnv", "kwargs": {"reply": "More."}}  # never done
    args = slime_args(server, tiny_qwen3_dir, turnrl_yaml, turnrl={"env": env, "limits": {"max_turns": 50}})
    sample = Sample(group_index=0, index=0, prompt="Talk to me.")  # a plain string: one user message
    start = len(server.requests)
    await generate(args, sample, slime_sampling(48, seed=None))
    info = sample.metadata["turnrl"]
    assert info["stop_reason"] == "token_budget" and info["num_turns"] >= 2
    assert sample.status == Sample.Status.TRUNCATED and sample.reward is None  # nothing scored: slime's RM
    requests = server.requests[start:]
    assert len(requests) == info["num_turns"]
    prompt = len(requests[0]["input_ids"])
    assert 0 < sample.response_length <= 48 and len(sample.tokens) == prompt + sample.response_length
    for r in requests:
        assert sample.tokens[: len(r["input_ids"])] == r["input_ids"]
        assert r["sampling_params"]["max_new_tokens"] == 48 - (len(r["input_ids"]) - prompt)


async def test_an_abort_from_slime_gives_aborted_then_a_fresh_run(
    server: SGLangServer, tiny_qwen3_dir: Path, turnrl_yaml: Path, closing: Any
) -> None:
    args = slime_args(server, tiny_qwen3_dir, turnrl_yaml)
    sample = Sample(group_index=1, index=1, prompt=[{"role": "user", "content": "Write a long poem."}])
    server.received.clear()
    task = asyncio.create_task(generate(args, sample, slime_sampling(4000, stop=None)))
    assert await asyncio.to_thread(server.received.wait, 30)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as router:
        for _ in range(100):  # slime aborts every request on its servers before it updates weights
            await asyncio.sleep(0.2)
            (await router.post("/abort_request", json={"abort_all": True})).raise_for_status()
            if task.done():
                break
    await task
    assert sample.status == Sample.Status.ABORTED and sample.metadata["turnrl"]["stop_reason"] == "aborted"
    assert sample.response_length > 0 and set(sample.loss_mask) == {1}  # the tokens sampled before the abort
    prompt = sample.tokens[: len(sample.tokens) - sample.response_length]

    await generate(args, sample, slime_sampling(160))  # slime hands the aborted sample back
    assert sample.tokens[: len(prompt)] == prompt and sample.status == Sample.Status.COMPLETED
    assert sample.metadata["turnrl"]["num_turns"] == 3  # run again from the start, not continued


async def test_an_unreachable_router_fails_the_sample(
    tiny_qwen3_dir: Path, turnrl_yaml: Path, closing: Any
) -> None:
    dead = SimpleNamespace(port=1)  # nothing listens on port 1
    args = slime_args(dead, tiny_qwen3_dir, turnrl_yaml)  # type: ignore[arg-type]
    sample = Sample(group_index=2, index=2, prompt=[{"role": "user", "content": "Hello?"}])
    await generate(args, sample, slime_sampling(32))
    assert sample.metadata["turnrl"]["stop_reason"] == "engine_error"
    assert sample.status == Sample.Status.FAILED and sample.response_length == 0 and sample.reward is None
    assert sample.loss_mask == [] and sample.rollout_log_probs == [] and len(sample.tokens) > 0


@pytest.mark.parametrize("stop", list(StopReason))
def test_every_stop_reason_maps_to_a_slime_status(stop: StopReason) -> None:
    expected = {
        StopReason.ENV_DONE: "COMPLETED",
        StopReason.NO_TOOL_CALL: "COMPLETED",
        StopReason.MAX_TURNS: "TRUNCATED",
        StopReason.TOKEN_BUDGET: "TRUNCATED",
        StopReason.LENGTH: "TRUNCATED",
        StopReason.ENV_ERROR: "FAILED",
        StopReason.ENGINE_ERROR: "FAILED",
        StopReason.INTERNAL_ERROR: "FAILED",
        StopReason.AGENT_DONE: "COMPLETED",
        StopReason.AGENT_ERROR: "FAILED",
        StopReason.AGENT_TIMEOUT: "FAILED",
        StopReason.ABORTED: "ABORTED",
        StopReason.MODEL_STOP: "COMPLETED",
    }[stop]
    assert status_name(stop) == expected
    traj = Trajectory("s/0", "s", "d", stop, [1, 2], [3, 4, 5], [1, 0, 1], [-0.5, 0.0, -0.25])
    sample = Sample(index=0, prompt="x")
    fill(sample, traj, "abc", ["1"])
    assert sample.status == getattr(Sample.Status, expected)
    assert (sample.tokens, sample.response_length, sample.loss_mask) == ([1, 2, 3, 4, 5], 3, [1, 0, 1])
    assert sample.rollout_log_probs == [-0.5, 0.0, -0.25] and sample.response == "abc"


class SlimeArgs(SimpleNamespace):
    """slime's parsed arguments: the flags given, every other flag at slime's default of None."""

    def __getattr__(self, name: str) -> Any:
        return None


async def test_slimes_own_rollout_calls_turnrl_through_the_custom_generate_path(
    server: SGLangServer, tiny_qwen3_dir: Path, turnrl_yaml: Path, closing: Any
) -> None:
    rollout = pytest.importorskip(
        "slime.rollout.sglang_rollout", reason="slime (not on PyPI) is not installed"
    )
    args = SlimeArgs(
        hf_checkpoint=str(tiny_qwen3_dir),
        sglang_router_ip="127.0.0.1",
        sglang_router_port=server.port,
        sglang_server_concurrency=8,
        rollout_num_engines=1,
        sglang_dp_size=1,
        n_samples_per_prompt=2,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        rollout_top_k=-1,
        rollout_max_response_len=160,
        rollout_stop_token_ids=ODD,
        rollout_skip_special_tokens=False,
        custom_generate_function_path="turnrl.integrations.slime.generate",
        turnrl_config=str(turnrl_yaml),
    )
    state = rollout.GenerateState(args)
    group = [Sample(group_index=9, index=i, prompt=[{"role": "user", "content": "Hi."}]) for i in range(2)]
    out = await rollout.generate_and_rm_group(args, group, sampling_params=state.sampling_params.copy())
    for sample in out:
        assert sample.status == Sample.Status.COMPLETED and sample.reward == 1.0  # slime's RM not needed
        assert sample.metadata["turnrl"]["num_turns"] == 3 and sample.session_id is not None
        sample._validate_response_metadata_lengths()  # slime's own check of the lengths


def test_settings_take_the_trainers_budget_and_only_tighten_it(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        "model: smollm2-135m\nenv: {name: guess_number}\ntrain: {steps: 3}\n"
        "sampling: {temperature: 0.2}\nlimits: {max_turns: 3, max_context_tokens: 1024}\n"
    )
    settings = load_settings(config)
    assert settings.env is not None and settings.env.name == "guess_number"
    limits = trainer_limits(settings, max_response_tokens=512, max_context_tokens=8192)
    assert (limits.max_turns, limits.max_response_tokens, limits.max_context_tokens) == (3, 512, 1024)
    assert turn_max_tokens(settings, 512) == 512  # the config sets no per-turn cap
    loose = load_settings(config, {"limits": {"max_context_tokens": 100_000, "max_response_tokens": 64}})
    limits = trainer_limits(loose, max_response_tokens=512, max_context_tokens=8192)
    assert (limits.max_turns, limits.max_response_tokens, limits.max_context_tokens) == (3, 64, 8192)
    capped = load_settings(config, {"sampling": {"max_tokens": 32}})
    assert turn_max_tokens(capped, 512) == 32 and turn_max_tokens(capped, 20) == 20
    with pytest.raises(SettingsError, match=r"limits\.max_turnz"):
        load_settings(config, {"limits": {"max_turnz": 2}})
    with pytest.raises(SettingsError, match="no env"):
        env_factory(load_settings(None, {}), None)


async def test_turnrl_sglang_engine_aborts_its_requests_even_those_still_on_their_way(
    server: SGLangServer, qwen3_tokenizer: Any
) -> None:
    """``SGLangEngine.abort_all`` on the loopback SGLang server, right after six requests went out
    (more than the engine's batch of 4), each reaching the engine 1 s after it arrives (SGLang
    tokenizes it first): an abort for a rid not registered yet is dropped, as SGLang drops it, so
    it goes out again; every request returns "abort" long before its 4000 tokens, and
    ``abort_all`` returns only once they all have."""
    engine = SGLangEngine(f"http://127.0.0.1:{server.port}", eos_token_ids=[qwen3_tokenizer.eos_token_id])
    prompt = qwen3_tokenizer.encode("Write a long poem.")
    sampling = SamplingParams(temperature=1.0, max_tokens=4000)
    server.register_s = 1.0
    try:
        tasks = [asyncio.create_task(engine.generate(prompt, sampling)) for _ in range(6)]
        while engine.in_flight < 6:
            await asyncio.sleep(0.001)
        await asyncio.wait_for(engine.abort_all(), 60)
        assert all(task.done() for task in tasks) and engine.in_flight == 0
        gens = [task.result() for task in tasks]
        assert [g.finish_reason for g in gens] == ["abort"] * 6
        assert all(len(g.token_ids) < 4000 for g in gens)
    finally:
        server.register_s = 0.0
        await engine.close()
