"""VLM rollouts with exact tokens: images in prompts, observations and tool results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image, ImageDraw

from turnrl.app import hf_engine
from turnrl.chat.encoder import ChatEncoder, NoVisionError
from turnrl.engines.hf import HFEngine
from turnrl.engines.scripted import ScriptedEngine
from turnrl.engines.sglang import generate_payload
from turnrl.env.base import Env
from turnrl.env.tool_env import ToolEnv
from turnrl.models import load_tokenizer, load_vision_processor, resolve_model
from turnrl.record.codec import trajectory_from_json, trajectory_to_json
from turnrl.rollout.loop import RolloutSpec, run_trajectory
from turnrl.tools.function import tool
from turnrl.train.batch import build_samples
from turnrl.types import (
    EngineError,
    Limits,
    Message,
    Sample,
    SamplingParams,
    StepResult,
    StopReason,
    Trajectory,
)
from turnrl.vision import ImageTokenError, MultimodalBuffer, VisionProcessor
from turnrl.vision.processor import image_only_processor

KINDS = ("tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl")
# The random models rarely sample eos: every 7th token id also ends a turn, so turns are short.
STOPS = tuple(range(0, 151000, 7))


def picture(i: int) -> Image.Image:
    """A small picture whose size changes with ``i`` (so images take different token counts)."""
    image = Image.new("RGB", (56 + 14 * i, 42 + 7 * (i % 3)), (40 * i % 255, 90, 160))
    ImageDraw.Draw(image).rectangle((2, 2, 10 + i, 12), fill=(255, 255, 0))
    return image


class PictureEnv(Env):
    """Starts with one picture; every observation is text, a picture, text and another picture."""

    async def reset(self) -> list[Message]:
        self.turn = 0
        return [{"role": "user", "content": [{"type": "text", "text": "What changes?"}, picture_part(0)]}]

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        return StepResult(self.turn, 0.0, False)

    def format_observation(self, observation: Any) -> list[Message]:
        n = int(observation)
        parts = [{"type": "text", "text": f"Turn {n}:"}, picture_part(n), {"type": "text", "text": " and "}]
        return [{"role": "user", "content": [*parts, picture_part(n + 4)]}]


def picture_part(i: int) -> dict[str, Any]:
    return {"type": "image", "image": picture(i)}


@pytest.fixture(scope="module")
def vlm_dirs() -> dict[str, Path]:
    return {kind: Path(resolve_model(kind).path) for kind in KINDS}


@pytest.fixture(scope="module")
def qwen2vl(vlm_dirs: dict[str, Path]) -> tuple[Any, VisionProcessor]:
    tokenizer = load_tokenizer(str(vlm_dirs["tiny-qwen2-vl"]))
    vision = load_vision_processor(str(vlm_dirs["tiny-qwen2-vl"]), tokenizer)
    assert vision is not None
    return tokenizer, vision


def spec_for(
    env: Any, engine: Any, encoder: ChatEncoder, max_turns: int = 4, context: int = 4096
) -> RolloutSpec:
    stops = STOPS if isinstance(engine, HFEngine) else ()  # scripted replies end where they say
    return RolloutSpec(
        env_factory=env,
        engine=engine,
        encoder=encoder,
        sampling=SamplingParams(temperature=1.0, max_tokens=40, seed=3, stop_token_ids=stops),
        limits=Limits(max_turns=max_turns, max_context_tokens=context),
    )


def full_encoding(tokenizer: Any, vision: VisionProcessor, traj: Trajectory, tools: Any = None) -> Any:
    """The processor's one-call encoding of the final conversation with all its images."""
    messages = [{k: v for k, v in m.items() if k != "tool_calls"} for m in traj.messages]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=False)
    return image_only_processor(vision, tokenizer)(text=[text], images=traj.images, return_tensors="pt")


async def test_trajectory_tokens_equal_the_processors_full_encoding(
    qwen2vl: tuple[Any, VisionProcessor],
) -> None:
    tokenizer, vision = qwen2vl
    replies = [f"I see picture {i}.<|im_end|>" for i in range(4)]
    engine = ScriptedEngine(tokenizer, replies)
    traj = await run_trajectory(
        Sample("p", []), spec_for(PictureEnv, engine, ChatEncoder(tokenizer, vision=vision))
    )
    assert traj.stop_reason == StopReason.MAX_TURNS and traj.num_turns == 4
    assert len(traj.images) == 1 + 2 * 3  # the prompt's, then two new ones per observation
    full = full_encoding(tokenizer, vision, traj)
    reference = full["input_ids"][0].tolist()
    closing = tokenizer.encode("\n")  # the template's newline after the final <|im_end|>
    assert traj.prompt_ids + traj.response_ids + closing == reference
    assert traj.metrics["check/ok"] and traj.metrics["check/mismatches"] == 0
    assert traj.metrics["encode/slow_turns"] == 0  # image observations take the fast path
    # the engine saw the images so far at every turn, growing turn by turn
    assert [len(call.images) for call in engine.calls] == [1, 3, 5, 7]
    # merged training inputs: one processor call over all images gives the same tensors
    assert set(traj.multimodal_inputs) == {"pixel_values", "image_grid_thw"}
    for key in ("pixel_values", "image_grid_thw"):
        assert torch.equal(traj.multimodal_inputs[key], full[key])
    # model tokens are exactly the scripted ones, image tokens are env tokens
    image_id = vision.image_token_id
    assert all(m == 0 for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if t == image_id)


