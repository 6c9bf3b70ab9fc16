"""The JSON record of a trajectory, as written to ``trajectories.jsonl``, and back.

The record is the ``Trajectory`` dataclass as a dict with ``schema_version`` first; the stop
reason is its string value; images become PNG data URLs in ``images`` and message image
parts ``{"type": "image", "image_index": k}``; the training tensors are left out
(``turnrl.vision`` recomputes them from the images). ``tests/test_codec.py`` pins the schema.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Any

from turnrl.types import SCHEMA_VERSION, AgentRun, SessionBranch, StopReason, Trajectory, Turn
from turnrl.vision.content import data_url, load_image, messages_from_json, messages_to_json


def trajectory_to_json(traj: Trajectory) -> dict[str, Any]:
    """A JSON-ready dict of ``traj`` (its images as data URLs, without training tensors)."""
    images, traj.images = traj.images, []
    tensors, traj.multimodal_inputs = traj.multimodal_inputs, {}
    try:
        body = asdict(traj)
    finally:
        traj.images, traj.multimodal_inputs = images, tensors
    del body["multimodal_inputs"]
    body["stop_reason"] = traj.stop_reason.value
    if images:
        body["messages"] = messages_to_json(traj.messages, images)
        body["images"] = [data_url(image) for image in images]
    return {"schema_version": SCHEMA_VERSION, **body}


def trajectory_from_json(record: dict[str, Any]) -> Trajectory:
    """The inverse of ``trajectory_to_json`` (images come back as PIL images); reads schema 1 too."""
    data = dict(record)
    version = data.pop("schema_version", 1)
    if version > SCHEMA_VERSION:
        raise ValueError(
            f"trajectory schema_version {version} is newer than this turnrl reads ({SCHEMA_VERSION})"
        )
    if version < 5:
        _lift_info(data)
    data["stop_reason"] = StopReason(data["stop_reason"])
    data["turns"] = [Turn(**t) for t in data.get("turns", [])]
    if data.get("branch") is not None:
        data["branch"] = SessionBranch(**data["branch"])
    if data.get("run") is not None:
        data["run"] = AgentRun(**data["run"])
    if data.get("images"):
        data["images"] = [load_image(url) for url in data["images"]]
        data["messages"] = messages_from_json(data["messages"], data["images"])
    return Trajectory(**data)


def _lift_info(data: dict[str, Any]) -> None:
    """A record of schema 4 or older into schema 5's fields: a session branch's links, its agent
    run, why it is excluded and a turn's call travelled as ``info`` keys then."""
    info = data["info"] = dict(data.get("info") or {})
    data["turns"] = [dict(t) for t in data.get("turns", [])]
    for turn in data["turns"]:
        turn["info"] = dict(turn.get("info") or {})
        if "call" in turn["info"]:
            turn["call"] = turn["info"].pop("call")
    if "exclude" in info:
        data["exclude"] = info.pop("exclude")
    if "session" not in info or "branch" not in info:
        return
    forest = info.pop("forest", None) or {}
    data["branch"] = {
        "session": str(info.pop("session")),
        "index": int(info.pop("branch")),
        "parent": info.pop("parent", None),
        "reason": info.pop("reason", None) or "first",
        "fork_at": info.pop("fork_at", None),
        "shared_tokens": info.pop("shared_tokens", 0) or 0,
        "trunk_tokens": forest.get("trunk", 0),
        "unchosen_tokens": forest.get("unchosen", 0),
    }
    if isinstance(info.get("run"), dict):
        data["run"] = {**info.pop("run"), "reward": info.pop("run_reward", None)}


def strict_json(value: Any) -> str:
    """``value`` as strict JSON: a NaN or infinity (a metric an env computed, say), which JSON
    cannot hold, is written as null."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(value), ensure_ascii=False, allow_nan=False)


def json_line(record: Any) -> str:
    """``record`` as one line of strict JSON (``strict_json``)."""
    return strict_json(record) + "\n"


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
