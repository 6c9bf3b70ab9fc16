"""A vision-language model on a real vLLM server (the CPU build, scripts/install_vllm.sh).

turnrl starts one server for the tiny Qwen2-VL (the managed path of ``engine.kind: vllm``, which
enables vLLM's token-in generate endpoint for a VLM). Every turn with images sends token ids plus
the images; vLLM expands the image tokens itself and reports the prompt it conditioned on, which
must equal turnrl's. Without the vLLM environment these tests skip locally and fail in CI.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from test_vision import STOPS, PictureEnv, picture
from vllm_helpers import TOLERANCE, need_vllm

from turnrl.chat.encoder import ChatEncoder
from turnrl.config import VLLMEngineConfig, load_config
from turnrl.data import sample_from_row
from turnrl.engines.http import RequestError
from turnrl.engines.vllm import VLLMServerEngine, one_token_per_image, vision_payload
from turnrl.env.builtin.zoom import ZoomEnv
from turnrl.models import load_model, load_tokenizer, load_vision_processor, resolve_model
from turnrl.rollout.loop import RolloutSpec, run_trajectory
from turnrl.types import Limits, Sample, SamplingParams, StopReason, Trajectory
from turnrl.vision import VisionProcessor

MODEL = "tiny-qwen2-vl"
PAD = 151655  # <|image_pad|>


@pytest.fixture(scope="module")
def vlm() -> tuple[Any, VisionProcessor]:
    tokenizer = load_tokenizer(MODEL)
    vision = load_vision_processor(MODEL, tokenizer)
    assert vision is not None and vision.image_token_id == PAD
    return tokenizer, vision


@pytest.fixture(scope="module")
def vlm_url(vlm: tuple[Any, VisionProcessor], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One vLLM server for the tiny Qwen2-VL, started by turnrl."""
    need_vllm()
    from turnrl.app.engines import vllm_engine

    config = VLLMEngineConfig(kind="vllm", servers=1, max_model_len=4096, kv_cache_gib=1)
    managed = vllm_engine(MODEL, config, vlm[0], log_dir=tmp_path_factory.mktemp("vllm-vlm"))
    assert "--enable-scale-out" in managed.servers[0].command()
    yield managed.servers[0].url
    asyncio.run(managed.close())


def client(url: str, vlm: tuple[Any, VisionProcessor], **kwargs: Any) -> VLLMServerEngine:
    tokenizer, vision = vlm
    kwargs.setdefault("refresh_tied_weights", True)  # the server is turnrl's: it has the extension
    return VLLMServerEngine(
        url, eos_token_ids=[tokenizer.eos_token_id], image_token_id=vision.image_token_id, **kwargs
    )


def vlm_logprobs(model: Any, ids: list[int], mm: dict[str, Any], start: int) -> torch.Tensor:
    """Logprobs of ``ids[start:]`` from one transformers forward pass with all the images."""
    tensor = torch.tensor([ids])
    with torch.no_grad():
        logits = model(
            input_ids=tensor,
            pixel_values=mm["pixel_values"],
            image_grid_thw=mm["image_grid_thw"],
            mm_token_type_ids=(tensor == PAD).int(),
        ).logits[0]
    logprobs = torch.log_softmax(logits.float(), -1)[start - 1 : -1]
    return logprobs.gather(1, torch.tensor(ids[start:])[:, None])[:, 0]


def max_gap(
    model: Any, ids: list[int], mm: dict[str, Any], start: int, mask: list[int], got: list[float]
) -> float:
    """The largest gap between recorded logprobs of model tokens (mask 1) and a forward pass."""
    gap = (vlm_logprobs(model, ids, mm, start) - torch.tensor(got)).abs()
    return float(gap[torch.tensor(mask) == 1].max())


# ---- no server needed ------------------------------------------------------------------------


