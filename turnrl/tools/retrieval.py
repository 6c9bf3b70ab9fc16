"""A retrieval tool (Search-R1's search): BM25 over a local corpus, offline (``bm25s``).

A corpus is a JSONL file of ``{"id", "title", "text"}`` passages, or ``python-docs``: the
docstrings of Python's standard library on this machine (one passage per documented function or
class), built offline with nothing to download. Indexes are built once per corpus and process.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnrl.tools.base import BaseTool, ToolError, ToolOutput

PYTHON_DOCS = "python-docs"
DOC_MODULES = (
    "bisect", "heapq", "json", "math", "statistics", "random", "itertools", "functools", "textwrap",
    "string", "difflib", "fractions", "decimal", "collections", "shutil", "fnmatch", "glob", "base64",
    "hashlib", "zlib", "gzip", "csv", "calendar", "datetime", "operator", "copy", "pprint", "secrets",
    "html", "uuid", "ipaddress", "colorsys", "shlex", "struct", "binascii", "keyword", "numbers",
)  # fmt: skip


@dataclass(frozen=True)
class Passage:
    """One document of a corpus."""

    id: str
    title: str
    text: str


def python_docs_corpus(modules: tuple[str, ...] = DOC_MODULES) -> list[Passage]:
    """Passages from the standard library's docstrings: ``module.name`` and its first paragraph."""
    passages: list[Passage] = []
    for module_name in modules:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or getattr(obj, "__module__", module_name) not in (module_name, None):
                continue
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
            if len(first) >= 20:
                title = f"{module_name}.{name}"
                passages.append(Passage(title, title, f"{title}: {first}"))
    return passages


def read_corpus(path: str | Path) -> list[Passage]:
    """A JSONL corpus: one ``{"id", "title", "text"}`` object per line (``contents`` also read as text)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"corpus file not found: {file}")
    passages = []
    for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text = row.get("text") or row.get("contents")
        except (json.JSONDecodeError, AttributeError):
            raise ValueError(f"corpus {file} line {n} is not a JSON object") from None
        if not text:
            raise ValueError(f"corpus {file} line {n} has no 'text'")
        passages.append(Passage(str(row.get("id", n)), str(row.get("title", "")), str(text)))
    if not passages:
        raise ValueError(f"corpus {file} is empty")
    return passages


class BM25Index:
    """BM25 over passages (bm25s, English stopwords removed)."""

    def __init__(self, passages: list[Passage]) -> None:
        import bm25s

        self.passages = passages
        self._bm25s = bm25s
        self.index = bm25s.BM25()
        self.index.index(bm25s.tokenize([p.text for p in passages], show_progress=False), show_progress=False)

    def search(self, query: str, k: int = 3) -> list[tuple[Passage, float]]:
        """The ``k`` best passages for ``query``, best first, with their scores (none: no match)."""
        tokens = self._bm25s.tokenize([query], show_progress=False)
        if not tokens.ids or not tokens.ids[0]:
            return []
        k = min(k, len(self.passages))
        ids, scores = self.index.retrieve(tokens, k=k, show_progress=False)
        return [(self.passages[int(i)], float(s)) for i, s in zip(ids[0], scores[0], strict=True) if s > 0]


@functools.lru_cache(maxsize=8)
def load_index(corpus: str) -> BM25Index:
    """The index of a corpus (``python-docs`` or a JSONL path), built once per process."""
    return BM25Index(python_docs_corpus() if corpus == PYTHON_DOCS else read_corpus(corpus))


SEARCH_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the documents; returns the best matching passages.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "What to look for."}},
            "required": ["query"],
        },
    },
}


class BM25Search(BaseTool):
    """``search(query)`` over a local corpus. Config: ``corpus`` (``python-docs`` or a JSONL path),
    ``top_k`` (3), ``max_chars`` per passage (400)."""

    def __init__(
        self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None
    ) -> None:
        super().__init__(config=config, tool_schema=tool_schema or SEARCH_SCHEMA)
        self.corpus = str(self.config.get("corpus", PYTHON_DOCS))
        self.top_k = int(self.config.get("top_k", 3))
        self.max_chars = int(self.config.get("max_chars", 400))
        self.index = load_index(self.corpus)  # built now: a bad corpus fails at load time

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> ToolOutput:
        """The best passages, numbered, each with its title."""
        query = parameters.get("query")
        if not isinstance(query, str) or not query.strip():
            raise ToolError("search needs 'query': the words to look for")
        hits = self.index.search(query, self.top_k)
        if not hits:
            return ToolOutput("No results.", metrics={"search_hits": 0})
        lines = [f"[{n}] {p.title}\n{p.text[: self.max_chars]}" for n, (p, _) in enumerate(hits, start=1)]
        return ToolOutput("\n\n".join(lines), metrics={"search_hits": len(hits), "top_score": hits[0][1]})
