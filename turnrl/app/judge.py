"""LLM-as-judge rewards: a second model grades each trajectory, or ranks a whole group in one call.

Judge calls run concurrently (at most ``max_concurrency``; an embedded or vLLM judge batches
them), are cached by the exact prompt, and their seconds and tokens land in each trajectory's
metrics (``judge/seconds``, ``judge/prompt_tokens``, ``judge/completion_tokens``,
``judge/cached``). A reply without a parsable score raises ``JudgeError``: the rollout reports it
as the trajectory's ``reward_error`` (reward 0.0) and goes on.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections.abc import Sequence
from typing import Any

from turnrl.app.chat_models import ChatModel, ChatReply, Placeholders, chat_model
from turnrl.config import JUDGE_RANK_RUBRIC, JUDGE_RUBRIC, JudgeConfig
from turnrl.env.rewards import RewardContext
from turnrl.tools import strip_reasoning
from turnrl.types import Message, Sample, Trajectory
from turnrl.vision.content import text_parts

_SCORE = re.compile(r"score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_SCORES = re.compile(r"scores\s*[:=]\s*(\[[^\]]*\])", re.IGNORECASE)


class JudgeError(ValueError):
    """A judge reply that gives no usable score; the message quotes its start."""


class Judge:
    """Grades trajectories with a chat model; ``score`` and ``rank`` are reward functions."""

    def __init__(self, config: JudgeConfig, model: ChatModel | None = None) -> None:
        self.config = config
        self.model = model or chat_model(config.model_dump())
        self._gate = asyncio.Semaphore(config.max_concurrency)
        self._cache: dict[str, asyncio.Future[ChatReply]] = {}  # by prompt: replies, and calls in flight
        self.stats = {"calls": 0, "cached": 0, "seconds": 0.0, "prompt_tokens": 0, "completion_tokens": 0}

    async def score(self, ctx: RewardContext) -> float:
        """One trajectory's reward: the judge's score / ``max_score``, in [0, 1]."""
        rubric = self.config.rubric or JUDGE_RUBRIC
        prompt = rubric.format_map(Placeholders(_fields(ctx.sample, ctx.trajectory)))
        reply = await self._ask(prompt, [ctx.trajectory])
        found = _SCORE.findall(reply)
        if not found:
            raise JudgeError(f"judge reply has no 'Score: N': {_quote(reply)}")
        return self._scaled(float(found[-1]))

    async def rank(self, contexts: list[RewardContext]) -> list[float]:
        """A whole group graded in one call, each attempt against the others (RULER-style)."""
        if not contexts:
            return []
        fields = _fields(contexts[0].sample, contexts[0].trajectory)
        fields["attempts"] = "\n\n".join(
            f"Attempt {n}:\n{_transcript(c.trajectory, len(c.sample.prompt))}"
            for n, c in enumerate(contexts, start=1)
        )
        prompt = (self.config.rubric or JUDGE_RANK_RUBRIC).format_map(Placeholders(fields))
        reply = await self._ask(prompt, [c.trajectory for c in contexts])
        found = _SCORES.findall(reply)
        try:
            values = json.loads(found[-1]) if found else None
        except json.JSONDecodeError:
            values = None
        if not isinstance(values, list) or len(values) != len(contexts):
            raise JudgeError(
                f"judge reply has no 'Scores: [...]' for {len(contexts)} attempts: {_quote(reply)}"
            )
        try:
            return [self._scaled(float(v)) for v in values]
        except (TypeError, ValueError):
            raise JudgeError(f"judge scores are not numbers: {_quote(reply)}") from None

    async def close(self) -> None:
        """Release the judge's connections."""
        await self.model.close()

    def _scaled(self, value: float) -> float:
        return min(max(value, 0.0), self.config.max_score) / self.config.max_score

    async def _ask(self, prompt: str, trajs: Sequence[Trajectory]) -> str:
        """The judge's reply to ``prompt`` (cached by content); its cost on every trajectory judged."""
        messages: list[Message] = [{"role": "user", "content": prompt}]
        key = hashlib.sha256(prompt.encode()).hexdigest()
        pending = self._cache.get(key) if self.config.cache else None
        cached = pending is not None  # asked before, or being asked right now: one call serves both
        t0 = time.perf_counter()
        if pending is None:
            pending = asyncio.ensure_future(self._call(messages))
            if self.config.cache:
                self._cache[key] = pending
        try:
            reply = await asyncio.shield(pending)
        except Exception:
            self._cache.pop(key, None)  # a failed call is not kept: the next asks again
            raise
        seconds = time.perf_counter() - t0
        self._count(reply, seconds, cached)
        for traj in trajs:  # a group call's cost is shared out over its trajectories
            share = 1 / len(trajs)
            _add(traj, "judge/seconds", seconds * share)
            _add(traj, "judge/prompt_tokens", 0 if cached else reply.prompt_tokens * share)
            _add(traj, "judge/completion_tokens", 0 if cached else reply.completion_tokens * share)
            _add(traj, "judge/cached", int(cached))
        return reply.text

    async def _call(self, messages: list[Message]) -> ChatReply:
        async with self._gate:
            return await self.model.chat(messages)

    def _count(self, reply: ChatReply, seconds: float, cached: bool) -> None:
        self.stats["calls"] += 1
        self.stats["cached"] += int(cached)
        self.stats["seconds"] += seconds
        if not cached:
            self.stats["prompt_tokens"] += reply.prompt_tokens
            self.stats["completion_tokens"] += reply.completion_tokens


