"""Search-R1 style questions answered with a retrieval tool: BM25 over a local corpus.

The default corpus is ``python-docs`` (the standard library's docstrings, built offline), and the
questions ask which module defines a function or class, described by its docstring: the model
searches, reads the passages, and answers ``<answer>module</answer>``. Reward: 1.0 for the right
module, else 0.0. Any JSONL corpus with rows of ``{"question", "answer"}`` works the same way.
"""

from __future__ import annotations

import functools
import json
import random
from collections import Counter
from typing import Any

from turnrl.env.builtin.math_tools import answers_match, extract_answer, last_model_text
from turnrl.env.tool_env import ToolEnv
from turnrl.tools.parsers import ToolParser
from turnrl.tools.retrieval import PYTHON_DOCS, BM25Search, load_index
from turnrl.types import Message, Sample, Trajectory

SYSTEM_PROMPT = (
    "Answer the question. Look things up with the search tool, e.g.\n"
    '<tool_call>{"name": "search", "arguments": {"query": "merge sorted inputs"}}</tool_call>\n'
    "When you know, reply without a tool call as <answer>...</answer>."
)


class SearchQAEnv(ToolEnv):
    """Questions answered with ``search`` over a corpus; the row's ``answer`` scores the reply."""

    def __init__(
        self,
        sample: Sample,
        corpus: str = PYTHON_DOCS,
        top_k: int = 3,
        parser: str | ToolParser = "hermes",
        tool_timeout_s: float | None = 30.0,
    ) -> None:
        tool = _tool(corpus, top_k)
        super().__init__(sample, [tool], parser=parser, tool_timeout_s=tool_timeout_s)

    async def score(self, trajectory: Trajectory) -> float:
        """1.0 when the last model turn's answer is the row's answer."""
        expected = str(self.sample.metadata.get("answer", ""))
        return float(answers_match(extract_answer(last_model_text(trajectory)), expected))

    @staticmethod
    def dataset(size: int = 16, seed: int = 0, corpus: str = PYTHON_DOCS) -> list[dict[str, Any]]:
        """``size`` questions on the corpus's passages whose name is unique (python-docs)."""
        passages = load_index(corpus).passages
        names = Counter(p.title.rpartition(".")[2] for p in passages)
        texts = Counter(p.text.partition(": ")[2] for p in passages)  # inherited docstrings repeat
        unique = [
            p
            for p in passages
            if names[p.title.rpartition(".")[2]] == 1 and texts[p.text.partition(": ")[2]] == 1
        ]
        picked = random.Random(seed).sample(unique, min(size, len(unique)))
        return [_row(i, seed, p.title, p.text) for i, p in enumerate(picked)]


def demonstration(sample: Sample) -> list[str]:
    """A search for the question's description, then the row's answer."""
    question = str(sample.prompt[-1]["content"])
    described = question.split('described as: "')[-1].rsplit('"', 1)[0]
    call = json.dumps({"name": "search", "arguments": {"query": described}})
    return [f"<tool_call>{call}</tool_call>", f"<answer>{sample.metadata['answer']}</answer>"]


@functools.lru_cache(maxsize=16)
def _tool(corpus: str, top_k: int) -> BM25Search:
    """One search tool per (corpus, top_k): stateless, shared by every trajectory."""
    return BM25Search({"corpus": corpus, "top_k": top_k})


def _row(index: int, seed: int, title: str, text: str) -> dict[str, Any]:
    module, _, name = title.rpartition(".")
    described = text.partition(": ")[2]
    prompt: list[Message] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {
            "role": "user",
            "content": f"Which module of Python's standard library defines `{name}`, described as: "
            f'"{described}"? Answer with the module name.',
        },
    ]
    return {"id": f"search/{seed}/{index}", "prompt": prompt, "data_source": "search_qa", "answer": module}