@pytest.mark.parametrize("kind", KINDS)
async def test_forward_pass_with_merged_inputs_reproduces_rollout_logprobs(kind: str) -> None:
    engine = hf_engine(kind, seed=0)
    try:
        assert engine.vision is not None
        encoder = ChatEncoder(engine.tokenizer, vision=engine.vision)
        traj = await run_trajectory(Sample("p", []), spec_for(PictureEnv, engine, encoder))
        assert traj.error is None and traj.num_turns >= 3, traj.stop_reason
        assert len(traj.images) == 1 + 2 * (traj.num_turns - 1)
        assert traj.metrics["check/ok"]
        ids = torch.tensor([traj.input_ids])
        mm = traj.multimodal_inputs
        with torch.no_grad():
            logits = engine.model(
                input_ids=ids,
                pixel_values=mm["pixel_values"],
                image_grid_thw=mm["image_grid_thw"],
                mm_token_type_ids=(ids == engine.vision.image_token_id).int(),
            ).logits[0]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        offset = len(traj.prompt_ids) - 1
        sampled = [i for i, m in enumerate(traj.loss_mask) if m]
        expected = torch.tensor([logprobs[offset + i, traj.response_ids[i]].item() for i in sampled])
        got = torch.tensor([traj.rollout_logprobs[i] for i in sampled])
        assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    finally:
        await engine.close()


async def test_engine_rejects_images_that_do_not_match_the_image_tokens(qwen2vl: tuple[Any, Any]) -> None:
    engine = hf_engine("tiny-qwen2-vl", seed=0)
    try:
        assert engine.vision is not None
        pad, start, end = engine.vision.image_token_id, 151652, 151653
        image = picture(1)
        need = engine.vision.features([image]).images[0].num_tokens
        sampling = SamplingParams(max_tokens=2)
        good = [1, 2, start, *[pad] * need, end, 3]
        assert len((await engine.generate(good, sampling, [image])).token_ids) >= 1
        with pytest.raises(EngineError, match=f"has {need - 1} image tokens but its 1 image"):
            await engine.generate([1, start, *[pad] * (need - 1), end], sampling, [image])
        with pytest.raises(EngineError, match=f"has {need} image tokens but its 2 image"):
            await engine.generate(good, sampling, [image, image])
        with pytest.raises(EngineError, match="has 0 image tokens"):
            await engine.generate([1, 2, 3], sampling, [image])
    finally:
        await engine.close()
    text_engine = hf_engine("tiny-qwen3")
    with pytest.raises(EngineError, match="no image processor"):
        await text_engine.generate([1, 2], SamplingParams(max_tokens=1), [picture(0)])
    await text_engine.close()


def test_encoder_errors_name_the_problem(qwen2vl: tuple[Any, VisionProcessor], qwen3_tokenizer: Any) -> None:
    tokenizer, vision = qwen2vl
    conv = ChatEncoder(tokenizer, vision=vision).conversation()
    spelled = [{"role": "user", "content": [{"type": "text", "text": "<|image_pad|>"}, picture_part(0)]}]
    # text that spells the image token stays text, in the prompt and in observations: only the
    # image part becomes image tokens
    prompt = conv.prompt(spelled)
    assert prompt.ids.count(vision.image_token_id) == prompt.images[0].num_tokens
    obs = conv.observation(spelled, None)
    assert obs.ids.count(vision.image_token_id) == obs.images[0].num_tokens
    with pytest.raises(ImageTokenError, match="2 image placeholder"):  # ids from elsewhere are checked
        vision.expand([vision.image_token_id] * 2, prompt.images)
    with pytest.raises(NoVisionError, match="no image processor"):
        ChatEncoder(qwen3_tokenizer).conversation().prompt([{"role": "user", "content": [picture_part(0)]}])
    with pytest.raises(ValueError, match="no image file"):
        conv.prompt([{"role": "user", "content": [{"type": "image", "image": "/no/such.png"}]}])


