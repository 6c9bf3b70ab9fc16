"""Sessions as forests of append-only branches, each a token-exact record of what the model saw.

A call whose messages extend a branch's last request plus the reply the gateway gave (compared by
meaning: ``messages.same``) appends only the new messages, as deltas of the chat template (mask 0),
then the sampled reply (mask 1): nothing is ever re-tokenized. Any other call starts a new branch,
which says why (``Reason``) and which branch it forked from. It starts from the longest prefix that
is still token-exact: the tokens of an earlier call's request (the same request again), or of an
earlier call's request and reply (what follows is encoded as deltas); only when no such prefix
exists (other tools, a rewritten system prompt or first message) is the request encoded afresh.
``shared_tokens`` says how many leading tokens a branch shares with its parent, so a trainer can
compute them once.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from turnrl.chat.encoder import ChatEncoder, ConversationEncoder, Encoded
from turnrl.gateway.messages import (
    first_difference,
    key,
    reply_message,
    same,
    sampled_message,
    template_message,
)
from turnrl.record.episode import Episode
from turnrl.record.record import fork_record
from turnrl.tools.base import ParseResult
from turnrl.tools.parser_base import ToolParser, split_reasoning
from turnrl.types import (
    Engine,
    Generation,
    Message,
    Sample,
    SamplingParams,
    SessionBranch,
    StopReason,
    Trajectory,
)


class Reason(StrEnum):
    """Why a call starts a new branch instead of extending one."""

    FIRST = "first"  # the session's first call
    # The rule, in order, against the branch whose messages the call shares most (its parent):
    # other tools, or both start with a system prompt and they differ: subagent; the call repeats a
    # request of the parent: retry (a strict prefix of one: truncation); the conversation after the
    # system prompt (kept, changed or dropped) starts differently: compaction when the request is
    # shorter than what the parent's model saw (a summary), else subagent; a run of turns replaced
    # by a message of another kind: compaction; anything else: edit.
    RETRY = "retry"  # a request sent before, again (what followed it is left on the parent)
    COMPACTION = "compaction"  # the history was rewritten shorter (summarized, compacted)
    TRUNCATION = "truncation"  # the history was cut back to a prefix of what the model saw
    EDIT = "edit"  # a message the model saw was edited
    SUBAGENT = "subagent"  # another system prompt, other tools or another conversation: another agent's
    # the call continues a reply that did not end (aborted mid-generation, or recorded before cut
    # replies continued), so nothing can follow it exactly; a reply cut at max_tokens continues
    CUT_REPLY = "cut_reply"
    SAMPLE = "sample"  # another of the n replies one request asked for (same prompt, its own sample)


REPLY_STOPS = {"stop": StopReason.MODEL_STOP, "length": StopReason.LENGTH, "abort": StopReason.ABORTED}


def reply_stop(finish_reason: str) -> StopReason:
    """A recorded branch's stop reason, how its last reply ended: the model's own stop
    (``model_stop``), its max_tokens (``length``) or an abort (``aborted``). A harness run's
    branches take the run's instead (``agent_done``, ``agent_error``, ``agent_timeout``)."""
    return REPLY_STOPS.get(finish_reason, StopReason.MODEL_STOP)


@dataclass(frozen=True)
class CallPoint:
    """Where a branch stood at one call: its request's messages and tokens, and after the reply."""

    request_messages: int  # API messages in the call's request (a prefix of the branch's ``seen``)
    prompt_end: int  # tokens up to the end of the request (generation prompt included)
    prompt_record_messages: int  # the record's messages at that point
    reply_end: int  # tokens up to the end of the reply
    reply_record_messages: int
    # a continuation appends: the reply ended on the template's end of turn, or was cut at max_tokens
    # (the next call's delta then starts with the template's whole end of turn); not after an abort
    open: bool
    last_token_text: str | None  # the reply's last token, as text (None after a cut)


