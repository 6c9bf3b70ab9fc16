"""``turnrl check-template``: is a model's chat template safe for delta encoding?

The report runs scripted conversations through the same encoder the rollout uses (model
replies appended as tokens, observations as deltas) and compares each with a full re-render
of its messages, then shows the probe's findings and every difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from turnrl.chat.check import CheckResult, counts
from turnrl.chat.encoder import ChatEncoder, Tools
from turnrl.chat.probe import TemplateProbe, call_id, model_turn
from turnrl.chat.template import ChatTemplateError
from turnrl.tools.parser_base import split_reasoning
from turnrl.tools.parsers import parser_for_template
from turnrl.types import Message

DEFAULT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
PROMPT: list[Message] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 17 * 23?"},
]


class UnsupportedTurn(ChatTemplateError):
    """The template cannot render a scripted model turn (Llama 3.x: two calls in one turn), so a
    model of the family never writes it: the scenario does not apply."""


Reply = str | Message
"""A scripted model turn: text the model writes, or an assistant message with ``tool_calls``, which
the model writes as its family's template renders it (``probe.model_turn``)."""
Script = list[tuple[Reply, list[Message]]]


def _tool(content: str, i: int = 0) -> Message:
    return {"role": "tool", "name": "calculator", "tool_call_id": call_id(i), "content": content}


def _calls(*expressions: str, text: str = "") -> Message:
    """An assistant turn calling the calculator once per expression, with ``text`` beside."""
    calls = [
        {
            "id": call_id(i),
            "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": e}},
        }
        for i, e in enumerate(expressions)
    ]
    return {"role": "assistant", "content": text, "tool_calls": calls}


SCENARIOS: dict[str, tuple[bool, Script]] = {
    "tool calls": (
        True,
        [
            (_calls("17 * 23", text="Let me compute."), [_tool("391")]),
            (_calls("391 + 1"), [_tool("392")]),
            ("17 * 23 = 391.", []),
        ],
    ),
    "parallel tool calls": (
        True,
        [(_calls("17 * 23", "2 + 2"), [_tool("391"), _tool("4", 1)]), ("391, 4", [])],
    ),
    "user turns": (
        False,
        [
            ("12", [{"role": "user", "content": "higher"}]),
            ("15", [{"role": "user", "content": "lower"}]),
            ("14", []),
        ],
    ),
    "reasoning + tools": (
        True,
        [
            (_calls("17 * 23", text="<think>\nUse the tool.\n</think>\n\n"), [_tool("391")]),
            ("<think>\nDone.\n</think>\n\n391", []),
        ],
    ),
    "reasoning + user turns": (
        False,
        [
            ("<think>\nStart low.\n</think>\n\n12", [{"role": "user", "content": "higher"}]),
            ("<think>\nOk.\n</think>\n\n15", []),
        ],
    ),
}
ROLES = {
    "tool": ("tool calls", "parallel tool calls", "reasoning + tools"),
    "user": ("user turns", "reasoning + user turns"),
}


def stop_ids(encoder: ChatEncoder, close: str) -> list[int]:
    """The token(s) a model samples to end a turn the template closes with ``close``: its first
    token when that is a control token (a model stops there: Phi-3.5's close is ``<|end|>`` then
    ``\n<|endoftext|>``), else the whole close, stripped."""
    ids = encoder.template.encode(close.strip())
    return ids[:1] if ids and ids[0] in encoder.template.special_ids else ids


def end_of_turn_ids(encoder: ChatEncoder, tools: Tools) -> list[int]:
    """The token(s) a model samples to end a plain turn (see ``stop_ids``)."""
    return stop_ids(encoder, encoder.probe(tools).assistant_close)