class JudgeFeedback:
    """A judge as env feedback (a verl interaction): each answer without a tool call is graded
    with the rubric, the critique goes back to the model as the user's message, the score / max
    is the turn's reward, and the episode ends once it reaches ``pass_score`` or after
    ``max_rounds``. Config: the ``JudgeConfig`` fields plus ``pass_score`` and ``max_rounds``."""

    def __init__(self, config: dict[str, Any], model: ChatModel | None = None) -> None:
        options = dict(config)
        self.name = str(options.pop("name", "judge"))
        self.pass_score = float(options.pop("pass_score", 8.0))
        self.max_rounds = int(options.pop("max_rounds", 3))
        self.judge = Judge(JudgeConfig(**options), model)
        self._rounds: dict[str, int] = {}

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Begin grading one episode."""
        instance_id = instance_id or hashlib.sha256(str(time.time()).encode()).hexdigest()[:16]
        self._rounds[instance_id] = 0
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """Grade the last answer: (passed or out of rounds, the critique, score / max, meta)."""
        self._rounds[instance_id] = rounds = self._rounds.get(instance_id, 0) + 1
        question = next((_text(m) for m in messages if m.get("role") == "user"), "")
        answer = strip_reasoning(_text(messages[-1])).strip()
        fields = {"question": question, "response": answer, "transcript": f"[assistant] {answer}", **kwargs}
        fields.setdefault("reference", "")
        prompt = (self.judge.config.rubric or JUDGE_RUBRIC).format_map(Placeholders(fields))
        reply = await self.judge.model.chat([{"role": "user", "content": prompt}])
        found = _SCORE.findall(reply.text)
        if not found:
            raise JudgeError(f"judge reply has no 'Score: N': {_quote(reply.text)}")
        score = float(found[-1])
        critique = _SCORE.sub("", reply.text).strip() or "No comment."
        done = score >= self.pass_score or rounds >= self.max_rounds
        text = f"{critique}\nScore: {score:g}/{self.judge.config.max_score:g}"
        return done, text, self.judge._scaled(score), {"round": rounds, "score": score}

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        """Forget the episode."""
        self._rounds.pop(instance_id, None)


def _add(traj: Trajectory, key: str, value: float) -> None:
    traj.metrics[key] = traj.metrics.get(key, 0) + value


def _fields(sample: Sample, traj: Trajectory) -> dict[str, Any]:
    """What a rubric may name: the task, the reference answer, the transcript, the final answer."""
    question = next((_text(m) for m in reversed(sample.prompt) if m.get("role") == "user"), "")
    meta = sample.metadata
    reward_model = meta.get("reward_model")
    reference = meta.get("answer") or (
        reward_model.get("ground_truth") if isinstance(reward_model, dict) else ""
    )
    final = next((t.text for t in reversed(traj.turns) if t.role == "assistant"), "")
    return {
        "question": question,
        "reference": reference or "",
        "transcript": _transcript(traj, len(sample.prompt)),
        "response": strip_reasoning(final).strip(),
        **{k: v for k, v in meta.items() if isinstance(v, str | int | float)},
    }


def _transcript(traj: Trajectory, prompt_messages: int) -> str:
    """The conversation after the prompt, one block per message, reasoning left out."""
    lines = []
    for message in traj.messages[prompt_messages:]:
        text = strip_reasoning(_text(message)).strip()
        if text:
            lines.append(f"[{message.get('role')}] {text}")
    return "\n".join(lines) or "(nothing)"


def _text(message: Any) -> str:
    return " ".join(text_parts(message.get("content")))


def _quote(text: str) -> str:
    flat = " ".join(text.split())
    return repr(flat[:120] + ("..." if len(flat) > 120 else ""))