@dataclass
class Branch:
    """One append-only branch: its token record and the messages a continuation must start with."""

    index: int
    episode: Episode  # the token record (ids, mask, logprobs, versions, turns, messages)
    conv: ConversationEncoder  # the branch's delta encoder (its tools)
    tools_key: str  # the tools it was encoded with, as canonical JSON
    seen: list[dict[str, Any]] = field(default_factory=list)  # the last request and the reply given
    points: list[CallPoint] = field(default_factory=list)  # one per call
    parent: int | None = None  # the branch it forked from
    reason: Reason = Reason.FIRST
    shared_tokens: int = 0  # leading tokens equal to the parent's
    fork_at: int | None = None  # the tokens the branch took from its parent (None: encoded afresh)
    fork_messages: int = 0  # the record messages it took with them
    tool_calls: int = 0  # tool calls in the replies it sampled itself

    @property
    def calls(self) -> int:
        """Calls answered on this branch."""
        return len(self.points)

    @property
    def open(self) -> bool:
        """Whether a continuation appends (``CallPoint.open``)."""
        return bool(self.points) and self.points[-1].open

    def extends(self, messages: list[dict[str, Any]], tools_key: str) -> bool:
        """Whether ``messages`` continue this branch: its last request, the reply, then more."""
        n = len(self.seen)
        return (
            self.open and tools_key == self.tools_key and len(messages) > n and same(messages[:n], self.seen)
        )

    @property
    def sequence(self) -> list[int]:
        """Every token of the branch: what the engine conditioned on, plus the last reply."""
        return self.episode.record.sequence

    def trajectory(self, session: str) -> Trajectory:
        """The branch as a turnrl trajectory, linked to its place in the session (``branch``)."""
        traj = self.episode.trajectory()
        traj.branch = SessionBranch(
            session, self.index, self.parent, str(self.reason), self.fork_at, self.shared_tokens
        )
        traj.info["num_tool_calls"] = self.tool_calls
        return traj


@dataclass
class Plan:
    """Where a call goes: a branch (extended, or new and not yet in the session), and the tokens to
    append before generating (the new messages' deltas, mask 0; none for a repeated request)."""

    branch: Branch
    added: Encoded
    messages: list[dict[str, Any]]  # the call's messages, as the client sent them
    new: bool

    @property
    def prompt(self) -> list[int]:
        """What the engine conditions on."""
        return self.branch.sequence + self.added.ids


@dataclass
class Reply:
    """The model's reply to one call, parsed for the API."""

    text: str  # the sampled text (the content the rollout records)
    parsed: ParseResult
    call_ids: list[str]
    finish_reason: str  # stop, length or tool_calls
    message: dict[str, Any]  # the reply as an OpenAI chat message


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    """Tools as canonical JSON (key order and spacing do not matter)."""
    return json.dumps(tools or [], sort_keys=True)


def record_call(
    episode: Episode,
    added: Encoded,
    added_text: str,
    gen: Generation,
    text: str,
    versions: list[int],
    call: int,
    message: Message,
    seconds: float = 0.0,
) -> tuple[int, int]:
    """One call into its branch's record, as it was served or as it is read back: what the call
    added (environment tokens), then the reply it sampled (``call``: its place among the session's
    calls; ``message``: the reply as sampled; ``versions``: each token's weight version). The
    record's tokens and messages before the reply."""
    record = episode.record
    if added.ids or added.messages:
        record.add_env(added, added_text, 0.0, 0)
    before = len(record.sequence), len(record.messages)
    record.add_model(gen, text, seconds, versions)
    record.turns[-1].call = call
    record.messages.append(message)
    episode.stop = reply_stop(gen.finish_reason)
    return before


def forked_episode(source: Episode, index: int, point: CallPoint, after_reply: bool) -> Episode:
    """A new branch's episode: ``source``'s tokens up to ``point``'s request (or its reply)."""
    end, kept = (
        (point.reply_end, point.reply_record_messages)
        if after_reply
        else (point.prompt_end, point.prompt_record_messages)
    )
    episode = Episode(source.sample, index)
    episode.prompt_ids = source.prompt_ids
    episode.record = fork_record(source.record, len(source.prompt_ids), end, kept)
    return episode


