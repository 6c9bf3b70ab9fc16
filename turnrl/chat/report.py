"""``turnrl check-template``: is a model's chat template safe for delta encoding?

The report runs scripted conversations through the same encoder the rollout uses (model
replies appended as tokens, observations as deltas) and compares each with a full re-render
of its messages, then shows the probe's findings and every difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from turnrl.chat.check import CheckResult
from turnrl.chat.encoder import ChatEncoder, Tools
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
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>'
Script = list[tuple[str, list[Message]]]


def _tool(content: str, i: int = 0) -> Message:
    return {"role": "tool", "name": "calculator", "tool_call_id": f"call_{i}", "content": content}


SCENARIOS: dict[str, tuple[bool, Script]] = {
    "tool calls": (
        True,
        [(CALL, [_tool("391")]), (CALL + "\n" + CALL, [_tool("391"), _tool("391", 1)]), ("391", [])],
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
            ("<think>\nUse the tool.\n</think>\n\n" + CALL, [_tool("391")]),
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


def end_of_turn_ids(encoder: ChatEncoder, tools: Tools) -> list[int]:
    """The token(s) a model samples to end its turn: the template's assistant close, stripped."""
    return encoder.template.encode(encoder.probe(tools).assistant_close.strip())


def simulate(
    encoder: ChatEncoder, tools: Tools, script: Script, prompt: list[Message] = PROMPT
) -> tuple[list[int], list[int], list[Message], str | None]:
    """Encode a scripted conversation as the rollout does; return prompt ids, response ids,
    messages and the text of the last sampled token."""
    conv = encoder.conversation(tools)
    eot = end_of_turn_ids(encoder, tools)
    prompt_ids = conv.encode_prompt(prompt)
    response: list[int] = []
    messages = list(prompt)
    last: str | None = None
    for reply, observation in script:
        model_ids = encoder.template.encode(reply) + eot
        response += model_ids
        content, last = conv.assistant_text(model_ids)
        messages.append({"role": "assistant", "content": content})
        if observation:
            response += conv.encode_observation(observation, last)
            messages += observation
            last = None
    return prompt_ids, response, messages, last


@dataclass
class TemplateReport:
    """Findings of the probe and the outcome of each scripted conversation."""

    model: str
    findings: list[str]
    results: dict[str, CheckResult] = field(default_factory=dict)

    @property
    def safe(self) -> bool:
        """True when every conversation matched its full re-render (known quirks allowed)."""
        return all(r.ok for r in self.results.values())

    def text(self) -> str:
        """The report as the CLI prints it."""
        lines = [f"chat template of {self.model}", "", "probe:"]
        lines += [f"  {f}" for f in self.findings]
        lines.append("")
        for name, result in self.results.items():
            expected = sum(1 for h in result.hunks if h.expected)
            status = "ok" if result.ok else f"MISMATCH ({result.mismatches})"
            note = (
                f", {expected} expected difference(s) from reasoning the template rewrites"
                if expected
                else ""
            )
            lines.append(f"{name}: {status}{note}")
            if result.diff:
                lines += [f"    {d}" for d in result.diff.splitlines()]
        verdict = (
            "SAFE for delta encoding"
            if self.safe
            else "NOT SAFE: the rollout's tokens differ from a re-render"
        )
        lines += ["", verdict]
        return "\n".join(lines)


def report_for(encoder: ChatEncoder, model: str, tools: Tools = None) -> TemplateReport:
    """Run every scenario through ``encoder``."""
    tools = tools or DEFAULT_TOOLS
    report = TemplateReport(model, encoder.probe(tools).report())
    for name, (uses_tools, script) in SCENARIOS.items():
        scenario_tools = tools if uses_tools else None
        prompt_ids, response, messages, last = simulate(encoder, scenario_tools, script)
        conv = encoder.conversation(scenario_tools)
        report.results[name] = conv.check(prompt_ids, response, messages, last_token_text=last, mode="strict")
    return report


def check_template(
    tokenizer: Any,
    tools: Tools = None,
    template_kwargs: dict[str, Any] | None = None,
    name: str | None = None,
) -> TemplateReport:
    """Report on ``tokenizer``'s chat template (``name``: what the report calls the model)."""
    label = name or str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
    return report_for(ChatEncoder(tokenizer, template_kwargs), label, tools)
