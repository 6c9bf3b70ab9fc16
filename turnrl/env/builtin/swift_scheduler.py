"""ms-swift's multi-turn scheduler style, as an env.

An ms-swift ``MultiTurnScheduler`` decides after each model turn whether the rollout is over
(``check_finished``) and, if not, builds the next request (``step``). ``SchedulerEnv`` keeps the running
messages and asks the same two questions from ``Env.step``. Because ``step`` is the env's own method, the
scheduler's ``step`` is called ``next_messages`` here. Porting a scheduler:

=============================================  ==============================================
ms-swift                                       turnrl
=============================================  ==============================================
``check_finished(infer_request, choice, t)``   ``check_finished(messages, response_text, t)``
``step(infer_request, choice, t)``             ``next_messages(messages, response_text, t)``
``infer_request.messages``                     ``messages`` (read-only; the model's turn is last)
``response_choice.message.content``            ``response_text``
``infer_request.data_dict``                    ``self.data_dict`` (the row's metadata)
``return {"infer_request": ...}``              return only the messages to append
``finish_reason == "length"`` check            done by the rollout loop (stop reason ``length``)
``response_loss_mask`` / token ids             automatic: observations are masked 0
=============================================  ==============================================

Tokens are only ever appended, so a scheduler cannot rewrite the history (ms-swift's ``MathTipsScheduler``
edits the last assistant message; ``ThinkingModelTipsScheduler`` drops past reasoning and returns one
trajectory per round). Here the whole episode is one trajectory with exact tokens.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from typing import Any

from turnrl.env.base import Env
from turnrl.env.builtin.math_tools import answers_match, extract_answer, last_model_text
from turnrl.types import Message, Sample, StepResult, Trajectory

TIPS_SYSTEM_PROMPT = "Think step by step, then give the final answer as <answer>...</answer>."


class SchedulerEnv(Env, ABC):
    """An env driven by ms-swift-style ``check_finished`` / ``next_messages`` hooks."""

    def __init__(self, sample: Sample, max_turns: int | None = None) -> None:
        super().__init__(sample)
        self.max_turns = max_turns  # the scheduler's own limit (the rollout's limits.max_turns also applies)
        self.messages: list[Message] = []
        self.turn = 0

    @property
    def data_dict(self) -> dict[str, Any]:
        """The row's extra fields, like ms-swift's ``infer_request.data_dict``."""
        return self.sample.metadata

    async def reset(self) -> list[Message]:
        """Start the running conversation from the sample's prompt."""
        self.messages = list(self.sample.prompt)
        self.turn = 0
        return list(self.messages)

    async def step(self, action: str) -> StepResult:
        """Record the model's turn, then ask ``check_finished`` and ``next_messages``."""
        self.turn += 1  # 1-based, as in ms-swift
        self.messages.append({"role": "assistant", "content": action})
        if self.check_finished(list(self.messages), action, self.turn):
            return StepResult(observation=None, done=True)
        new = self.next_messages(list(self.messages), action, self.turn)
        if not new:
            return StepResult(observation=None, done=True)  # nothing to say: the episode is over
        _check_messages(new)
        self.messages.extend(new)
        return StepResult(observation=list(new))

    def check_finished(self, messages: list[Message], response_text: str, turn: int) -> bool:
        """True to end the episode; ms-swift's default: the scheduler's ``max_turns`` is reached."""
        return self.max_turns is not None and turn >= self.max_turns

    @abstractmethod
    def next_messages(self, messages: list[Message], response_text: str, turn: int) -> list[Message]:
        """The messages to append before the next model turn (ms-swift's ``step``)."""


def _check_messages(messages: list[Message]) -> None:
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise TypeError(f"next_messages must return chat messages, got {message!r}")


class ThinkingTipsEnv(SchedulerEnv):
    """A port of ms-swift's ``ThinkingModelTipsScheduler``: a wrong or missing answer gets a tip to
    re-check, until the answer is right or ``max_turns`` is reached (ms-swift tips once: ``max_turns=2``).
    Reward: 1.0 when the final answer equals ``metadata["answer"]``, else 0.0."""

    tips_prompt = (
        "The answer is not correct, It seems You made a mistake, you need to recheck very carefully."
    )

    def __init__(self, sample: Sample, max_turns: int | None = 3) -> None:
        super().__init__(sample, max_turns)

    def is_correct(self, response_text: str) -> bool:
        """Does the response's ``<answer>`` (or last number) equal the row's answer?"""
        return answers_match(extract_answer(response_text), str(self.data_dict["answer"]))

    def check_finished(self, messages: list[Message], response_text: str, turn: int) -> bool:
        """Finished when the answer is right, else when the turns are used up."""
        return self.is_correct(response_text) or super().check_finished(messages, response_text, turn)

    def next_messages(self, messages: list[Message], response_text: str, turn: int) -> list[Message]:
        """Ask the model to re-check."""
        return [{"role": "user", "content": self.tips_prompt}]

    async def score(self, trajectory: Trajectory) -> float:
        """1.0 when the last model turn's answer is right, else 0.0."""
        return float(self.is_correct(last_model_text(trajectory)))

    @staticmethod
    def dataset(size: int = 16, seed: int = 0) -> list[dict[str, Any]]:
        """Small two-operand arithmetic questions with their answers."""
        rng = random.Random(seed)
        return [_question(rng, i, seed) for i in range(size)]


def _question(rng: random.Random, index: int, seed: int) -> dict[str, Any]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice("+-*")
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    prompt: list[Message] = [
        {"role": "system", "content": TIPS_SYSTEM_PROMPT},
        {"role": "user", "content": f"What is {a} {op} {b}?"},
    ]
    return {
        "id": f"tips/{seed}/{index}",
        "prompt": prompt,
        "data_source": "arithmetic_tips",
        "answer": str(answer),
    }
