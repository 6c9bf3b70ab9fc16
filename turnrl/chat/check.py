"""The end-of-trajectory sanity check: incremental tokens against a full re-render."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from difflib import SequenceMatcher
from typing import Any, Literal

from turnrl.chat.template import ChatTemplate

CheckMode = Literal["strict", "ignore_strippable", "disable"]
THINK_RE = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
MAX_DIFF_CHARS = 4000
MAX_MERGE = 64  # opcodes one re-tokenized span may be split into


@dataclass
class Hunk:
    """One place where the two token sequences differ."""

    kind: str  # same_text | control_text | model_turn | history_rewrite | whitespace | think | text
    expected: bool  # explained by a known quirk of the template
    start: int  # token index in the incremental sequence
    incremental: str  # text on the rollout side
    rerender: str  # text on the full re-render side


@dataclass
class CheckResult:
    """Outcome of comparing the rollout's tokens with a full re-render of its messages."""

    mode: str  # strict | ignore_strippable | disable
    ok: bool  # no difference that counts in this mode
    hunks: list[Hunk] = field(default_factory=list)  # every difference found
    diff: str = ""  # readable diff of the differences that count

    @property
    def mismatches(self) -> int:
        """How many differences count in this mode."""
        return sum(1 for h in self.hunks if counts(h, self.mode))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {**asdict(self), "mismatches": self.mismatches}


def counts(hunk: Hunk, mode: str) -> bool:
    """Whether a difference counts as a mismatch in ``mode``."""
    if hunk.expected or mode == "disable":
        return False
    if mode == "ignore_strippable":
        return hunk.kind in ("text", "think")
    return True


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def classify(incremental: str, rerender: str) -> str:
    """The kind of a difference: same_text, whitespace, think or text. Texts equal under Unicode
    NFC are the same text: tokenizers normalize what they encode (a sampled U+232A comes back as
    U+3009), so a re-render cannot reproduce such a token the model sampled."""
    if unicodedata.normalize("NFC", incremental) == unicodedata.normalize("NFC", rerender):
        return "same_text"
    if _squash(incremental) == _squash(rerender):
        return "whitespace"
    if _squash(THINK_RE.sub("", incremental)) == _squash(THINK_RE.sub("", rerender)):
        return "think"
    return "text"


def _opcodes(a: list[int], b: list[int]) -> list[tuple[str, int, int, int, int]]:
    """difflib's opcodes of ``a`` against ``b``, diffing only what lies between their common start
    and end: the differences of a trajectory are local, and difflib (without autojunk, which would
    hide repeated tokens) is quadratic on long repetitive spans such as a tool output of one letter."""
    start = 0
    limit = min(len(a), len(b))
    while start < limit and a[start] == b[start]:
        start += 1
    end = 0
    while end < limit - start and a[len(a) - 1 - end] == b[len(b) - 1 - end]:
        end += 1
    middle = SequenceMatcher(None, a[start : len(a) - end], b[start : len(b) - end], autojunk=False)
    ops: list[tuple[str, int, int, int, int]] = [
        (tag, i1 + start, i2 + start, j1 + start, j2 + start) for tag, i1, i2, j1, j2 in middle.get_opcodes()
    ]
    if start:
        ops.insert(0, ("equal", 0, start, 0, start))
    if end:
        ops.append(("equal", len(a) - end, len(a), len(b) - end, len(b)))
    return ops


