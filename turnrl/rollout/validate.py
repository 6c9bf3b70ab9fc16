"""``turnrl validate RUN_DIR``: every trajectory record of a run checked against the documented
record (docs/trajectories.md), stopping at the first violation with its file, line and id.

What is checked, per line: the schema version (first key, not newer than this turnrl reads); the
fields; the stop reason; ``loss_mask``, ``rollout_logprobs`` and ``policy_versions`` as long as
``response_ids``; token ids that are non-negative integers; a mask of 0s and 1s; logprobs that are
0.0 where the mask is 0 and finite and at most 0 where it is 1; turn spans that tile the response
in order; env turns masked; ``num_turns`` equal to the model turns; image parts that point at
images the record holds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from turnrl.types import SCHEMA_VERSION, StopReason

TRAJECTORIES = "trajectories.jsonl"
FIELDS = (
    "id", "group_id", "data_source", "stop_reason", "prompt_ids", "response_ids", "loss_mask",
    "rollout_logprobs", "turns", "messages", "reward", "turn_rewards", "num_turns", "metrics",
)  # fmt: skip
STOPS = {reason.value for reason in StopReason}


class Invalid(ValueError):
    """A record that breaks the documented schema; the message says where and what."""


def run_files(run: Path) -> list[Path]:
    """The trajectory files of a run: a file as given; a rollout's ``trajectories.jsonl``; a
    training run's saved rollouts and evaluations."""
    if run.is_file():
        return [run]
    if (run / TRAJECTORIES).is_file():
        return [run / TRAJECTORIES]
    files = [path for _, _, path in training_files(run)]
    if not files:
        raise Invalid(f"{run}: no {TRAJECTORIES} (nor a training run's rollouts/ or eval/)")
    return files


def training_files(run: Path) -> list[tuple[str, str, Path]]:
    """A training run's trajectory files as (split, step or name, path): its saved rollouts
    (``rollouts/step_NNNNNN.jsonl``, train.save_rollouts), then its evaluations (``eval/``)."""
    rollouts = [
        ("train", f.stem.removeprefix("step_"), f) for f in sorted((run / "rollouts").glob("step_*.jsonl"))
    ]
    evals = [("eval", f.stem.removeprefix("step_"), f) for f in sorted((run / "eval").glob("*.jsonl"))]
    return rollouts + evals


def validate_run(run: Path) -> int:
    """How many records ``run`` holds, all valid; ``Invalid`` at the first violation."""
    count = 0
    for path in run_files(run):
        for number, record in _records(path):
            try:
                check_record(record)
            except Invalid as exc:
                where = f"{path}:{number}" + (
                    f" (id {record['id']})" if isinstance(record, dict) and "id" in record else ""
                )
                raise Invalid(f"{where}: {exc}") from None
            count += 1
    return count


def _records(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except ValueError as exc:
                raise Invalid(f"{path}:{number}: not JSON ({exc})") from None


def check_record(record: Any) -> None:
    """Raise ``Invalid`` naming the first thing ``record`` gets wrong."""
    if not isinstance(record, dict):
        raise Invalid("a record must be a JSON object")
    version = record.get("schema_version")
    if next(iter(record), None) != "schema_version" or not isinstance(version, int):
        raise Invalid("schema_version must be the first key, an integer")
    if version > SCHEMA_VERSION:
        raise Invalid(f"schema_version {version} is newer than this turnrl reads ({SCHEMA_VERSION})")
    missing = [name for name in FIELDS if name not in record]
    if missing:
        raise Invalid(f"missing field {missing[0]!r}")
    if record["stop_reason"] not in STOPS:
        raise Invalid(f"stop_reason {record['stop_reason']!r} is not one of {', '.join(sorted(STOPS))}")
    _check_tokens(record)
    _check_turns(record)
    _check_images(record)


def _check_tokens(record: dict[str, Any]) -> None:
    ids, mask, logprobs = record["response_ids"], record["loss_mask"], record["rollout_logprobs"]
    for name in ("prompt_ids", "response_ids"):
        bad = next((t for t in record[name] if not isinstance(t, int) or isinstance(t, bool) or t < 0), None)
        if bad is not None:
            raise Invalid(f"{name} holds {bad!r}, not a token id")
    n = len(ids)
    versions = record.get("policy_versions") or []
    for name, values in (("loss_mask", mask), ("rollout_logprobs", logprobs), ("policy_versions", versions)):
        if (values or name != "policy_versions") and len(values) != n:
            raise Invalid(f"{name} has {len(values)} entries for {n} response_ids")
    for k, (m, lp) in enumerate(zip(mask, logprobs, strict=True)):
        if m not in (0, 1):
            raise Invalid(f"loss_mask[{k}] is {m!r}, not 0 or 1")
        if lp is None or not math.isfinite(lp) or lp > 1e-6 or (m == 0 and lp != 0.0):
            want = "0.0 (mask 0)" if m == 0 else "a finite logprob <= 0"
            raise Invalid(f"rollout_logprobs[{k}] is {lp!r}, expected {want}")


def _check_turns(record: dict[str, Any]) -> None:
    n, mask, turns = len(record["response_ids"]), record["loss_mask"], record["turns"]
    at = 0
    for k, turn in enumerate(turns):
        start, end = turn.get("start"), turn.get("end")
        if start != at or not isinstance(end, int) or end < start or end > n:
            raise Invalid(f"turns[{k}] spans [{start}, {end}), expected to start at {at} and end by {n}")
        if turn.get("role") != "assistant" and any(mask[start:end]):
            raise Invalid(f"turns[{k}] ({turn.get('role')}) has loss_mask 1: env tokens are never trained")
        at = end
    if at != n:
        raise Invalid(f"the turns end at {at}, the response at {n}")
    model = sum(1 for t in turns if t.get("role") == "assistant")
    if record["num_turns"] != model:
        raise Invalid(f"num_turns is {record['num_turns']}, the turns hold {model} model turns")
    if len(record["turn_rewards"]) > model:
        raise Invalid(f"{len(record['turn_rewards'])} turn_rewards for {model} model turns")


def _check_images(record: dict[str, Any]) -> None:
    images = record.get("images") or []
    if any(not (isinstance(i, str) and i.startswith("data:image/")) for i in images):
        raise Invalid("images must be data:image/... URLs")
    for m, message in enumerate(record["messages"]):
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            index = part.get("image_index") if isinstance(part, dict) else None
            if index is not None and not (isinstance(index, int) and 0 <= index < len(images)):
                raise Invalid(f"messages[{m}] points at image {index!r}; the record holds {len(images)}")
