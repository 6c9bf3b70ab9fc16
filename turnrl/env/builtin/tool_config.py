"""A tool env built from a verl-style tools YAML, and a verl-style reward tool to put in one.

Each row picks its tools (``tools: [calculator, check_answer]``, or all of them when absent) and passes
per-tool kwargs in ``tools_kwargs`` (``{"check_answer": {"create_kwargs": {"ground_truth": "42"}}}``),
as in verl. See ``examples/tool_config.yaml``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnrl.env.builtin.math_tools import answers_match, extract_answer
from turnrl.env.interaction import interactions_from_file
from turnrl.env.rewards import RewardContext
from turnrl.env.tool_env import ToolEnv
from turnrl.tools import BaseTool, ToolArgumentError, ToolOutput, load_tools_config
from turnrl.tools.files import file_version
from turnrl.tools.parsers import ToolParser
from turnrl.types import Sample

CHECK_ANSWER_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "check_answer",
        "description": "Submit your final answer; you are told whether it is correct. The last one counts.",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "The final answer, e.g. 42."}},
            "required": ["answer"],
        },
    },
}


@functools.lru_cache(maxsize=16)
def _load(path: str, mtime_ns: int) -> tuple[BaseTool, ...]:
    """The tools of one config file version; shared by every trajectory, like verl's tool objects."""
    return tuple(load_tools_config(path))


def load_tools(path: str | Path) -> list[BaseTool]:
    """The tools of a tools YAML, loaded once per file version."""
    return list(_load(*file_version(path)))


class ConfiguredToolEnv(ToolEnv):
    """A ToolEnv whose tools come from a verl-style YAML (``tools_config``) and its ``parser``, with
    simulated users from a verl-style interaction YAML (``interaction_config``)."""

    def __init__(
        self,
        sample: Sample,
        tools_config: str | None = None,
        parser: str | ToolParser = "hermes",
        max_parallel_calls: int = 8,
        tool_timeout_s: float | None = 30.0,
        max_calls_per_turn: int = 16,
        interaction_config: str | None = None,
    ) -> None:
        """``tools_config``: verl's tools YAML; ``interaction_config``: verl's interaction YAML (simulated
        users, chosen per row by ``interaction_kwargs.name``). At least one of them."""
        if tools_config is None and interaction_config is None:
            raise ValueError("tool_env needs tools_config, interaction_config, or both")
        super().__init__(
            sample,
            load_tools(tools_config) if tools_config else [],
            parser=parser,
            max_parallel_calls=max_parallel_calls,
            tool_timeout_s=tool_timeout_s,
            max_calls_per_turn=max_calls_per_turn,
            interactions=interactions_from_file(interaction_config) if interaction_config else None,
        )


@dataclass
class _Attempt:
    """The state of one trajectory: the truth and the last submitted answer."""

    ground_truth: str
    answer: str | None = None
    submissions: int = 0


class AnswerCheckTool(BaseTool):
    """verl-style reward tool: ``create(ground_truth=...)``, the model submits answers with ``execute``,
    ``calc_reward`` is 1.0 when the last submission is right, ``release`` forgets the trajectory.

    Config: ``reveal`` (default true) tells the model whether a submission is right, so it can retry.
    """

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None):
        super().__init__(config, tool_schema or CHECK_ANSWER_SCHEMA)
        self.reveal = bool(self.config.get("reveal", True))
        self._attempts: dict[str, _Attempt] = {}

    async def create(self, instance_id: str, ground_truth: Any = None, **kwargs: Any) -> None:
        """Remember the trajectory's ground truth (``tools_kwargs[name]["create_kwargs"]``)."""
        if ground_truth is None:
            raise ValueError(f"tool '{self.name}' needs create_kwargs.ground_truth in the row's tools_kwargs")
        self._attempts[instance_id] = _Attempt(str(ground_truth))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> ToolOutput:
        """Record a submitted answer and say whether it is right (when ``reveal``)."""
        if "answer" not in parameters:
            raise ToolArgumentError(f"tool '{self.name}' is missing required argument(s) 'answer'")
        attempt = self._attempts[instance_id]
        attempt.answer = str(parameters["answer"]).strip()
        attempt.submissions += 1
        correct = answers_match(attempt.answer, attempt.ground_truth)
        verdict = ("correct" if correct else "not correct") if self.reveal else "recorded"
        return ToolOutput(f"Answer {attempt.answer!r} is {verdict}.", metrics={"submissions": 1})

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """1.0 when the last submitted answer matches the ground truth, else 0.0."""
        attempt = self._attempts.get(instance_id)
        return float(attempt is not None and answers_match(attempt.answer, attempt.ground_truth))

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Forget the trajectory."""
        self._attempts.pop(instance_id, None)


def answer_reward(ctx: RewardContext) -> float:
    """Reward function for rows without a reward tool: the last model turn's ``<answer>`` (or last
    number) against ``metadata["answer"]``; register it per data source under ``rewards:``."""
    return float(answers_match(extract_answer(ctx.final_text), str(ctx.sample.metadata["answer"])))