async def test_budget_overflow_appends_no_part_of_the_observation(
    qwen2vl: tuple[Any, VisionProcessor],
) -> None:
    tokenizer, vision = qwen2vl
    encoder = ChatEncoder(tokenizer, vision=vision)
    engine = ScriptedEngine(tokenizer, ["A.<|im_end|>"] * 4)
    full = await run_trajectory(Sample("p", []), spec_for(PictureEnv, engine, encoder))
    cut_at = full.turns[3].start + len(full.prompt_ids) + 2  # the 2nd observation does not fit
    engine = ScriptedEngine(tokenizer, ["A.<|im_end|>"] * 4)
    traj = await run_trajectory(Sample("p", []), spec_for(PictureEnv, engine, encoder, context=cut_at))
    assert traj.stop_reason == StopReason.TOKEN_BUDGET and traj.truncated
    assert traj.num_turns == 2 and traj.turns[-1].role == "assistant"
    assert len(traj.images) == 3  # the prompt's and the first observation's: none of the second
    assert traj.multimodal_inputs["image_grid_thw"].shape[0] == 3
    assert traj.response_ids == full.response_ids[: traj.turns[-1].end]
    assert traj.response_ids.count(vision.image_token_id) == sum(
        int(g.prod()) // 4 for g in traj.multimodal_inputs["image_grid_thw"][1:]
    )


@tool
def zoom(factor: int) -> Any:
    """Enlarge the picture.

    Args:
        factor: how many times larger
    """
    return {"text": f"zoomed x{factor}", "image": [picture(factor)]}


async def test_tool_results_with_images_on_qwen3_vl_template(vlm_dirs: dict[str, Path]) -> None:
    tokenizer = load_tokenizer(str(vlm_dirs["tiny-qwen3-vl"]))
    vision = load_vision_processor(str(vlm_dirs["tiny-qwen3-vl"]), tokenizer)
    assert vision is not None
    call = '<tool_call>\n{"name": "zoom", "arguments": {"factor": %d}}\n</tool_call><|im_end|>'
    engine = ScriptedEngine(tokenizer, [call % 2, call % 3, "It is yellow.<|im_end|>"])
    prompt = [{"role": "user", "content": [picture_part(0), {"type": "text", "text": "Which color?"}]}]

    def make_env(sample: Sample) -> ToolEnv:
        return ToolEnv(sample, [zoom])

    sample = Sample("z", prompt)
    traj = await run_trajectory(sample, spec_for(make_env, engine, ChatEncoder(tokenizer, vision=vision)))
    assert traj.stop_reason == StopReason.NO_TOOL_CALL and traj.num_turns == 3
    tool_messages = [m for m in traj.messages if m["role"] == "tool"]
    assert isinstance(tool_messages[0]["content"], list), tool_messages
    assert [p["type"] for p in tool_messages[0]["content"]] == ["image", "text"], tool_messages
    assert len(traj.images) == 3
    full = full_encoding(tokenizer, vision, traj, tools=[zoom.schema])
    assert traj.prompt_ids + traj.response_ids + tokenizer.encode("\n") == full["input_ids"][0].tolist()
    assert torch.equal(traj.multimodal_inputs["pixel_values"], full["pixel_values"])
    assert traj.metrics["check/ok"] and traj.metrics["encode/slow_turns"] == 0


async def test_json_round_trip_keeps_images(qwen2vl: tuple[Any, VisionProcessor]) -> None:
    tokenizer, vision = qwen2vl
    engine = ScriptedEngine(tokenizer, ["B.<|im_end|>"] * 2)
    traj = await run_trajectory(
        Sample("p", []), spec_for(PictureEnv, engine, ChatEncoder(tokenizer, vision=vision), 2)
    )
    data = trajectory_to_json(traj)
    assert "multimodal_inputs" not in data and all(
        u.startswith("data:image/png;base64,") for u in data["images"]
    )
    assert data["messages"][0]["content"][1] == {"type": "image", "image_index": 0}
    back = trajectory_from_json(data)
    assert [list(i.getdata()) for i in back.images] == [list(i.getdata()) for i in traj.images]
    assert back.messages[2]["content"][1]["image"] is back.images[1]
    assert traj.images and traj.multimodal_inputs  # to_dict left the trajectory as it was


def test_buffer_merges_each_key_once() -> None:
    buffer = MultimodalBuffer()
    turns = [
        {"pixel_values": torch.full((n, 4), float(n)), "image_grid_thw": torch.tensor([[1, n, 1]])}
        for n in (2, 3)
    ]
    for inputs in turns:
        buffer.append(inputs)
    buffer.append({})
    merged = buffer.merge()
    assert len(buffer) == 2
    assert torch.equal(merged["pixel_values"], torch.cat([t["pixel_values"] for t in turns]))
    assert merged["image_grid_thw"].tolist() == [[1, 2, 1], [1, 3, 1]]


