"""Data rows into samples: files, generators, or an env's own data."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

from turnrl.types import Message, Sample

KNOWN = {"id", "prompt", "data_source", "tools", "tools_kwargs", "metadata", "system", "env"}


class DataError(ValueError):
    """A data row or file that cannot become a sample; the message names it."""


def _prompt(row: dict[str, Any], where: str, required: bool) -> list[Message]:
    prompt = row.get("prompt")
    if (prompt is None or prompt == "" or prompt == []) and required:
        raise DataError(
            f"{where} has no 'prompt' (the env starts from it; an env whose reset() builds one needs none)"
        )
    if prompt is None or prompt == "" or prompt == []:
        messages: list[Message] = []  # the env's reset() builds the prompt
    elif isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        messages = [cast(Message, dict(m)) for m in prompt]
    else:
        raise DataError(f"{where}: 'prompt' must be a string or a list of chat messages")
    if row.get("system") and (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": row["system"]})
    return messages


def sample_from_row(
    row: dict[str, Any], index: int, source: str = "data", prompt_required: bool = True
) -> Sample:
    """One row (``prompt``, ``id``, ``data_source``, ``tools``, ``tools_kwargs`` optional: an env
    whose ``reset()`` builds the prompt needs no ``prompt`` column; every other field lands in
    ``metadata``)."""
    where = f"data row {index} of {source}"
    if not isinstance(row, dict):
        raise DataError(f"{where} is not a mapping")
    metadata = dict(row.get("metadata") or {})
    metadata.update({k: v for k, v in row.items() if k not in KNOWN})
    extra = row.get("extra_info") or {}
    tools_kwargs = row.get("tools_kwargs") or (extra.get("tools_kwargs") if isinstance(extra, dict) else None)
    return Sample(
        id=str(row.get("id", index)),
        prompt=_prompt(row, where, prompt_required),
        data_source=str(row.get("data_source", "default")),
        tools=row.get("tools"),
        tools_kwargs=dict(tools_kwargs or {}),
        metadata=metadata,
        env=None if row.get("env") is None else str(row["env"]),
    )


def read_rows(path: str | Path, split: str = "train") -> list[dict[str, Any]]:
    """Rows of a JSONL file, a JSON list, a Parquet file, or a saved Hugging Face dataset (a folder;
    ``split`` of a DatasetDict)."""
    path = Path(path)
    if path.is_dir():
        return _dataset_rows(path, split)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    if path.suffix == ".parquet":
        return _parquet_rows(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"data file {path} is not UTF-8 text (byte {exc.start}): give JSONL, JSON or .parquet"
        ) from None
    if path.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"data file {path} is not JSON: {exc.msg} (line {exc.lineno})") from None
        if not isinstance(rows, list):
            raise DataError(f"data file {path} must hold a JSON list")
        return rows
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(f"data file {path} line {n} is not JSON: {exc.msg}") from None
    return out


def to_samples(
    rows: Iterable[dict[str, Any]], source: str, limit: int | None = None, prompt_required: bool = True
) -> list[Sample]:
    """Validate every row up front, so a bad row fails before any work starts (``prompt_required``
    false: an env that builds its own prompt, so rows may have none)."""
    samples = []
    for i, row in enumerate(rows):
        if limit is not None and i >= limit:
            break
        samples.append(sample_from_row(row, i, source, prompt_required))
    if not samples:
        raise DataError(f"{source} gave no samples")
    ids = [s.id for s in samples]
    if len(set(ids)) != len(ids):
        raise DataError(f"{source} has duplicate sample ids")
    return samples


def _parquet_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a Parquet file (verl's data format), nested columns as dicts and lists."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow: pip install 'turnrl[data]'") from None
    try:
        return list(pq.read_table(path).to_pylist())
    except Exception as exc:
        raise DataError(f"data file {path} is not readable Parquet: {exc}") from None


def _dataset_rows(path: Path, split: str) -> list[dict[str, Any]]:
    """The rows of a dataset saved with ``save_to_disk`` (a Dataset, or ``split`` of a DatasetDict)."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"reading the dataset folder {path} needs datasets: pip install 'turnrl[data]'"
        ) from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise DataError(f"{path} is not a saved Hugging Face dataset: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"dataset {path} has no split {split!r} (splits: {', '.join(loaded)})")
        loaded = loaded[split]
    return [dict(row) for row in loaded]
