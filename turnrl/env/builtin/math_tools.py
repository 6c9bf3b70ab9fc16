"""Reasoning-gym math problems solved with a calculator tool, scored by each task's own verifier.

Rows come from ``MathToolEnv.dataset`` (``reasoning_gym.create_dataset``); each keeps the task name, the
seed, the size, its index and the reasoning-gym entry in its metadata, so ``score`` rebuilds the very
same dataset object (cached per process) and calls its ``score_answer(answer, entry)``.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from turnrl.env.tool_env import ToolEnv
from turnrl.tools import FunctionTool, calculator, strip_reasoning
from turnrl.tools.parsers import ToolParser
from turnrl.types import Message, Sample, Trajectory

DEFAULT_TASKS = ("basic_arithmetic", "gsm_symbolic")
SYSTEM_PROMPT = (
    "Solve the problem. For arithmetic, call the calculator tool, e.g.\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}</tool_call>\n'
    "When you know the result, reply without a tool call and give the final answer as "
    "<answer>...</answer>."
)

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_CALCULATOR = FunctionTool(calculator)  # stateless, so one instance serves every trajectory

Verifier = Callable[[str | None, dict[str, Any]], float]


def extract_answer(text: str) -> str | None:
    """The last ``<answer>...</answer>`` in ``text``, else the last number outside the reasoning."""
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        return str(tagged[-1]).strip()
    numbers = _NUMBER.findall(strip_reasoning(text))
    return numbers[-1].replace(",", "") if numbers else None


def answers_match(answer: str | None, expected: str) -> bool:
    """Equal as numbers when both are numbers, else equal as case-folded text (a final period ignored)."""
    if answer is None:
        return False
    got, want = _normalize(answer), _normalize(expected)
    try:
        return float(got.replace(",", "")) == float(want.replace(",", ""))
    except ValueError:
        return got == want


def _normalize(text: str) -> str:
    return text.strip().rstrip(".").strip().casefold()


def last_model_text(trajectory: Trajectory) -> str:
    """The text of the trajectory's last model turn (empty when there is none)."""
    for turn in reversed(trajectory.turns):
        if turn.role == "assistant":
            return turn.text
    return ""


@functools.lru_cache(maxsize=64)
def _dataset(task: str, seed: int, size: int) -> Any:
    """The reasoning-gym dataset object, rebuilt deterministically and kept for the process."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, seed=seed, size=size)


def verifier_for(metadata: dict[str, Any], data_source: str) -> Verifier:
    """The ``score_answer`` of the dataset a row came from (the task's default config when the row
    does not say its seed and size)."""
    entry_meta = metadata.get("entry", {}).get("metadata", {})
    task = str(metadata.get("task") or entry_meta.get("source_dataset") or data_source)
    if "seed" in metadata and "size" in metadata:
        score: Verifier = _dataset(task, int(metadata["seed"]), int(metadata["size"])).score_answer
        return score
    import reasoning_gym

    score_fn: Verifier = reasoning_gym.get_score_answer_fn(task)
    return score_fn


class MathToolEnv(ToolEnv):
    """Math word problems and arithmetic with a calculator; the reasoning-gym task scores the answer."""

    def __init__(
        self,
        sample: Sample,
        parser: str | ToolParser = "hermes",
        max_parallel_calls: int = 8,
        tool_timeout_s: float | None = 30.0,
        max_calls_per_turn: int = 16,
    ) -> None:
        super().__init__(
            sample,
            [_CALCULATOR],
            parser=parser,
            max_parallel_calls=max_parallel_calls,
            tool_timeout_s=tool_timeout_s,
            max_calls_per_turn=max_calls_per_turn,
        )

    async def score(self, trajectory: Trajectory) -> float:
        """The task's own ``score_answer`` on the answer of the last model turn."""
        entry = self.sample.metadata.get("entry")
        if not isinstance(entry, dict):
            raise ValueError(f"sample '{self.sample.id}' has no reasoning-gym 'entry' in its metadata")
        verify = verifier_for(self.sample.metadata, self.sample.data_source)
        return float(verify(extract_answer(last_model_text(trajectory)), entry))

    @staticmethod
    def dataset(tasks: Sequence[str] = DEFAULT_TASKS, size: int = 16, seed: int = 0) -> list[dict[str, Any]]:
        """``size`` rows per task, interleaved across tasks; ``data_source`` is the task name."""
        if isinstance(tasks, str):
            tasks = (tasks,)
        per_task = [_task_rows(task, size, seed) for task in tasks]
        return [row for group in zip(*per_task, strict=True) for row in group]


def demonstration(sample: Sample) -> list[str]:
    """A calculator call with the row's expression (reasoning-gym's ``basic_arithmetic``), then the
    answer; rows without an expression have none (an empty list)."""
    expression = (sample.metadata.get("entry") or {}).get("metadata", {}).get("expression")
    if not expression:
        return []
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return [f"<tool_call>{call}</tool_call>", f"<answer>{sample.metadata['answer']}</answer>"]


def _task_rows(task: str, size: int, seed: int) -> list[dict[str, Any]]:
    """The rows of one reasoning-gym task."""
    data = _dataset(task, seed, size)
    return [_row(task, seed, size, i, data[i]) for i in range(size)]


def _row(task: str, seed: int, size: int, index: int, entry: dict[str, Any]) -> dict[str, Any]:
    prompt: list[Message] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": entry["question"]},
    ]
    return {
        "id": f"{task}/{seed}/{index}",
        "prompt": prompt,
        "data_source": task,
        "task": task,
        "seed": seed,
        "size": size,
        "index": index,
        "answer": entry["answer"],
        "entry": entry,
    }