def test_the_prompt_goes_with_one_image_token_per_image(vlm: tuple[Any, VisionProcessor]) -> None:
    _, vision = vlm
    images = vision.features([picture(0), picture(3)]).images
    a, b = images[0].num_tokens, images[1].num_tokens
    assert a != b
    ids = [1, 151652, *[PAD] * a, 151653, 2, 151652, *[PAD] * b, 151653]
    assert one_token_per_image(ids, images, PAD) == [1, 151652, PAD, 151653, 2, 151652, PAD, 151653]
    body = vision_payload(
        ids, SamplingParams(max_tokens=5, seed=7, stop_token_ids=(9,)), images, PAD, {"min_p": 0.1}, None
    )
    assert body["content_parts"] == [{"type": "image_url", "url": image.data_url} for image in images]
    assert body["content_parts"][0]["url"].startswith("data:image/png;base64,")
    params = body["sampling_params"]
    assert (params["max_tokens"], params["seed"], params["stop_token_ids"], params["min_p"]) == (
        5,
        7,
        [9],
        0.1,
    )
    assert body["return_token_ids"] and body["stream"] and params["logprobs"] == 0
    urls = [image.data_url for image in images]  # images that do not know their run take the whole run
    assert one_token_per_image(ids, urls, PAD) == [1, 151652, PAD, 151653, 2, 151652, PAD, 151653]
    for bad, why in [
        ([1, *[PAD] * (a - 1), 2, *[PAD] * b], "image 0 needs a run of"),
        ([1, *[PAD] * a, 2], "1 image-token run"),
        ([*[PAD] * a, *[PAD] * b, PAD], "more image-token runs"),
    ]:
        with pytest.raises(RequestError, match=why):
            one_token_per_image(bad, images, PAD)


async def test_a_prompt_vllm_expanded_differently_is_refused(vlm: tuple[Any, VisionProcessor]) -> None:
    engine = client("http://127.0.0.1:9", vlm)
    engine._check_prompt([1, PAD, PAD, 2], [1, PAD, PAD, 2])
    with pytest.raises(RequestError, match="differs from turnrl's at token 3"):
        engine._check_prompt([1, PAD, PAD, 2], [1, PAD, PAD, PAD, 2])
    with pytest.raises(RequestError, match="image token id"):
        await VLLMServerEngine("http://127.0.0.1:9").generate([1, PAD], SamplingParams(), [picture(0)])
    await engine.close()


# ---- one real server -------------------------------------------------------------------------


async def play_pictures(
    engine: VLLMServerEngine, vlm: tuple[Any, VisionProcessor], n: int
) -> list[Trajectory]:
    """``n`` games of PictureEnv, 4 turns each: a picture in the prompt, two in every observation."""
    tokenizer, vision = vlm
    spec = RolloutSpec(
        env_factory=PictureEnv,
        engine=engine,
        encoder=ChatEncoder(tokenizer, vision=vision),
        # the random model rarely samples <|im_end|>: every 7th token id ends its turn too
        sampling=SamplingParams(temperature=1.0, max_tokens=40, seed=3, stop_token_ids=STOPS),
        limits=Limits(max_turns=4, max_context_tokens=4096),
    )
    return list(await asyncio.gather(*(run_trajectory(Sample(f"p{k}", [], seed=k), spec) for k in range(n))))


def assert_exact(trajs: list[Trajectory], model: Any) -> None:
    """Every image went with every turn, and every model token's logprob equals a forward pass over
    the whole trained sequence with all its images."""
    for traj in trajs:
        assert traj.error is None and traj.metrics["check/ok"], traj.info.get("check")
        assert traj.stop_reason == StopReason.MAX_TURNS and traj.num_turns == 4
        assert len(traj.images) == 1 + 2 * 3
        mm, start = traj.multimodal_inputs, len(traj.prompt_ids)
        assert max_gap(model, traj.input_ids, mm, start, traj.loss_mask, traj.rollout_logprobs) < TOLERANCE


