"""``calls.jsonl``: every completed call of every session, appended (and synced) as it completes,
so a gateway killed at any moment leaves its sessions valid up to their last complete call.

One record per call holds only what the call added to its branch (a new branch: its prompt, or the
point of its parent it forked at; then the new messages' delta tokens, and the reply's tokens,
logprobs and weight versions), so writing costs the same at turn 100 as at turn 1.
``read_branches`` rebuilds every branch as a turnrl ``Trajectory``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnrl.chat.encoder import Encoded
from turnrl.gateway.forest import train_once
from turnrl.gateway.session import Plan, Reply, record_call
from turnrl.record.episode import Episode
from turnrl.record.record import fork_record
from turnrl.record.writer import JsonlWriter
from turnrl.types import Generation, Message, Sample, SessionBranch, Trajectory
from turnrl.vision.content import count_images, load_image, messages_from_json, messages_to_json
from turnrl.vision.processor import ImageInput

CALLS = "calls.jsonl"


def call_record(
    session: str, plan: Plan, gen: Generation, reply: Reply, versions: list[int]
) -> dict[str, Any]:
    """What one call added to its branch (written once the call is committed)."""
    branch = plan.branch
    record: dict[str, Any] = {"session": session, "branch": branch.index, "call": branch.calls - 1}
    if plan.new:
        record |= {
            "parent": branch.parent,
            "reason": str(branch.reason),
            "shared_tokens": branch.shared_tokens,
        }
        if branch.fork_at is None:
            prompt = branch.episode.record.messages[: len(branch.episode.sample.prompt)]
            images = branch.episode.record.images[: count_images(prompt)]
            record["prompt"] = {"ids": branch.episode.prompt_ids, **_with_images(prompt, images)}
        else:
            record["fork"] = {"at": branch.fork_at, "messages": branch.fork_messages}
    return record | {
        "added_ids": plan.added.ids,
        **{f"added_{k}": v for k, v in _with_images(plan.added.messages, plan.added.images).items()},
        "ids": gen.token_ids,
        "logprobs": gen.logprobs,
        "versions": versions,
        "finish_reason": gen.finish_reason,
        "text": reply.text,
        "reply": reply.message,
        "sampled_message": branch.episode.record.messages[-1],
    }


def _with_images(messages: list[Message], images: list[ImageInput]) -> dict[str, Any]:
    """Messages as JSON (image parts as indexes into ``images``) and the images as data URLs."""
    if not images:
        return {"messages": messages}
    return {
        "messages": messages_to_json(messages, [i.image for i in images]),
        "images": [i.data_url for i in images],
    }


@dataclass
class StoredImage:
    """An image read back from ``calls.jsonl``: the picture (training recomputes its tensors)."""

    image: Any


def _read_images(record: dict[str, Any]) -> tuple[list[Message], list[Any]]:
    """A record's messages with their images restored, and the images."""
    pictures = [load_image(url) for url in record.get("images") or ()]
    messages = record["messages"]
    return (messages_from_json(messages, pictures) if pictures else messages), [
        StoredImage(p) for p in pictures
    ]


class CallLog:
    """The append-only ``calls.jsonl`` of a gateway run.

    Each call is written and flushed before its answer goes out, so a killed gateway (``kill -9``)
    loses no answered call: the operating system holds the line. A thread syncs the file to disk
    when it has news, at most every ``sync_seconds``, so a machine that loses power loses at most
    that much, and no call waits on the disk."""

    def __init__(self, out_dir: Path, sync_seconds: float = 0.05) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / CALLS
        self._writer = JsonlWriter(self.path, fsync=False)
        self._news = threading.Event()
        self._closing = False
        self._sync_seconds = sync_seconds
        self._syncer = threading.Thread(target=self._sync, name="calls.jsonl sync", daemon=True)
        self._syncer.start()

    def write(self, record: dict[str, Any]) -> None:
        """Append one call (a full line, flushed, or nothing)."""
        self._writer.write_record(record)
        self._news.set()

    def _sync(self) -> None:
        while not self._closing:
            self._news.wait()
            self._news.clear()
            self._writer.sync()
            time.sleep(self._sync_seconds)

    def close(self) -> None:
        """Sync and close the file."""
        self._closing = True
        self._news.set()
        self._syncer.join()
        self._writer.sync()
        self._writer.close()


def read_calls(path: Path) -> Iterator[dict[str, Any]]:
    """The intact call records of ``path`` in order (a torn last line, from a kill, is left out)."""
    with path.open() as f:
        for line in f:
            try:
                yield json.loads(line)
            except ValueError:
                continue


def read_branches(path: Path, self_contained: bool = False) -> list[Trajectory]:
    """Every branch of every session in ``path`` as a trajectory, in the order branches started,
    ready to train: each sampled token in one branch's loss, unchosen replies in none
    (``turnrl.gateway.forest``). ``self_contained``: every branch keeps the loss mask of all it
    holds, as recorded (a forked branch trains its trunk again)."""
    episodes: dict[tuple[str, int], Episode] = {}
    links: dict[tuple[str, int], SessionBranch] = {}
    calls: dict[str, int] = {}  # per session, calls so far (the file is in the order they completed)
    tool_calls: dict[tuple[str, int], int] = {}  # per branch, in the replies it sampled
    for call in read_calls(path):
        where = (call["session"], call["branch"])
        if where not in episodes:
            episodes[where] = _start(call, episodes)
            links[where] = SessionBranch(
                where[0],
                where[1],
                call.get("parent"),
                call.get("reason") or "first",
                (call.get("fork") or {}).get("at"),
                call.get("shared_tokens") or 0,
            )
        added_record = {"messages": call["added_messages"], "images": call.get("added_images")}
        messages, images = _read_images(added_record)
        added = Encoded(call["added_ids"], messages, images)
        gen = Generation(call["ids"], call["logprobs"], call["finish_reason"], None, call["versions"])
        record_call(
            episodes[where],
            added,
            "",
            gen,
            call["text"],
            call["versions"],
            calls.get(call["session"], 0),
            call["sampled_message"],
        )
        calls[call["session"]] = calls.get(call["session"], 0) + 1
        tool_calls[where] = tool_calls.get(where, 0) + len(call["reply"].get("tool_calls") or ())
    out = []
    for (session, index), episode in episodes.items():
        traj = episode.trajectory()
        traj.reward = None  # nothing scored a recorded session: the caller's reward sets it
        traj.branch = links[(session, index)]
        traj.info["num_tool_calls"] = tool_calls.get((session, index), 0)
        out.append(traj)
    if not self_contained:
        train_once(out)
    return out


def _start(call: dict[str, Any], episodes: dict[tuple[str, int], Episode]) -> Episode:
    """A branch's episode at its first call: its prompt, or its parent's tokens up to the fork."""
    if "prompt" in call:
        prompt = call["prompt"]
        messages, images = _read_images(prompt)
        episode = Episode(Sample(call["session"], messages), call["branch"])
        episode.prompt_ids = prompt["ids"]
        episode.record.start(Encoded(prompt["ids"], messages, images))
        return episode
    parent = episodes[(call["session"], call["parent"])]
    fork = call["fork"]
    episode = Episode(parent.sample, call["branch"])
    episode.prompt_ids = parent.prompt_ids
    episode.record = fork_record(parent.record, len(parent.prompt_ids), fork["at"], fork["messages"])
    return episode
