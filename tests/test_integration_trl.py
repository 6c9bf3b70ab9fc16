"""TRL's GRPOTrainer trained on turnrl rollouts: real TRL, the tiny Qwen3, a two-turn env, on CPU."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from turnrl.config import ChatConfig
from turnrl.engines.hf import HFEngine
from turnrl.integrations.prompt_index import PromptIndex, prompt_key, tag_prompt
from turnrl.integrations.trl import (
    ID_COLUMN,
    REWARD_KEY,
    SAMPLE_ID_KEY,
    make_rollout_func,
    turnrl_reward,
)
from turnrl.models import load_model, load_tokenizer
from turnrl.rollout import Limits
from turnrl.rollout.collector import read_trajectories
from turnrl.testing import EchoEnv
from turnrl.types import Sample, SamplingParams, StopReason, Trajectory


@pytest.fixture(autouse=True)
def _quiet_experimental(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is flagged experimental


# One prompt text, two tasks: only the sample id in rollout.dataset()'s prompts tells them apart.
ROWS = [
    {"id": "story-a", "prompt": "Tell a story, one sentence per turn.", "weight": 1.0},
    {"id": "story-b", "prompt": "Tell a story, one sentence per turn.", "weight": 2.0},
]
GROUP = 4
# TRL still reads transformers' deprecated checkpointing alias; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


class LettersEnv(EchoEnv):
    """Two model turns with an echo between them; reward: the row's weight times the share of
    ASCII letters in the model's text (varied for a random model, so every group has a spread)."""

    def __init__(self, sample: Sample) -> None:
        super().__init__(sample, done_after=2)

    async def score(self, trajectory: Trajectory) -> float:
        text = "".join(t.text for t in trajectory.turns if t.role == "assistant")
        letters = sum(c.isascii() and c.isalpha() for c in text) / max(len(text), 1)
        return float(self.sample.metadata["weight"]) * letters


class RecordingTrainer(GRPOTrainer):
    """Keeps every batch the loss consumed."""

    consumed: list[dict[str, Any]]

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        self.consumed.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def _args(tmp_path: Path, **overrides: Any) -> GRPOConfig:
    kwargs: dict[str, Any] = {
        "output_dir": str(tmp_path / "trl"),
        "per_device_train_batch_size": 2 * GROUP,
        "num_generations": GROUP,
        "max_steps": 2,
        "learning_rate": 1e-3,
        "max_completion_length": 96,
        "temperature": 1.0,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "use_cpu": True,
        "bf16": False,
        "disable_tqdm": True,
        "seed": 0,
        "activation_checkpointing": False,  # a tiny model; also avoids the deprecated alias's warning
    }
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def _sampling(vocab: int) -> SamplingParams:
    # A random-init model never samples <|im_end|>: half the vocabulary stops a turn instead, so
    # turns end after a few tokens and each trajectory gets its two model turns.
    return SamplingParams(temperature=1.0, max_tokens=16, stop_token_ids=tuple(range(1, vocab, 2)))


def _forward_logprobs(model: Any, weights: dict[str, torch.Tensor], traj: Trajectory) -> torch.Tensor:
    """The response tokens' logprobs under ``weights`` (a fresh forward pass, temperature 1)."""
    model.load_state_dict(weights)
    ids = torch.tensor([traj.prompt_ids + traj.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(traj.prompt_ids) - 1 : -1].float()
    targets = torch.tensor(traj.response_ids)
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]


def _row(batch: dict[str, Any], b: int) -> tuple[list[int], list[int], list[int], list[float]]:
    """One consumed row without padding: prompt ids, completion ids, env mask, sampling logprobs."""
    keep = batch["completion_mask"][b].bool()
    prompt = batch["prompt_ids"][b][batch["prompt_mask"][b].bool()].tolist()
    return (
        prompt,
        batch["completion_ids"][b][keep].tolist(),
        batch["tool_mask"][b][keep].tolist(),
        batch["sampling_per_token_logps"][b][keep].tolist(),
    )


