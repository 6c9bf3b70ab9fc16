"""Rewards for a gateway's sessions, as its users give them: ``POST /v1/rewards``.

A reward names a session (and may name one of its branches) with a finite number, at any time after
the session's calls; it may say which task the session was (``task``: sessions of one task share a
baseline), else the task is the session's first user message. The rewarded branches become
trajectories at once: their reward set, their group the task, each sampled token in one branch's
loss (``forest.train_once``); they are appended to ``rewarded.jsonl`` (on disk before the reply),
and the session is closed (a later call of that name starts a new one). A session that gets no
reward within ``expire_s`` of its last call is dropped and counted. A learner takes the ready
sessions (``take``) and says which it trained on (``learned``, appended to ``learned.jsonl``), so a
gateway restarted on its folder (``restore``) trains every rewarded session exactly once.

Refused, with the API's error and counted, nothing kept: an unknown session (404), one that expired
(410), one already rewarded (409), a reward that is not a finite number or a branch the session
does not have (400).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from turnrl.gateway.call import ApiError
from turnrl.gateway.forest import train_once
from turnrl.record.codec import trajectory_from_json
from turnrl.record.writer import JsonlWriter
from turnrl.types import Trajectory

if TYPE_CHECKING:
    from turnrl.gateway.server import Gateway

REWARDED = "rewarded.jsonl"
LEARNED = "learned.jsonl"
TASK_CHARS = 200  # a task named by its first user message: that many characters of it


class RewardDesk:
    """The rewards a gateway's sessions get, and the rewarded sessions waiting to be trained on."""

    def __init__(self, gateway: Gateway, folder: Path, expire_s: float) -> None:
        self.gateway, self.folder, self.expire_s = gateway, folder, expire_s
        self.ready: list[list[Trajectory]] = []  # per rewarded session, its branches, in reward order
        self.given: set[str] = set()  # sessions rewarded (in this folder's life)
        self.expired: set[str] = set()
        self.counts: Counter[str] = Counter()  # rewards, refused by reason, expired, learned
        self.arrived = asyncio.Event()  # a reward came since the learner last looked
        self._scored: set[str] = set()  # sessions the reward function was asked about
        self._rewarded = JsonlWriter(folder / REWARDED)
        self._learned = JsonlWriter(folder / LEARNED)

    def restore(self) -> int:
        """Read the folder of an earlier life: the sessions it rewarded and has not trained on are
        ready again; the count of those."""
        learned = {json.loads(line)["session"] for line in _lines(self.folder / LEARNED)}
        sessions: dict[str, list[Trajectory]] = {}
        for line in _lines(self.folder / REWARDED):
            traj = trajectory_from_json(json.loads(line))
            assert traj.branch is not None, f"{REWARDED} holds a trajectory that is no session's branch"
            sessions.setdefault(traj.branch.session, []).append(traj)
        self.given |= set(sessions)
        self.ready = [trajs for name, trajs in sessions.items() if name not in learned]
        return len(self.ready)

    def post(self, body: Any, key: str | None) -> dict[str, Any]:
        """Take one reward (``{"session", "reward", "branch"?, "task"?}``): what was kept, or ApiError."""
        try:
            return self._post(body, key)
        except ApiError as error:
            self.counts[f"refused:{error.code or 'invalid'}"] += 1
            raise

    def _post(self, body: Any, key: str | None) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise ApiError(400, "the request body must be a JSON object", code="invalid")
        unknown = sorted(set(body) - {"session", "reward", "branch", "task"})
        if unknown:
            raise ApiError(400, f"unsupported field {unknown[0]!r}", param=unknown[0], code="invalid")
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise ApiError(
                400, f"reward must be a finite number, got {reward!r}", param="reward", code="invalid"
            )
        name = body.get("session")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "session must name a session", param="session", code="invalid")
        name = self.gateway.authorize(name, key, name)
        if name in self.given:
            raise ApiError(409, f"session {name!r} already has its reward", param="session", code="duplicate")
        if name in self.expired:
            raise ApiError(
                410, f"session {name!r} expired before its reward", param="session", code="expired"
            )
        session = self.gateway.sessions.get(name)
        if session is None or not session.branches:
            raise ApiError(404, f"no session {name!r} on this gateway", param="session", code="unknown")
        if self.gateway.busy(name):
            raise ApiError(409, f"session {name!r} has a call being answered", param="session", code="busy")
        branch = body.get("branch")
        if branch is not None and (
            isinstance(branch, bool) or not isinstance(branch, int) or not 0 <= branch < len(session.branches)
        ):
            raise ApiError(
                400, f"branch must be one of 0..{len(session.branches) - 1}", param="branch", code="invalid"
            )
        task = body.get("task")
        return self._accept(name, float(reward), branch, str(task) if task is not None else None)

    def _accept(self, name: str, reward: float, branch: int | None, task: str | None) -> dict[str, Any]:
        """Keep session ``name``'s reward (its ``branch`` only, when given): its branches as
        trajectories, on disk, ready; the session closed."""
        session = self.gateway.sessions[name]
        trajs = [b.trajectory(name) for b in session.branches if branch is None or b.index == branch]
        task = task if task is not None else _first_user_message(trajs[0])
        for traj in trajs:
            traj.reward, traj.group_id = float(reward), task
        train_once(trajs)
        for traj in trajs:
            self._rewarded.write(traj)
        self.gateway.close_session(name)
        self.given.add(name)
        self.ready.append(trajs)
        self.counts["rewards"] += 1
        self.arrived.set()
        return {"session": name, "reward": float(reward), "task": task, "branches": len(trajs)}

    async def score_finished(self, score: Callable[[list[Any]], Any], after_s: float) -> list[str]:
        """Score each session that has had no call for ``after_s`` with ``score`` (run in a thread:
        a judge may take its time): a finite number is its reward, None leaves it be (it is not
        asked again); the sessions rewarded."""
        now = time.monotonic()
        done = []
        for name, session in list(self.gateway.sessions.items()):
            if name in self._scored or now - session.updated < after_s or self.gateway.busy(name):
                continue
            self._scored.add(name)
            value = (
                await asyncio.to_thread(score, list(session.branches[-1].seen)) if session.branches else None
            )
            if self.gateway.sessions.get(name) is not session or self.gateway.busy(name) or value is None:
                continue  # rewarded over HTTP, closed or called again meanwhile; or left to a reward
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                self.counts["refused:scored"] += 1
                continue
            self._accept(name, float(value), None, None)
            done.append(name)
        return done

    def expire(self, now: float | None = None) -> list[str]:
        """Drop the sessions with no reward ``expire_s`` after their last call; their names."""
        now = time.monotonic() if now is None else now
        gone = [
            name
            for name, session in self.gateway.sessions.items()
            if now - session.updated > self.expire_s and not self.gateway.busy(name)
        ]
        for name in gone:
            self.gateway.close_session(name)
            self.expired.add(name)
        self.counts["expired"] += len(gone)
        return gone

    def take(self, count: int) -> list[list[Trajectory]]:
        """The first ``count`` ready sessions (fewer if fewer are ready), no longer ready."""
        taken, self.ready = self.ready[:count], self.ready[count:]
        return taken

    def learned(self, sessions: list[list[Trajectory]], step: int, left_out: Mapping[str, str]) -> None:
        """Say that ``sessions`` were taken by ``step``: trained on, or left out (``left_out``: the
        reason, by session name: ``stale``, ``held_back``)."""
        for trajs in sessions:
            name = trajs[0].branch.session if trajs[0].branch is not None else trajs[0].id
            why = {"left_out": left_out[name]} if name in left_out else {}
            self._learned.write_record({"session": name, "step": step, **why})
        self.counts["learned"] += len(sessions)

    def close(self) -> None:
        """Close the files."""
        self._rewarded.close()
        self._learned.close()

    def metrics(self) -> list[str]:
        """Prometheus lines: rewards taken and refused, sessions waiting, expired, learned."""
        lines = [
            f"turnrl_learn_rewards_total {self.counts['rewards']}",
            f"turnrl_learn_sessions_waiting {len(self.ready)}",
            f"turnrl_learn_sessions_expired_total {self.counts['expired']}",
            f"turnrl_learn_sessions_learned_total {self.counts['learned']}",
        ]
        for name, n in sorted(self.counts.items()):
            if name.startswith("refused:"):
                lines.append(f'turnrl_learn_rewards_refused_total{{reason="{name[8:]}"}} {n}')
        return lines


def _first_user_message(traj: Trajectory) -> str:
    """A session's task when its reward names none: its first user message."""
    for message in traj.messages:
        if message.get("role") == "user":
            content = message.get("content")
            text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
            return text[:TASK_CHARS]
    return ""


def _lines(path: Path) -> list[str]:
    """The complete lines of a JSONL file; a last line cut by a crash is cut off the file, so that
    what is appended next starts a line of its own."""
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8")
    whole = text[: text.rfind("\n") + 1]
    if len(whole) < len(text):
        with path.open("r+", encoding="utf-8") as file:
            file.truncate(len(whole.encode("utf-8")))
    return [line for line in whole.split("\n") if line.strip()]