class Session:
    """One agent's calls: a forest of branches."""

    def __init__(self, name: str, encoder: ChatEncoder, parser: ToolParser | None) -> None:
        self.name = name
        self.encoder = encoder
        self.parser = parser
        self.branches: list[Branch] = []
        self.sampling: SamplingParams | None = None  # the session's own sampling (None: the gateway's)
        self.engine: Engine | None = None  # the session's own engine (None: the gateway's)
        # what its calls' seeds derive from, with the branch and the call: its name, or for a harness
        # run its sample and group member, so that the run, made again, samples the same
        self.seed_key = name
        self.over_budget = False  # a call was refused past the call budget
        self.updated = time.monotonic()  # when it was made, or its last call was answered

    @property
    def calls(self) -> int:
        """Calls answered in this session, over all its branches."""
        return sum(branch.calls for branch in self.branches)

    def plan(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Plan:
        """The branch a call extends (newest first), else a new one forked at the longest exact prefix."""
        key_of_tools = tools_key(tools)
        for branch in reversed(self.branches):
            if branch.extends(messages, key_of_tools):
                added = self._delta(branch.conv, messages, len(branch.seen), branch.episode.last_token_text)
                return Plan(branch, added, messages, new=False)
        fork = self._fork(messages, key_of_tools)
        parent, reason = self._origin(messages, key_of_tools, fork[0] if fork else None)
        index = len(self.branches)
        if fork is None:
            conv = self.encoder.conversation(tools or None)
            template = [template_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
            prompt = conv.prompt(template)
            branch = Branch(index, Episode(Sample(self.name, template), index), conv, key_of_tools)
            branch.parent, branch.reason = parent, reason
            branch.episode.prompt_ids = prompt.ids
            branch.episode.record.start(prompt)
            if parent is not None:
                branch.shared_tokens = _common_prefix(prompt.ids, self.branches[parent].sequence)
            return Plan(branch, Encoded([], []), messages, new=True)
        source, point, after_reply = fork
        branch = Branch(
            index, forked_episode(source.episode, index, point, after_reply), source.conv, key_of_tools
        )
        branch.parent, branch.reason = parent, reason
        branch.shared_tokens = branch.fork_at = len(branch.sequence)
        branch.fork_messages = len(branch.episode.record.messages)
        if not after_reply:  # the same request again: nothing to add
            return Plan(branch, Encoded([], []), messages, new=True)
        added = self._delta(branch.conv, messages, point.request_messages + 1, point.last_token_text)
        return Plan(branch, added, messages, new=True)

    def _delta(
        self, conv: ConversationEncoder, messages: list[dict[str, Any]], start: int, last: str | None
    ) -> Encoded:
        """The delta tokens of ``messages[start:]`` after a reply whose last token was ``last``."""
        new = [template_message(m, f"messages[{i}]") for i, m in enumerate(messages) if i >= start]
        return conv.observation(new, last)

    def _fork(
        self, messages: list[dict[str, Any]], key_of_tools: str
    ) -> tuple[Branch, CallPoint, bool] | None:
        """The longest token-exact prefix of ``messages`` any branch holds: an earlier request sent
        again (False), or an earlier request and its reply followed by more messages (True)."""
        best: tuple[int, Branch, CallPoint, bool] | None = None
        for branch in self.branches:
            if branch.tools_key != key_of_tools:
                continue
            shared = first_difference(messages, branch.seen)
            for point in branch.points:
                n = point.request_messages
                if len(messages) == n and shared >= n:
                    found = (point.prompt_end, branch, point, False)
                elif point.open and shared >= n + 1 and len(messages) > n + 1:
                    found = (point.reply_end, branch, point, True)
                else:
                    continue
                if best is None or found[0] > best[0]:
                    best = found
        return None if best is None else best[1:]

    def _origin(
        self, messages: list[dict[str, Any]], key_of_tools: str, source: Branch | None
    ) -> tuple[int | None, Reason]:
        """The branch a new one comes from (the one it forks from, else the one whose messages it
        shares most) and why it is new."""
        if not self.branches:
            return None, Reason.FIRST
        parent = source or max(self.branches, key=lambda b: (first_difference(messages, b.seen), b.index))
        seen, n = parent.seen, first_difference(messages, parent.seen)
        if key_of_tools != parent.tools_key or _other_system(messages, seen):
            return parent.index, Reason.SUBAGENT
        if n == len(seen) and len(messages) > n:
            return parent.index, Reason.CUT_REPLY
        if n == len(messages):
            retry = any(p.request_messages == n for p in parent.points)
            return parent.index, Reason.RETRY if retry else Reason.TRUNCATION
        start = min(_conversation_start(seen), _conversation_start(messages))
        if n <= start:  # the conversation's start replaced: shorter is a summary, else another agent's
            return parent.index, Reason.COMPACTION if _size(messages) < _size(seen) else Reason.SUBAGENT
        # a run of turns replaced by a message of another kind (a summary in their place)
        replaced = len(seen) - len(messages) >= 2 and messages[n].get("role") != seen[n].get("role")
        return parent.index, Reason.COMPACTION if replaced else Reason.EDIT

    def commit(self, plan: Plan, gen: Generation, seconds: float, versions: list[int]) -> Reply:
        """Append the planned tokens and the sampled reply to the branch (a new one joins the session)."""
        branch = plan.branch
        record = branch.episode.record
        self.updated = time.monotonic()
        if plan.new:
            self.branches.append(branch)
        text, last = branch.conv.assistant_text(gen.token_ids)
        # a reply cut at max_tokens is closed by the template's end of turn, as environment tokens
        # of the next call's delta: what follows it stays exact (see CallPoint.open)
        cut = gen.finish_reason == "length"
        last = None if cut else last
        branch.episode.last_token_text = last
        reply = self._reply(text, gen, branch)
        branch.tool_calls += len(reply.parsed.calls)
        added_text = branch.conv.template.decode(plan.added.ids)
        message = sampled_message(text, reply.parsed.calls, reply.call_ids)
        prompt_end, prompt_messages = record_call(
            branch.episode, plan.added, added_text, gen, text, versions, self.calls, message, seconds
        )
        branch.episode.timings["time/generate"] += seconds
        branch.seen = [*plan.messages, reply.message]
        branch.points.append(
            CallPoint(
                len(plan.messages),
                prompt_end,
                prompt_messages,
                len(record.sequence),
                len(record.messages),
                gen.finish_reason in ("stop", "length"),
                last,
            )
        )
        return reply

    def parse(self, text: str) -> ParseResult:
        """A reply's text as content, reasoning and tool calls (the gateway's parser, else reasoning only)."""
        if self.parser is not None:
            return self.parser.parse(text)
        visible, reasoning = split_reasoning(text)
        return ParseResult(content=visible.strip(), reasoning=reasoning)

    def _reply(self, text: str, gen: Generation, branch: Branch) -> Reply:
        parsed = self.parse(text)
        ids = [f"call_{branch.index}_{branch.calls}_{k}" for k in range(len(parsed.calls))]
        finish = "tool_calls" if parsed.calls and gen.finish_reason == "stop" else str(gen.finish_reason)
        message = reply_message(parsed.content, parsed.reasoning.strip(), parsed.calls, ids)
        return Reply(text, parsed, ids, finish, message)


SYSTEM_ROLES = ("system", "developer")


def _conversation_start(messages: list[dict[str, Any]]) -> int:
    """The index of the first message after the leading system prompt(s)."""
    return next((i for i, m in enumerate(messages) if m.get("role") not in SYSTEM_ROLES), len(messages))


def _other_system(messages: list[dict[str, Any]], seen: list[dict[str, Any]]) -> bool:
    """Whether both start with a system prompt and the two differ (another agent's instructions)."""
    ours, theirs = messages[: _conversation_start(messages)], seen[: _conversation_start(seen)]
    return bool(ours and theirs) and [key(m) for m in ours] != [key(m) for m in theirs]


def _size(messages: list[dict[str, Any]]) -> int:
    """The length of the messages' contents, as JSON (what a summary makes shorter)."""
    return sum(len(json.dumps(m.get("content"), default=str)) for m in messages)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