@pytest.mark.slow
def test_grpo_trainer_steps_on_turnrl_rollouts(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_qwen3_dir))
    model = load_model(str(tiny_qwen3_dir)).train()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    rollout = make_rollout_func(
        LettersEnv,
        ROWS,
        chat=ChatConfig(template_kwargs={"enable_thinking": False}),
        sampling=_sampling(len(tokenizer)),
        limits=Limits(max_turns=2, max_context_tokens=512),
        out_path=tmp_path / "trajectories.jsonl",
    )
    calls: list[tuple[dict[str, torch.Tensor], list[Trajectory], dict[str, Any]]] = []

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        out = rollout(prompts, trainer)
        calls.append((weights, list(rollout.trajectories), out))
        return out

    rows_seen: list[tuple[list[str], list[str]]] = []

    @functools.wraps(turnrl_reward)
    def reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
        rows_seen.append((list(kwargs[ID_COLUMN]), list(kwargs[SAMPLE_ID_KEY])))
        return turnrl_reward(completions, **kwargs)

    trainer = RecordingTrainer(
        model=model,
        reward_funcs=[reward],
        args=_args(tmp_path),
        train_dataset=rollout.dataset(),
        processing_class=tokenizer,
        rollout_func=rollout_func,
    )
    trainer.consumed = []
    with rollout:
        trainer.train()
        engine = rollout.engine
    assert isinstance(engine, HFEngine)
    assert rollout.engine is None  # closed and released; a later call would start a fresh one

    assert len(calls) == 2 and len(trainer.consumed) == 2
    probe = load_model(str(tiny_qwen3_dir))
    for (weights, trajs, out), batch in zip(calls, trainer.consumed, strict=True):
        # turnrl's trajectories: two model turns each, env tokens (mask 0) between them
        assert len(trajs) == 2 * GROUP
        assert {t.group_id for t in trajs} == {"story-a", "story-b"}
        for traj in trajs:
            assert traj.stop_reason == StopReason.ENV_DONE and traj.num_turns == 2, traj.error
            spans = [(t.role, traj.loss_mask[t.start : t.end]) for t in traj.turns]
            assert [role for role, _ in spans] == ["assistant", "user", "assistant"]
            assert all(set(mask) == ({1} if role == "assistant" else {0}) for role, mask in spans)
            assert "Go on. (turn 1)" in traj.turns[1].text
            # the env scored it with its own row's weight: the prompt reached the right sample
            text = traj.turns[0].text + traj.turns[2].text
            weight = {row["id"]: row["weight"] for row in ROWS}[traj.group_id]
            assert traj.reward == pytest.approx(
                weight * sum(c.isascii() and c.isalpha() for c in text) / len(text)
            )
            # sampled with the weights the trainer had when it asked for the rollout
            model_tokens = torch.tensor(traj.loss_mask, dtype=torch.bool)
            expected = _forward_logprobs(probe, weights, traj)[model_tokens]
            torch.testing.assert_close(
                torch.tensor(traj.rollout_logprobs)[model_tokens], expected, atol=2e-4, rtol=0
            )
        assert out["completion_ids"] == [t.response_ids for t in trajs]
        assert out["env_mask"] == [t.loss_mask for t in trajs]
        assert out[REWARD_KEY] == [t.reward for t in trajs]
        # what the trainer's loss consumed is exactly turnrl's record, row for row
        by_completion = {tuple(t.response_ids): t for t in trajs}
        assert len(by_completion) == len(trajs)
        rewards = {
            t.group_id: torch.tensor([u.reward for u in trajs if u.group_id == t.group_id]) for t in trajs
        }
        matched = set()
        for b in range(batch["completion_ids"].shape[0]):
            prompt, completion, mask, logprobs = _row(batch, b)
            traj = by_completion[tuple(completion)]
            matched.add(traj.id)
            assert prompt == traj.prompt_ids
            assert mask == traj.loss_mask and 0 in mask and 1 in mask
            assert len(logprobs) == len(completion)
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(traj.rollout_logprobs))
            # the advantage is GRPO's, computed from turnrl's reward of the trajectory's group
            group = rewards[traj.group_id]
            advantage = (traj.reward - group.mean()) / (group.std() + 1e-4)
            torch.testing.assert_close(batch["advantages"][b], advantage.float(), atol=1e-4, rtol=1e-4)
        assert len(matched) == len(trajs)
        assert batch["advantages"].abs().max() > 0.1  # rewards differ within groups: a real signal
    # every dataset row TRL scored was rolled out as that row's sample
    assert len(rows_seen) == 2
    for row_ids, sample_ids in rows_seen:
        assert row_ids == sample_ids
    # the reward TRL logged is turnrl's
    logged = [
        h["rewards/turnrl_reward/mean"]
        for h in trainer.state.log_history
        if "rewards/turnrl_reward/mean" in h
    ]
    assert logged == pytest.approx(
        [sum(t.reward for t in trajs) / len(trajs) for _, trajs, _ in calls], abs=1e-5
    )
    # the trainer's weights moved, and the engine served the synced ones for the second rollout
    final = trainer.model.state_dict()
    assert any(not torch.equal(initial[k], final[k]) for k in initial)
    second = calls[1][0]
    assert any(not torch.equal(initial[k], second[k]) for k in initial)
    assert engine.weight_version == 1
    assert all(torch.equal(engine.model.state_dict()[k], second[k]) for k in second)
    # the engine's model is its own: it computes with its weights, not with the trainer's model
    ids = torch.tensor([calls[1][1][0].input_ids])
    probe.load_state_dict(second)
    with torch.no_grad():
        torch.testing.assert_close(engine.model(input_ids=ids).logits, probe(input_ids=ids).logits)
    assert len(read_trajectories(tmp_path / "trajectories.jsonl")) == 4 * GROUP