def test_sglang_request_carries_images_as_data_urls(qwen2vl: tuple[Any, VisionProcessor]) -> None:
    _, vision = qwen2vl
    inputs = vision.features([picture(0), picture(1)]).images
    body = generate_payload([1, 2], SamplingParams(), inputs, "r")
    assert [u[:22] for u in body["image_data"]] == ["data:image/png;base64,"] * 2
    assert body["image_data"][0] is inputs[0].data_url  # encoded once per image, reused every turn


async def test_viewer_shows_the_images_of_a_vlm_run(
    qwen2vl: tuple[Any, VisionProcessor], tmp_path: Path
) -> None:
    from turnrl.viewer.page import read_run, view_model

    tokenizer, vision = qwen2vl
    engine = ScriptedEngine(tokenizer, ["C.<|im_end|>"] * 2)
    spec = spec_for(PictureEnv, engine, ChatEncoder(tokenizer, vision=vision), 2)
    traj = await run_trajectory(Sample("p", []), spec)
    (tmp_path / "trajectories.jsonl").write_text(json.dumps(trajectory_to_json(traj)) + "\n")
    shown = view_model(read_run(tmp_path))["trajectories"][0]
    urls = [p["image"] for m in shown["messages"] if isinstance(m["content"], list) for p in m["content"]
            if p.get("type") == "image"]  # fmt: skip
    assert urls == trajectory_to_json(traj)["images"] and len(urls) == 3


# Qwen3.5's template (a real one, from the corpus) renders images and drops earlier turns'
# reasoning; its generation prompt opens <think>, so a reply starts inside the reasoning.
QWEN35 = Path(__file__).parent / "templates" / "Qwen3.5-4B.jinja"


@pytest.mark.parametrize("template", ["own", "qwen3.5"])
async def test_step_wise_and_inference_samples_carry_the_images_of_their_own_context(
    vlm_dirs: dict[str, Path], template: str
) -> None:
    """``algorithm.samples: turn`` and ``inference`` with images: each model turn's sample holds
    exactly the images its context shows (the first k of the trajectory), and the inference
    context is the template's fresh render with every image expanded to its tokens."""
    tokenizer = load_tokenizer(str(vlm_dirs["tiny-qwen3-vl"]))
    vision = load_vision_processor(str(vlm_dirs["tiny-qwen3-vl"]), tokenizer)
    assert vision is not None
    if template == "qwen3.5":
        tokenizer.chat_template = QWEN35.read_text()
        replies = [f"look {i}\n</think>\n\nI see picture {i}.<|im_end|>" for i in range(4)]
    else:  # Qwen3-VL instruct: reasoning is plain text it keeps
        replies = [f"<think>\nlook {i}\n</think>\n\nI see picture {i}.<|im_end|>" for i in range(4)]
    spec = spec_for(PictureEnv, ScriptedEngine(tokenizer, replies), ChatEncoder(tokenizer, vision=vision))
    spec.inference_contexts = True
    traj = await run_trajectory(Sample("p", []), spec)
    assert traj.num_turns == 4 and traj.metrics["check/ok"]
    assert "inference_context_errors" not in traj.info
    model_turns = [t for t in traj.turns if t.role == "assistant"]
    before = [1, 3, 5, 7]  # the prompt's image, then two more per observation
    tokens = [image.num_tokens for image in vision.features(traj.images).images]
    for mode in ("turn", "inference"):
        samples = build_samples(mode, [traj], [[1.0] * 4])
        assert [s.turn for s in samples] == [0, 1, 2, 3]
        for sample, count, turn in zip(samples, before, model_turns, strict=True):
            grid = sample.multimodal["image_grid_thw"]
            assert torch.equal(grid, traj.multimodal_inputs["image_grid_thw"][:count])
            assert len(sample.multimodal["pixel_values"]) == int(grid.prod(dim=-1).sum())
            assert sample.input_ids.count(vision.image_token_id) == sum(tokens[:count])
            if mode == "inference" and turn.context_ids is not None:
                assert sample.input_ids[: len(turn.context_ids)] == turn.context_ids
    rewritten = [t.context_ids is not None for t in model_turns]
    # an append-only template: no context differs; Qwen3.5 drops the earlier turns' reasoning
    assert rewritten == ([False, True, True, True] if template == "qwen3.5" else [False] * 4)
    if template == "qwen3.5":
        context = tokenizer.decode(model_turns[3].context_ids)
        assert "look 0" not in context and "look 2" not in context and "I see picture 2." in context
    assert traj.metrics.get("inference/rewritten_turns", 0) == sum(rewritten)
