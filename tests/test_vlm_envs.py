"""The vision-language example envs: FrozenLake frames, and the zoom tool's images in tool messages."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from turnrl.app import hf_engine
from turnrl.chat.encoder import ChatEncoder
from turnrl.data import sample_from_row
from turnrl.engines.scripted import ScriptedEngine
from turnrl.env.builtin.frozen_lake import INVALID_HINT, FrozenLakeEnv, parse_action
from turnrl.env.builtin.zoom import Layout, ZoomEnv, draw_grid
from turnrl.env.registry import resolve_env
from turnrl.models import load_tokenizer, load_vision_processor
from turnrl.record.codec import trajectory_from_json, trajectory_to_json
from turnrl.rollout.loop import RolloutSpec, run_trajectory
from turnrl.types import Limits, Message, Sample, SamplingParams, StopReason, Trajectory

pytest.importorskip("gymnasium")

CLASSIC_MAP = ["SFFF", "FHFH", "FFFH", "HFFG"]  # gymnasium's 4x4 lake


def _lake(env_map: list[str] = CLASSIC_MAP, **kwargs: Any) -> FrozenLakeEnv:
    row = {"id": "lake", "prompt": [{"role": "user", "content": "Play."}], "map": env_map, "seed": 0}
    return FrozenLakeEnv(sample_from_row(row, 0), **kwargs)


def _image_parts(message: Message) -> list[dict[str, Any]]:
    content = message["content"]
    return (
        [p for p in content if isinstance(p, dict) and p.get("type") == "image"]
        if isinstance(content, list)
        else []
    )


def _frame(message: Message) -> np.ndarray:
    (part,) = _image_parts(message)
    return np.asarray(part["image"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<action>left</action>", 0),
        ("I go <action> Down </action>", 1),
        ("<action>jump</action> then right", 2),
        ("up, no: LEFT", 0),
        ("<think>right?</think>up", 3),
        ("upward and leftover", None),
        ("", None),
    ],
)
def test_parse_action_is_lenient(text: str, expected: int | None) -> None:
    assert parse_action(text) == expected


async def test_frozen_lake_frames_follow_moves_and_the_goal_pays() -> None:
    env = _lake()
    prompt = await env.reset()
    first = _frame(prompt[-1])
    assert first.shape == (256, 256, 3) and prompt[-1]["content"][-1] == {"type": "text", "text": "Play."}
    frames = [first]
    for word in ["down", "down", "right", "right", "down"]:
        result = await env.step(f"<action>{word}</action>")
        assert not result.done and result.reward == 0.0
        (message,) = result.observation
        assert message["role"] == "user" and word in message["content"][-1]["text"]
        frames.append(_frame(message))
        assert not np.array_equal(frames[-1], frames[-2])  # the player moved on the picture
    assert env.position == (3, 2)
    result = await env.step("right")
    assert result.done and result.reward == 1.0 and result.observation is None
    await env.close()


async def test_frozen_lake_hole_ends_without_reward_and_invalid_does_not_move() -> None:
    env = _lake()
    prompt = await env.reset()
    result = await env.step("I would rather not")
    (message,) = result.observation
    assert not result.done and message["content"][-1]["text"] == INVALID_HINT
    assert np.array_equal(_frame(message), _frame(prompt[-1])) and env.position == (0, 0)
    assert result.info["invalid_actions"] == 1
    await env.step("right")
    result = await env.step("down")  # (1, 1) is a hole
    assert result.done and result.reward == 0.0
    await env.close()


async def test_frozen_lake_max_steps_ends_the_episode() -> None:
    env = _lake(max_steps=2)
    await env.reset()
    assert not (await env.step("left")).done
    result = await env.step("up")
    assert result.done and result.reward == 0.0
    await env.close()


async def test_frozen_lake_is_slippery_is_passed_to_gymnasium() -> None:
    for slippery, outcomes in ((False, 1), (True, 3)):
        env = _lake(is_slippery=slippery)
        await env.reset()
        assert len(env._env.unwrapped.P[0][1]) == outcomes  # possible results of "down" from the start
        await env.close()


def test_frozen_lake_dataset_is_seeded_and_registered() -> None:
    entry = resolve_env("frozen_lake")
    assert entry.dataset is not None
    rows = entry.dataset(size=3, seed=1, map_size=5)
    assert rows == FrozenLakeEnv.dataset(size=3, seed=1, map_size=5)
    assert rows != FrozenLakeEnv.dataset(size=3, seed=2, map_size=5)
    for row in rows:
        assert len(row["map"]) == 5 and all(len(line) == 5 for line in row["map"])
        assert row["map"][0][0] == "S" and row["map"][-1][-1] == "G"
        assert all(
            isinstance(m["content"], str) for m in row["prompt"]
        )  # plain JSON; the image comes at reset
    assert len({tuple(row["map"]) for row in rows}) > 1


def _image_token_count(traj: Trajectory, image_token_id: int) -> int:
    return sum(1 for t in traj.prompt_ids + traj.response_ids if t == image_token_id)


@pytest.mark.slow
async def test_frozen_lake_rollout_with_tiny_qwen2_vl() -> None:

    engine = hf_engine("tiny-qwen2-vl", seed=0)
    tokenizer = engine.tokenizer
    vision = load_vision_processor("tiny-qwen2-vl", tokenizer)
    assert vision is not None
    sample = sample_from_row(FrozenLakeEnv.dataset(size=1, seed=0)[0], 0)
    spec = RolloutSpec(
        env_factory=FrozenLakeEnv,
        engine=engine,
        encoder=ChatEncoder(tokenizer, vision=vision),
        # the random model almost never samples <|im_end|>: every 7th id stops its turn instead
        sampling=SamplingParams(max_tokens=40, stop_token_ids=tuple(range(0, 151000, 7)), seed=0),
        limits=Limits(max_turns=4, max_context_tokens=2048),
    )
    try:
        traj = await run_trajectory(sample, spec)
    finally:
        await engine.close()
    assert traj.error is None and traj.metrics["check/ok"] is True, traj.info.get("check")
    assert traj.num_turns >= 3
    observations = [t for t in traj.turns if t.role == "user"]
    assert len(observations) == traj.num_turns - 1  # the last model turn gets no observation
    # one image in the prompt, one new image in every observation
    assert len(traj.images) == 1 + len(observations)
    if traj.stop_reason == StopReason.MAX_TURNS:
        assert len(traj.images) == traj.num_turns
    for turn in observations:
        assert traj.response_ids[turn.start : turn.end].count(vision.image_token_id) > 0
        assert set(traj.loss_mask[turn.start : turn.end]) == {0}
    # the merged training inputs: one grid row per image, one pixel row per patch
    grid = traj.multimodal_inputs["image_grid_thw"]
    assert grid.shape == (len(traj.images), 3)
    assert traj.multimodal_inputs["pixel_values"].shape[0] == int(grid.prod(dim=1).sum())
    tokens_per_image = grid.prod(dim=1) // vision.merge_size**2
    assert _image_token_count(traj, vision.image_token_id) == int(tokens_per_image.sum())
    # the record on disk: data URLs, and image_index parts in message order
    record = trajectory_to_json(traj)
    assert all(url.startswith("data:image/png;base64,") for url in record["images"])
    indices = [p["image_index"] for m in record["messages"] for p in _image_parts(m)]
    assert indices == list(range(len(traj.images)))
    back = trajectory_from_json(record)
    assert all(
        np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(back.images, traj.images, strict=True)
    )


def _zoom_row() -> dict[str, Any]:
    return ZoomEnv.dataset(size=1, seed=3)[0]


def test_zoom_dataset_and_drawing() -> None:
    row = _zoom_row()
    assert row == ZoomEnv.dataset(size=1, seed=3)[0]
    assert row["answer"] in {c for line in row["codes"] for c in line}
    assert row["cell"] in row["prompt"][-1]["content"]
    image = draw_grid(row["codes"], row["image_seed"], row["cell_px"], row["font_px"])
    assert image.size == Layout(4, 4, row["cell_px"]).size == (672, 672)
    again = draw_grid(row["codes"], row["image_seed"], row["cell_px"], row["font_px"])
    assert np.array_equal(np.asarray(image), np.asarray(again))
    assert resolve_env("zoom").dataset is not None


async def test_zoom_tool_crops_and_enlarges() -> None:
    env = ZoomEnv(sample_from_row(_zoom_row(), 0), zoom_factor=2)
    await env.reset()
    (tool,) = env._tools.values()
    out = await tool.execute("i", {"cell": "b2"})
    box = env.layout.cell_box("B2")
    expected = env.image.crop(box).resize((320, 320), resample=3)
    assert out.images[0].size == (320, 320)
    assert np.array_equal(np.asarray(out.images[0]), np.asarray(expected)) and "cell B2" in out.text
    out = await tool.execute("i", {"bbox": [600, 600, 900, 900]})  # clamped to the 672x672 image
    assert out.images[0].size == (144, 144)
    result = await env.step('<tool_call>{"name": "zoom", "arguments": {"cell": "Z9"}}</tool_call>')
    (message,) = result.observation
    assert isinstance(message["content"], str) and message["content"].startswith("Error: no cell 'Z9'")
    await env.close()


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-qwen3-vl"])
@pytest.mark.parametrize(("said", "reward"), [("right", 1.0), ("wrong", 0.0)])
async def test_zoom_rollout_puts_the_crop_in_the_tool_message(model: str, said: str, reward: float) -> None:
    tokenizer = load_tokenizer(model)
    vision = load_vision_processor(model, tokenizer)
    assert vision is not None
    row = _zoom_row()
    answer = row["answer"] if said == "right" else "???"
    call = f'<tool_call>{{"name": "zoom", "arguments": {{"cell": "{row["cell"]}"}}}}</tool_call>'
    engine = ScriptedEngine(tokenizer, [call, f"It says <answer>{answer.lower()}</answer>"])
    spec = RolloutSpec(
        env_factory=ZoomEnv,
        engine=engine,
        encoder=ChatEncoder(tokenizer, vision=vision),
        sampling=SamplingParams(max_tokens=64),
        limits=Limits(max_turns=4, max_context_tokens=4096),
    )
    sample: Sample = sample_from_row(row, 0)
    traj = await run_trajectory(sample, spec)
    assert traj.error is None and traj.metrics["check/ok"] is True, traj.info.get("check")
    assert traj.num_turns == 2 and traj.stop_reason == StopReason.NO_TOOL_CALL
    assert traj.reward == reward and traj.info["num_tool_calls"] == 1
    tool_message = next(m for m in traj.messages if m["role"] == "tool")
    (part,) = _image_parts(tool_message)
    assert part["image"].size == (480, 480) and tool_message["content"][-1]["type"] == "text"
    assert len(traj.images) == 2 and traj.images[1] is part["image"]
    assert [len(call.images) for call in engine.calls] == [1, 2]  # the engine sees the crop on turn 2
    record = trajectory_to_json(traj)
    assert [p["image_index"] for m in record["messages"] for p in _image_parts(m)] == [0, 1]