def test_temperature_must_match_the_trainer(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_qwen3_dir))
    rollout = make_rollout_func(LettersEnv, ROWS, sampling=SamplingParams(temperature=0.7, max_tokens=4))
    trainer = GRPOTrainer(
        model=load_model(str(tiny_qwen3_dir)),
        reward_funcs=[turnrl_reward],
        args=_args(tmp_path, temperature=1.0),
        train_dataset=rollout.dataset(),
        processing_class=tokenizer,
        rollout_func=rollout,
    )
    with rollout, pytest.raises(ValueError, match=r"temperature 0\.7 differs from the trainer's 1\.0"):
        rollout([rollout.dataset()[0]["prompt"]], trainer)


def test_prompts_map_back_to_their_samples() -> None:
    index = PromptIndex()
    a = Sample("a", [{"role": "user", "content": "hi"}], metadata={"secret": 1})
    twin = Sample("a2", [{"role": "user", "content": "hi"}], metadata={"secret": 1})
    index.add(a)
    index.add(twin)  # the same task under another id: its text still maps to one task
    index.add(a, "hi")  # a row's own prompt, as a plain string
    assert index.lookup("hi") is a
    # a columnar dataset fills absent message keys with None; they do not change the prompt
    assert index.lookup([{"content": "hi", "role": "user", "tool_calls": None}]) is a
    assert prompt_key("hi") == prompt_key([{"role": "user", "content": "hi"}])
    other = Sample("b", [{"role": "user", "content": "hi"}], metadata={"secret": 2})
    index.add(other)
    with pytest.raises(LookupError, match="'a' and 'b' share this prompt but differ"):
        index.lookup("hi")  # the text alone no longer says which task
    assert index.lookup(tag_prompt(other)) is other and index.lookup(tag_prompt(twin)) is twin
    assert tag_prompt(other) == [{"role": "user", "content": "hi", "turnrl_id": "b"}]
    assert other.prompt == [{"role": "user", "content": "hi"}]  # tagging copies
    with pytest.raises(LookupError, match="not among the rollout's samples"):
        index.lookup("bye")
    with pytest.raises(LookupError, match="unknown sample id 'zz'"):
        index.lookup([{"role": "user", "content": "hi", "turnrl_id": "zz"}])


def test_reward_helper_checks_rows_against_samples() -> None:
    kwargs = {REWARD_KEY: [0.5, None], SAMPLE_ID_KEY: ["a", "b"], ID_COLUMN: ["a", "b"]}
    assert turnrl_reward(["x", "y"], **kwargs) == [0.5, None]
    with pytest.raises(ValueError, match="rolled out as sample 'a'"):
        turnrl_reward(["x", "y"], **{**kwargs, ID_COLUMN: ["b", "b"]})
    with pytest.raises(ValueError, match="no 'turnrl_reward'"):
        turnrl_reward(["x"])