@dataclass
class Simulated:
    """A scripted conversation encoded as the rollout encodes it."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]  # 1 for the scripted model tokens, 0 for observation deltas
    messages: list[Message]
    last_token_text: str | None  # the text of the last model token (None after an observation)


def simulate(encoder: ChatEncoder, tools: Tools, script: Script, prompt: list[Message] = PROMPT) -> Simulated:
    """Encode a scripted conversation as the rollout does: model replies as tokens (the replies
    tokenized alone, as a model may sample them), observations as deltas."""
    conv = encoder.conversation(tools)
    prompt = conv.probe.prompt(prompt)
    out = Simulated(conv.encode_prompt(prompt), [], [], list(prompt), None)
    for reply, observation in script:
        model_ids, calls = scripted_turn(encoder, conv.probe, tools, reply)
        out.response_ids += model_ids
        out.loss_mask += [1] * len(model_ids)
        content, out.last_token_text = conv.assistant_text(model_ids)
        message: Message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        out.messages.append(message)
        if observation:
            delta = conv.encode_observation(observation, out.last_token_text)
            out.response_ids += delta
            out.loss_mask += [0] * len(delta)
            out.messages += observation
            out.last_token_text = None
    return out


def scripted_turn(
    encoder: ChatEncoder, probe: TemplateProbe, tools: Tools, reply: Reply
) -> tuple[list[int], list[Any]]:
    """A scripted turn's tokens as a model of the family writes them, its stop token included, and
    its structured calls."""
    if isinstance(reply, str):  # the reply prefix (Functionary's recipient line) is the model's too
        text = reasoning_turn(encoder, probe, tools, reply) or probe.reply_prefix + reply
        close, calls = probe.assistant_close, []
    else:
        calls = list(reply.get("tool_calls") or [])
        try:
            text, close = model_turn(encoder.template, tools, probe.base, reply, probe.assistant_close)
        except ChatTemplateError as exc:
            raise UnsupportedTurn(
                f"the template renders no turn with {len(calls)} tool calls: {exc}"
            ) from exc
    return encoder.template.encode(text) + stop_ids(encoder, close), calls


def reasoning_turn(encoder: ChatEncoder, probe: TemplateProbe, tools: Tools, reply: str) -> str | None:
    """A reply with a ``<think>`` block as a model of the family writes it: the template's render
    of it as the last turn, where that keeps the reasoning (GLM writes ``\n<think>...</think>\n``
    after its header; a template whose generation prompt opens ``<think>`` leaves the model the
    rest). None for a reply without reasoning, or where the template drops the reasoning or cannot
    render the turn: the reply is then written as it stands."""
    thought = split_reasoning(reply)[1]
    if not thought:
        return None
    message: Message = {"role": "assistant", "content": reply}
    try:
        text, _ = model_turn(encoder.template, tools, probe.base, message, probe.assistant_close)
    except ChatTemplateError:
        return None
    return text if thought in text else None


@dataclass
class TemplateReport:
    """Findings of the probe and the outcome of each scripted conversation."""

    model: str
    findings: list[str]
    results: dict[str, CheckResult] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # scenario -> what the template raised
    unsupported: dict[str, str] = field(default_factory=dict)  # scenario -> the turn no model writes

    @property
    def safe(self) -> bool:
        """True when every conversation matched its full re-render (known quirks allowed) and the
        template rendered every one."""
        return all(r.ok for r in self.results.values()) and not self.errors

    def role_verdict(self, role: str) -> str:
        """SAFE, NOT SAFE or raises, over the scenarios whose observations are of ``role``."""
        names = ROLES[role]
        failed = [n for n in names if n in self.results and not self.results[n].ok]
        if failed:
            return f"NOT SAFE ({', '.join(failed)})"
        raised = [n for n in names if n in self.errors]
        return f"SAFE where it renders (raises on: {', '.join(raised)})" if raised else "SAFE"

    def text(self) -> str:
        """The report as the CLI prints it."""
        lines = [f"chat template of {self.model}", "", "probe:"]
        lines += [f"  {f}" for f in self.findings]
        lines.append("")
        for name, result in self.results.items():
            expected = sum(1 for h in result.hunks if h.expected)
            status = "ok" if result.ok else f"MISMATCH ({result.mismatches})"
            kinds = ", ".join(sorted({h.kind for h in result.hunks if h.expected}))
            note = f", {expected} expected difference(s) ({kinds})" if expected else ""
            lines.append(f"{name}: {status}{note}")
            if result.diff:
                lines += [f"    {d}" for d in result.diff.splitlines()]
        for name, error in self.errors.items():
            lines.append(f"{name}: the template cannot render it: {error}")
        for name, why in self.unsupported.items():
            lines.append(f"{name}: does not apply: {why}")
        lines += ["", "by role:"] + [f"  {role}: {self.role_verdict(role)}" for role in ROLES]
        hunks = [h for r in self.results.values() for h in r.hunks]
        modes = ", ".join(f"{m} {sum(counts(h, m) for h in hunks)}" for m in ("strict", "ignore_strippable"))
        lines.append(f"mismatches by check mode: {modes}")
        if not all(r.ok for r in self.results.values()):
            verdict = "NOT SAFE: the rollout's tokens differ from a re-render"
        elif self.errors:
            verdict = f"SAFE where it renders; the template raises on: {', '.join(self.errors)}"
        else:
            verdict = "SAFE for delta encoding"
        lines += ["", verdict]
        return "\n".join(lines)


def report_for(encoder: ChatEncoder, model: str, tools: Tools = None) -> TemplateReport:
    """Run every scenario through ``encoder``."""
    tools = tools or DEFAULT_TOOLS
    try:
        findings = encoder.probe(tools).report()
    except ChatTemplateError as exc:
        findings = [f"the template cannot render a conversation with tools: {exc}"]
    else:
        findings += _dropped_tools(encoder, tools) + _call_format(encoder, tools)
    report = TemplateReport(model, findings)
    for name, (uses_tools, script) in SCENARIOS.items():
        scenario_tools = tools if uses_tools else None
        try:
            sim = simulate(encoder, scenario_tools, script)
            conv = encoder.conversation(scenario_tools)
            report.results[name] = conv.check(
                sim.prompt_ids,
                sim.response_ids,
                sim.messages,
                last_token_text=sim.last_token_text,
                mode="strict",
                loss_mask=sim.loss_mask,
            )
        except UnsupportedTurn as exc:
            report.unsupported[name] = str(exc)
        except ChatTemplateError as exc:
            report.errors[name] = str(exc)
    return report


def _dropped_tools(encoder: ChatEncoder, tools: Tools) -> list[str]:
    """A warning when the rendered prompt does not name every tool it was given."""
    names = [str(t.get("function", t).get("name", "")) for t in tools or []]
    text = encoder.template.render(encoder.probe(tools).prompt(PROMPT), tools, True)
    missing = [n for n in names if n and n not in text]
    if not missing:
        return []
    listed = ", ".join(missing)
    return [f"WARNING: drops the tools it is given ({listed}): the model never sees their schemas"]


def _call_format(encoder: ChatEncoder, tools: Tools) -> list[str]:
    """The tool-call format the template renders (the parser to configure), and a warning when
    it drops the calls of a model turn from history."""
    parser = parser_for_template(str(encoder.template.tokenizer.chat_template))
    lines = [
        f"tool calls: parser '{parser}'"
        if parser
        else "tool calls: no known tool-call format in the template"
    ]
    probe = encoder.probe(tools)
    try:
        text, _ = model_turn(encoder.template, tools, probe.base, _calls("17 * 23"), probe.assistant_close)
    except ChatTemplateError as exc:
        return [*lines, f"WARNING: cannot render a model turn with a tool call: {exc}"]
    if "calculator" not in text:
        lines.append(
            "WARNING: drops the tool calls of earlier turns from history: the rollout trains on what the"
            " model wrote, a chat server would show it a history without its calls"
        )
    return lines


def check_template(
    tokenizer: Any,
    tools: Tools = None,
    template_kwargs: dict[str, Any] | None = None,
    name: str | None = None,
) -> TemplateReport:
    """Report on ``tokenizer``'s chat template (``name``: what the report calls the model)."""
    label = name or str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
    return report_for(ChatEncoder(tokenizer, template_kwargs), label, tools)
