"""What a session's forest trains: each sampled token once, and no reply the agent did not go on from.

A session's branches share tokens: a branch forked from another starts with a copy of its parent's
tokens up to the fork (``branch.fork_at``). Trained as recorded, a reply sampled once would weigh
once per branch that copied it. ``train_once`` gives each sampled token exactly one place in the
loss (in place, on the branches' ``loss_mask``):

- the branch that sampled it, when that branch is trained;
- else (it is left out: ``reinforce: last``, ``skip_system``) the first trained branch, in the order
  the branches started, that copied it;
- in every other branch that holds a copy it is context (mask 0): computed, once with
  ``train.share_prefix_tokens``, and not trained again.

**Unchosen replies.** A reply is *unchosen* when no later call went on from it (no call of its
branch followed it, no branch forked after it) and either the agent went back: a later call forked
the conversation at or before it (the same request sent again, a message before it edited, the
history cut back before it: mini-swe-agent's answer to a reply with no well-formed command), or it
is one of the ``n > 1`` replies of one call and another of them was continued. It did not lead to
the run's outcome, so it is not trained with the run's reward: its tokens get mask 0 and count in
``branch.unchosen_tokens`` (``train/excluded/unchosen_tokens``), and a branch left with nothing
of its own to train is excluded as ``unchosen``. When none of a call's ``n`` replies was continued,
each keeps its credit (nothing says which one the agent used). A reward that scores branches (a
list, one value per branch) credits each reply itself: nothing is unchosen then. A reply that was
continued keeps its credit even when the agent later cut it from the conversation: it may have
acted on the world (files, commands) the outcome depends on.

``branch.trunk_tokens`` counts a branch's sampled tokens that are trained elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from turnrl.types import SessionBranch, Trajectory

REPLACING = ("retry", "sample")  # reasons of a branch whose first reply answers its parent's request


@dataclass(frozen=True)
class Reply:
    """One reply of a branch: its span in the branch's response."""

    branch: int
    start: int
    end: int
    call: int  # its place among the session's calls (-1: unknown)


def train_once(branches: Iterable[Trajectory], credit_unchosen: bool = False) -> None:
    """Each sampled token of each session among ``branches`` in one branch's loss, unchosen replies
    in none (``credit_unchosen``: they keep their credit, as when the reward scored branches)."""
    sessions: dict[str, dict[int, Trajectory]] = {}
    for traj in branches:
        if traj.branch is not None:
            sessions.setdefault(traj.branch.session, {})[traj.branch.index] = traj
    for forest in sessions.values():
        _session(forest, credit_unchosen)


def link(traj: Trajectory) -> SessionBranch:
    """``traj``'s place in its session (a ValueError names a trajectory that is no branch)."""
    if traj.branch is None:
        raise ValueError(f"trajectory {traj.id!r} is not a recorded session's branch")
    return traj.branch


def copied(traj: Trajectory) -> int:
    """How many leading response tokens ``traj`` copied from its parent."""
    fork_at = link(traj).fork_at
    return max(0, fork_at - len(traj.prompt_ids)) if fork_at is not None else 0


def _session(forest: dict[int, Trajectory], credit_unchosen: bool) -> None:
    order = sorted(forest)
    own = {b: list(forest[b].loss_mask) for b in order}  # who sampled what (copies included)
    unchosen: dict[int, int] = {}
    if not credit_unchosen:
        for reply in unchosen_replies(forest):
            mask = own[reply.branch]
            unchosen[reply.branch] = unchosen.get(reply.branch, 0) + sum(mask[reply.start : reply.end])
            mask[reply.start : reply.end] = [0] * (reply.end - reply.start)
    taken = {b: bytearray(len(own[b])) for b in order}  # sampled tokens of branch b already trained
    segments: dict[int, list[tuple[int, int, int]]] = {}  # (start, end, the branch that sampled them)
    for b in order:
        traj, cut = forest[b], copied(forest[b])
        parent = link(traj).parent
        trunk_of = segments.get(parent, []) if parent is not None and cut else []
        held = [(s, min(e, cut), o) for s, e, o in trunk_of if s < cut]
        segments[b] = [*held, (cut, len(own[b]), b)]
        trained = not traj.exclude
        mask = [0] * len(own[b])
        for start, end, origin in segments[b]:
            source, done = own[origin], taken[origin]
            for i in range(start, end):
                if source[i] and (origin == b or (trained and not done[i])):
                    mask[i] = 1
                    done[i] |= trained
        trunk = sum(own[b][:cut]) - sum(mask[:cut]) if trained else 0
        _apply(traj, mask, trunk, unchosen.get(b, 0))