async def test_vlm_turns_through_vllm_are_exact(
    vlm_url: str, vlm: tuple[Any, VisionProcessor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each turn sends every image so far; the prompt vLLM conditioned on equals turnrl's."""
    engine = client(vlm_url, vlm)
    checked: list[int] = []
    check = engine._check_prompt
    monkeypatch.setattr(engine, "_check_prompt", lambda a, b: (checked.append(len(b)), check(a, b)))
    trajs = await play_pictures(engine, vlm, 3)
    await engine.close()
    assert_exact(trajs, load_model(MODEL))
    assert len(checked) == 3 * 4  # every turn's prompt compared with vLLM's


async def test_vlm_weights_update_in_place_exactly(vlm_url: str, vlm: tuple[Any, VisionProcessor]) -> None:
    """A VLM's state dict (vision tower included) pushed to the server the way ``turnrl train`` does:
    its tokens carry the new version and their logprobs are the new weights' (then the old come back).
    The embedding is tied to the output layer, whose packed copy the server must refresh."""
    model = load_model(MODEL)
    old = {k: v.clone() for k, v in model.state_dict().items()}
    engine = client(vlm_url, vlm)
    try:
        scaled = (".mlp.", "embed_tokens", "lm_head")  # both towers' MLPs, the tied embedding
        new = {k: v * 1.5 if any(part in k for part in scaled) else v for k, v in old.items()}
        new["lm_head.weight"] = new["model.language_model.embed_tokens.weight"]  # tied: written once
        model.load_state_dict(new)
        assert await engine.update_weights(new) == 1
        trajs = await play_pictures(engine, vlm, 2)
        assert_exact(trajs, model)
        assert all(set(traj.policy_versions) == {1, -1} for traj in trajs)  # -1: env tokens
    finally:
        await engine.update_weights(old)
        await engine.close()


async def test_images_in_tool_results_through_vllm(vlm_url: str, vlm: tuple[Any, VisionProcessor]) -> None:
    """vLLM's structured outputs make the random model call the zoom tool every turn; each call
    answers with a crop, which the next turn sends to vLLM with the page itself."""
    tokenizer, vision = vlm
    call = r'<tool_call>\n\{"name": "zoom", "arguments": \{"cell": "(A1|B2|C3)"\}\}\n</tool_call>'
    engine = client(vlm_url, vlm, request_params={"structured_outputs": {"regex": call}})
    spec = RolloutSpec(
        env_factory=ZoomEnv,
        engine=engine,
        encoder=ChatEncoder(tokenizer, vision=vision),
        sampling=SamplingParams(temperature=1.0, max_tokens=80, seed=0),
        limits=Limits(max_turns=3, max_context_tokens=4096),
    )
    rows = ZoomEnv.dataset(size=2, seed=0)
    trajs = await asyncio.gather(
        *(run_trajectory(sample_from_row(row, k), spec) for k, row in enumerate(rows))
    )
    await engine.close()
    for traj in trajs:
        assert traj.error is None and traj.metrics["check/ok"], traj.info.get("check")
        assert [t.role for t in traj.turns] == ["assistant", "tool"] * 2 + ["assistant"]
        # every turn calls (the last call is cut by max_turns); the page, then two crops
        assert traj.info["num_tool_calls"] == 3 and len(traj.images) == 3
        for turn in traj.turns:
            assert set(traj.loss_mask[turn.start : turn.end]) == {1 if turn.role == "assistant" else 0}
            if turn.role == "tool":
                assert vision.image_token_id in traj.response_ids[turn.start : turn.end]


async def test_an_aborted_turn_with_images_keeps_its_tokens_and_goes_on(
    vlm_url: str, vlm: tuple[Any, VisionProcessor]
) -> None:
    """Partial rollout with images: the abort returns the tokens so far; the turn continues from
    them (prompt plus kept tokens, the same images) and vLLM conditions on exactly that."""
    tokenizer, vision = vlm
    images = vision.features([picture(2)]).images
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    prompt = vision.expand(list(text), images)
    engine = client(vlm_url, vlm)
    turn = asyncio.create_task(engine.generate(prompt, SamplingParams(max_tokens=2000, seed=5), images))
    while engine.tokens_received < 10:
        await asyncio.sleep(0.02)
    await engine.abort_all()
    cut = await asyncio.wait_for(turn, timeout=60)
    assert cut.finish_reason == "abort" and 10 <= len(cut.token_ids) < 2000
    assert len(cut.logprobs) == len(cut.token_ids)
    rest = await engine.generate(prompt + cut.token_ids, SamplingParams(max_tokens=8, seed=5), images)
    assert rest.finish_reason in ("length", "stop") and 1 <= len(rest.token_ids) <= 8
    await engine.close()


async def test_a_vlm_example_runs_on_vllm_from_its_config(vlm_url: str, tmp_path: Path) -> None:
    """The FrozenLake VLM example with ``engine.kind: vllm``: the image token comes from the model."""
    from turnrl.app.run import prepare
    from turnrl.rollout.collector import collect

    root = Path(__file__).resolve().parent.parent
    raw = yaml.safe_load((root / "examples" / "vlm_frozen_lake.yaml").read_text())
    raw |= {"engine": {"kind": "vllm", "urls": [vlm_url]}, "output_dir": str(tmp_path / "lake")}
    raw["model"] = str(resolve_model(MODEL).path)
    (tmp_path / "lake.yaml").write_text(yaml.safe_dump(raw))
    prepared = prepare(load_config(tmp_path / "lake.yaml"))
    trajs = await collect(prepared.samples, prepared.spec, group_size=2, concurrency=4)
    await prepared.spec.engine.close()
    assert len(trajs) == 4
    for traj in trajs:
        assert traj.error is None and traj.metrics["check/ok"], traj.info.get("check")
        assert len(traj.images) >= 1 and traj.stop_reason is not None


async def test_grpo_steps_on_a_vlm_with_vllm_rollouts_sync_the_weights_exactly(
    vlm_url: str, vlm: tuple[Any, VisionProcessor], tmp_path: Path
) -> None:
    """``turnrl train``'s step with a VLM rolled out on vLLM: after each update the whole policy
    (vision tower included) reaches the server, so the next step's rollout logprobs equal the
    trainer's (ratio 1) and no token carries a stale version."""
    from test_train_vlm import QUIET

    from turnrl.app.training import build_run
    from turnrl.train.config import TrainConfig
    from turnrl.train.trainer import train_step

    cfg = TrainConfig.model_validate(
        {
            "model": str(resolve_model(MODEL).path),
            "env": {"name": "test_shades"},  # a picture in the prompt and in each observation
            # a server turnrl started: it has the worker extension that refreshes the tied output layer
            "engine": {"kind": "vllm", "urls": [vlm_url], "refresh_tied_weights": True},
            "sampling": {"temperature": 1.0, "max_tokens": 24, "stop_token_ids": list(STOPS)},
            "limits": {"max_turns": 3, "max_context_tokens": 1024},
            "optim": {"lr": 1e-3},
            "rollout": {"group_size": 4},
            "algorithm": {"kl_coef": 0.001},  # every sample trains, even when rewards tie
            "train": {"steps": 2, "prompts_per_step": 2, "plot": False},
            "output_dir": str(tmp_path / "run"),
        }
    )
    run = build_run(cfg, overwrite=False, resume=False, console=QUIET)
    base = {k: v.clone() for k, v in run.policy.state_dict().items()}
    try:
        steps = [await train_step(run, step) for step in (1, 2)]
        after = run.policy.state_dict()
    finally:
        reset = client(vlm_url, vlm)  # leave the base weights for the tests after this one
        await reset.update_weights(base)
        await reset.close()
        await run.engine.close()
    for metrics in steps:
        assert metrics["turns/mean"] > 1.5 and metrics["train/samples"] > 0
        assert metrics["train/refused_versions"] == 0
        assert 0.999 < metrics["is/ratio_min"] <= metrics["is/ratio_max"] < 1.001, metrics
    changed = [k for k in base if not torch.equal(base[k], after[k])]
    assert any("visual" in k for k in changed) and any("language_model" in k for k in changed)
    assert run.engine.weight_version == 2


async def test_slimes_generate_with_images_on_an_sglang_endpoint_backed_by_vllm(
    vlm_url: str, vlm: tuple[Any, VisionProcessor]
) -> None:
    """slime's custom generate path on FrozenLake: slime's own image at the prompt's ``<image>`` and
    a board per observation reach vLLM (as SGLang's ``image_data``) with every turn; the logprobs
    slime trains with equal a forward pass over its sample's tokens and image inputs."""
    from types import SimpleNamespace

    from slime_server import Sample, SGLangServer, slime_sampling

    from turnrl.env.builtin.frozen_lake import FrozenLakeEnv
    from turnrl.integrations.slime import close_engines, generate

    server = SGLangServer(client(vlm_url, vlm), vlm[0], weight_version="2")
    samples = []
    for i, row in enumerate(FrozenLakeEnv.dataset(size=3, seed=0)):
        prompt = [dict(m) for m in row["prompt"]]
        prompt[-1]["content"] = "<image>\n" + prompt[-1]["content"]
        fields = {k: v for k, v in row.items() if k not in ("id", "prompt")}
        images = {"images": [picture(i)]}
        samples.append(
            Sample(group_index=i, index=i, prompt=prompt, metadata=fields, multimodal_inputs=images)
        )
    args = SimpleNamespace(
        sglang_router_ip="127.0.0.1",
        sglang_router_port=server.port,
        hf_checkpoint=str(resolve_model(MODEL).path),
        rollout_max_context_len=None,
        turnrl_config=None,
        turnrl={"env": {"name": "frozen_lake"}, "limits": {"max_turns": 3}},
    )
    try:
        await asyncio.gather(
            *(generate(args, s, slime_sampling(400, seed=5 + s.index, stop=list(STOPS))) for s in samples)
        )
    finally:
        await close_engines()
        await asyncio.to_thread(server.close)
    model = load_model(MODEL)
    for sample in samples:
        turns = sample.metadata["turnrl"]["num_turns"]
        assert (
            turns >= 2 and len(sample.multimodal_inputs["images"]) == 1 + turns
        )  # + a board per observation
        start = len(sample.tokens) - sample.response_length
        mm = sample.multimodal_train_inputs
        gap = max_gap(model, sample.tokens, mm, start, sample.loss_mask, sample.rollout_log_probs)
        assert gap < TOLERANCE and sample.weight_versions == ["2"] * turns
    sent = [len(r.get("image_data") or []) for r in server.requests]
    assert max(sent) >= 2 and min(sent) >= 1  # every turn carries the images so far


async def test_verls_agent_loop_sends_images_to_vllm_through_verls_own_client(
    vlm_url: str, vlm: tuple[Any, VisionProcessor], ray_cluster: str, tmp_path: Path
) -> None:
    """turnrl's agent loop inside verl, its requests going through verl's ``LLMServerClient`` and
    balancer to a ``VLLMServerHandle`` that knows the image token: FrozenLake with an image in the
    raw prompt and a board per observation; verl gets every image in ``multi_modal_data`` and
    logprobs that equal a forward pass over its output with them."""
    from types import SimpleNamespace

    import ray
    from test_integration_verl import SAMPLING, instantiate
    from test_integration_vllm import verl_config

    from turnrl.env.builtin.frozen_lake import FrozenLakeEnv
    from turnrl.integrations.verl_servers import server_client, server_handles

    tokenizer, vision = vlm
    config = verl_config(str(resolve_model(MODEL).path), tmp_path)
    handles = server_handles([vlm_url], eos_token_ids=[tokenizer.eos_token_id], image_token_id=PAD)
    processor = SimpleNamespace(image_processor=vision.image_processor)  # the part turnrl reads
    loop = instantiate(
        config,
        server_client(config, handles),
        tokenizer,
        processor,
        "qwen2_vl",
        turnrl={"env": {"name": "frozen_lake"}, "limits": {"max_turns": 3}},
    )
    row = FrozenLakeEnv.dataset(size=1, seed=1)[0]
    prompt = [dict(m) for m in row["prompt"]]
    prompt[-1]["content"] = [
        {"type": "image", "image": picture(4)},
        {"type": "text", "text": prompt[-1]["content"]},
    ]
    fields = {k: v for k, v in row.items() if k not in ("id", "prompt")}
    try:
        sampling = dict(SAMPLING, stop_token_ids=list(STOPS))  # the random model's turns end early
        output = await loop.run(sampling, raw_prompt=prompt, extra_info=fields)
    finally:
        for handle in handles.values():
            ray.get(handle.close.remote())
    traj = loop.trajectory
    assert traj is not None and traj.error is None and traj.num_turns >= 2 and traj.metrics["check/ok"]
    assert output.multi_modal_data is not None and output.multi_modal_data["images"] == traj.images
    assert len(traj.images) == 1 + traj.num_turns  # the prompt's image, then a board per observation
    assert output.prompt_ids + output.response_ids == traj.input_ids
    mm, start = traj.multimodal_inputs, len(output.prompt_ids)
    gap = max_gap(
        load_model(MODEL), traj.input_ids, mm, start, output.response_mask, output.response_logprobs
    )
    assert gap < TOLERANCE
