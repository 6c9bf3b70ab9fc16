"""Retrieval (Search-R1): BM25 over the offline python-docs corpus and JSONL corpora, the search
tool in a rollout with exact tokens, and the search_qa env scored on the answer."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from turnrl import ChatEncoder, Limits, RolloutSpec, Sample, SamplingParams, collect
from turnrl.engines.scripted import ScriptedEngine, policy_replies
from turnrl.env.builtin.search_qa import SearchQAEnv
from turnrl.tools import ToolConfigError, load_tools_config
from turnrl.tools.retrieval import BM25Index, load_index, read_corpus
from turnrl.types import Message, StopReason

pytest.importorskip("bm25s")  # installed by the test command (the envs extra): never skipped in CI


def test_the_python_docs_corpus_is_built_offline_and_search_finds_the_described_function() -> None:
    index = load_index("python-docs")
    assert len(index.passages) > 200
    titles = {p.title for p in index.passages}
    assert {"heapq.merge", "math.degrees", "json.dumps"} <= titles
    rows = SearchQAEnv.dataset(size=16, seed=3)
    assert len({r["id"] for r in rows}) == 16 and rows == SearchQAEnv.dataset(size=16, seed=3)
    found = 0
    for row in rows:
        described = row["prompt"][1]["content"].split('described as: "')[1].rsplit('"', 1)[0]
        best = index.search(described, 1)
        found += bool(best) and best[0][0].title.startswith(row["answer"] + ".")
    assert found >= 14  # the description finds its own function's module nearly always
    assert index.search("the of and", 3) == []  # stopwords only: no results, not an error


def test_a_jsonl_corpus_in_a_tools_yaml(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    docs = [
        {"id": "d1", "title": "Paris", "text": "Paris is the capital of France, on the Seine."},
        {"id": "d2", "title": "Berlin", "text": "Berlin is the capital of Germany, on the Spree."},
        {"id": "d3", "title": "Rome", "contents": "Rome is the capital of Italy, on the Tiber."},
    ]
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tool,) = load_tools_config(
        {"tools": [{"class_name": "turnrl.tools.retrieval.BM25Search", "config": {"corpus": str(corpus)}}]}
    )
    assert tool.name == "search" and [p.id for p in read_corpus(corpus)] == ["d1", "d2", "d3"]
    index = BM25Index(read_corpus(corpus))
    assert index.search("river Spree", 1)[0][0].title == "Berlin"
    assert index.search("Tiber capital", 1)[0][0].title == "Rome"
    (tmp_path / "bad.jsonl").write_text('{"title": "no text"}\n')
    with pytest.raises(ToolConfigError, match="line 1 has no 'text'"):
        load_tools_config({"tools": [{"class_name": "turnrl.tools.retrieval.BM25Search",
                                      "config": {"corpus": str(tmp_path / "bad.jsonl")}}]})  # fmt: skip


def searcher(messages: list[Message], images: list[Any], sample: Sample) -> str:
    """Search the description, then answer with the module of the best hit."""
    last = messages[-1]
    if last["role"] != "tool":
        described = str(messages[-1]["content"]).split('described as: "')[1].rsplit('"', 1)[0]
        return (
            f"<tool_call>\n{json.dumps({'name': 'search', 'arguments': {'query': described}})}\n</tool_call>"
        )
    module = re.findall(r"\[1\] ([\w]+)\.", str(last["content"]))[0]
    return f"<answer>{module}</answer>"


async def test_search_qa_rollouts_keep_exact_tokens_and_score_the_answer(qwen3_tokenizer: Any) -> None:
    rows = SearchQAEnv.dataset(size=8, seed=1)
    samples = [Sample(r["id"], r["prompt"], r["data_source"], metadata=r) for r in rows]
    spec = RolloutSpec(
        env_factory=SearchQAEnv,
        engine=ScriptedEngine(qwen3_tokenizer, policy_replies(searcher)),
        encoder=ChatEncoder(qwen3_tokenizer, {"enable_thinking": False}),
        sampling=SamplingParams(max_tokens=128),
        limits=Limits(max_turns=3, max_context_tokens=4096),
    )
    trajs = await collect(samples, spec)
    assert all(t.stop_reason is StopReason.NO_TOOL_CALL and t.num_turns == 2 for t in trajs)
    assert all(t.metrics["check/ok"] is True for t in trajs)
    assert all(t.turns[0].info["tool_metrics"][0]["search_hits"] == 3 for t in trajs)
    assert sum(t.reward for t in trajs) >= 7 and {t.reward for t in trajs} <= {0.0, 1.0}