def _apply(traj: Trajectory, mask: list[int], trunk: int, unchosen: int) -> None:
    """Set the branch's mask (and zero the logprobs it no longer trains) and say what changed."""
    for i, (before, after) in enumerate(zip(traj.loss_mask, mask, strict=True)):
        if before and not after:
            traj.rollout_logprobs[i] = 0.0
    traj.loss_mask = mask
    link(traj).trunk_tokens, link(traj).unchosen_tokens = trunk, unchosen
    if unchosen and not any(mask) and not traj.exclude:
        traj.exclude = "unchosen"


def _replies(traj: Trajectory) -> list[Reply]:
    """The replies a branch sampled itself (after what it copied), in order."""
    b, cut = link(traj).index, copied(traj)
    return [
        Reply(b, t.start, t.end, -1 if t.call is None else t.call)
        for t in traj.turns
        if t.role == "assistant" and t.start >= cut
    ]


def unchosen_replies(forest: dict[int, Trajectory]) -> list[Reply]:
    """The replies of one session that the agent did not go on from (see the module doc)."""
    replies = {b: _replies(forest[b]) for b in forest}
    continued: set[Reply] = set()
    for own in replies.values():
        continued.update(own[:-1])  # a later call of the same branch followed each but the last
    for child in forest.values():  # a branch forked after a reply continues it
        parent, cut = link(child).parent, copied(child)
        if parent in replies and link(child).fork_at is not None:
            continued.update(r for r in replies[parent] if r.end <= cut)
    out: set[Reply] = set()
    for siblings in _sample_groups(forest, replies):  # of one call's n replies, the ones not taken
        if any(r in continued for r in siblings):
            out.update(r for r in siblings if r not in continued)
    # going back: after a reply nobody continued, a call forked the conversation at or before it
    backs = [
        (replies[b][0].call, at, t.input_ids[:at])
        for b, t in forest.items()
        if (at := link(t).fork_at) is not None and link(t).reason != "sample" and replies[b]
    ]
    for b, own in replies.items():
        ids, prompt = forest[b].input_ids, len(forest[b].prompt_ids)
        for reply in own:
            if reply in continued or reply.call < 0:
                continue
            if any(
                call > reply.call and at <= prompt + reply.start and ids[:at] == prefix
                for call, at, prefix in backs
            ):
                out.add(reply)
    return sorted(out, key=lambda r: (r.branch, r.start))


def _sample_groups(forest: dict[int, Trajectory], replies: dict[int, list[Reply]]) -> list[list[Reply]]:
    """The replies of each call that asked for ``n > 1``: the first (on the branch the call
    extended), then the others (branches that say ``sample``)."""
    groups: dict[tuple[int, int], list[Reply]] = {}
    for b in sorted(forest):
        own = link(forest[b])
        if own.reason != "sample" or own.fork_at is None or not replies[b]:
            continue
        first, anchor = replies[b][0], _anchor(forest, b)
        if anchor is None:
            continue
        original = [r for r in replies[anchor] if r.start == first.start]
        groups.setdefault((anchor, first.start), original).append(first)
    return list(groups.values())


def _anchor(forest: dict[int, Trajectory], b: int) -> int | None:
    """The branch that sampled the first reply to the request branch ``b`` forked at."""
    cut, parent = copied(forest[b]), link(forest[b]).parent
    while parent in forest and (
        copied(forest[parent]) > cut
        or (copied(forest[parent]) == cut and link(forest[parent]).reason in REPLACING)
    ):  # the request lies in what the parent copied (or the parent is a retry of it too)
        parent = link(forest[parent]).parent
    return parent if parent in forest else None