def compare(
    template: ChatTemplate,
    incremental_ids: list[int],
    reference_ids: list[int],
    mode: CheckMode,
    reasoning_rewritten: bool,
    sampled: Sequence[int] | None = None,
) -> CheckResult:
    """Diff two token sequences.

    Differences are expected (reported, not counted) when they are <think> blocks a template
    rewrites by design (``reasoning_rewritten``), or when the text is the same and every
    differing token was sampled by the model (``sampled[i] == 1``): the model chose a
    non-canonical tokenization, which the rollout keeps exactly as sampled. Any other difference
    wholly inside sampled tokens is the template's own spelling of a model turn in history
    (``model_turn``: text beside a call dropped, a call re-spelled, gpt-oss's ``<|return|>``
    written as ``<|end|>``): the rollout trains on what the model sampled, which is what the
    engine conditioned on.
    """
    if mode == "disable":
        return CheckResult(mode=mode, ok=True)
    if incremental_ids == reference_ids:
        return CheckResult(mode=mode, ok=True)
    ops = _opcodes(incremental_ids, reference_ids)
    hunks = []
    k = 0
    while k < len(ops):
        if ops[k][0] == "equal":
            k += 1
            continue
        end = _merged_end(template, incremental_ids, reference_ids, ops, k, reasoning_rewritten)
        _, i1, _, j1, _ = ops[k]
        _, _, i2, _, j2 = ops[end]
        inc, ref = template.decode(incremental_ids[i1:i2]), template.decode(reference_ids[j1:j2])
        kind = classify(inc, ref)
        by_model = _by_model(sampled, i1, i2)
        if kind == "same_text" and _spelled_controls(template, incremental_ids[i1:i2], reference_ids[j1:j2]):
            kind = "control_text"  # content spelling a control token: kept as text, never a turn
        elif by_model and kind != "same_text" and not (kind == "think" and reasoning_rewritten):
            kind = "model_turn"  # the template's own spelling of what the model wrote
        expected = (
            (kind == "think" and reasoning_rewritten)
            or (kind == "same_text" and by_model)
            or kind in ("control_text", "model_turn")
        )
        hunks.append(Hunk(kind, expected, i1, inc, ref))
        k = end + 1
    result = CheckResult(mode=mode, ok=True, hunks=hunks)
    result.ok = result.mismatches == 0
    result.diff = render_diff(template, incremental_ids, result)
    return result


def _by_model(sampled: Sequence[int] | None, i1: int, i2: int) -> bool:
    """Whether the rollout's tokens ``[i1, i2)`` of a difference lie inside what the model sampled:
    every one of them sampled, or, where the re-render only inserted text, the tokens on both sides
    of the insertion (a Qwen3 template writes ``\n</think>\n\n`` where the model sampled a bare
    ``</think>`` mid-turn)."""
    if sampled is None:
        return False
    if i2 > i1:
        return all(sampled[i] for i in range(i1, i2))
    return 0 < i1 < len(sampled) and bool(sampled[i1 - 1]) and bool(sampled[i1])


def _spelled_controls(template: ChatTemplate, incremental: list[int], reference: list[int]) -> bool:
    """Whether the re-render made control tokens of text the rollout kept as text: the template
    renders content verbatim and the tokenizer then parses ``<|im_end|>`` spelled in a tool result
    as the real token, forging a turn; the rollout encodes content as text, which is the safe one."""
    special = template.special_ids
    return sum(t in special for t in reference) > sum(t in special for t in incremental)


def _merged_end(
    template: ChatTemplate,
    incremental_ids: list[int],
    reference_ids: list[int],
    ops: Sequence[tuple[str, int, int, int, int]],
    first: int,
    reasoning_rewritten: bool,
) -> int:
    """The last opcode of the difference starting at ``ops[first]``: itself, or a later one when the
    span from ``first`` to it is one explained difference (the same text, or only <think> blocks
    that the template rewrites). A token diff can align the two sides on tokens they happen to
    share (a ``"`` of two tokenizations of one text, a repeated tool call before and after a
    rewritten <think> block), which splits one such difference into hunks that each look like
    different text."""
    explained = ("same_text", "think") if reasoning_rewritten else ("same_text",)
    for last in range(first, min(first + MAX_MERGE, len(ops))):
        if ops[last][0] == "equal":
            continue
        i1, j1, i2, j2 = ops[first][1], ops[first][3], ops[last][2], ops[last][4]
        inc, ref = template.decode(incremental_ids[i1:i2]), template.decode(reference_ids[j1:j2])
        if classify(inc, ref) in explained:
            return last
    return first


def render_diff(template: ChatTemplate, incremental_ids: list[int], result: CheckResult) -> str:
    """A readable diff: position, kind, a little context, both sides."""
    lines: list[str] = []
    for h in result.hunks:
        if not counts(h, result.mode):
            continue
        context = template.decode(incremental_ids[max(0, h.start - 8) : h.start])
        lines.append(f"@@ token {h.start} [{h.kind}] after ...{context[-60:]!r}")
        lines.append(f"- rollout:   {h.incremental!r}")
        lines.append(f"+ re-render: {h.rerender!r}")
    text = "\n".join(lines)
    return text if len(text) <= MAX_DIFF_CHARS else text[:MAX_DIFF_CHARS] + "\n... (diff cut)"
