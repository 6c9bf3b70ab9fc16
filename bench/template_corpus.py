"""check-template over the chat-template corpus: a verdict per family, and what encoding costs.

For every family of tests/template_corpus.py (real templates, paired tokenizers; see
tests/templates/PROVENANCE.md): the path each observation role takes (fast: one tokenizer call
on lead + content + close; slow: a re-render of a fixed base each turn), the outcome of each
check-template scenario (n/a: a turn the template cannot render, so no model of the family
writes it; "expected": differences the check classifies, see docs/templates.md), and the median
cost of encoding one observation (user turn and tool result) on the rollout's encoder. Prints a
Markdown table (docs/templates.md holds its last run).

    .venv/bin/python bench/template_corpus.py [--repeats 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the corpus lives with the tests

from template_corpus import FAMILIES, parser_of, tokenizer_for

from turnrl.chat import ChatEncoder
from turnrl.chat.probe import call_id
from turnrl.chat.report import DEFAULT_TOOLS, SCENARIOS, TemplateReport, check_template
from turnrl.chat.template import ChatTemplateError

OBSERVATION = "The calculator says 391, and the next number to add is 17."


def outcome(report: TemplateReport, scenario: str) -> str:
    if scenario in report.unsupported:
        return "n/a"
    if scenario in report.errors:
        return "raises"
    result = report.results[scenario]
    if not result.ok:
        return f"**{result.mismatches} mismatch**"
    expected = sum(1 for h in result.hunks if h.expected)
    return f"ok ({expected} expected)" if expected else "ok"


def paths(encoder: ChatEncoder) -> str:
    try:
        probe = encoder.probe(DEFAULT_TOOLS)
    except ChatTemplateError:
        return "cannot probe"
    return " / ".join(f"{role} {'fast' if role in probe.shapes else 'slow'}" for role in ("user", "tool"))


def observation_cost(encoder: ChatEncoder, role: str, repeats: int) -> float | None:
    """Median ms to encode one observation of ``role`` after a model turn."""
    conv = encoder.conversation(DEFAULT_TOOLS)
    message: dict[str, Any] = {"role": role, "content": OBSERVATION}
    if role == "tool":
        message |= {"name": "calculator", "tool_call_id": call_id(0)}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        try:
            conv.encode_observation([message], None)
        except ChatTemplateError:
            return None
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    head = ["family", "own tokenizer", "parser", "paths", *SCENARIOS, "verdict", "user ms", "tool ms"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    verdicts = {"SAFE": 0, "SAFE where it renders": 0, "NOT SAFE": 0}
    for family in FAMILIES:
        tok = tokenizer_for(family)
        encoder = ChatEncoder(tok)
        tools = DEFAULT_TOOLS if family.needs_tools else None
        report = check_template(tok, tools, name=family.name)
        verdict = report.text().splitlines()[-1]
        short = next(v for v in ("NOT SAFE", "SAFE where it renders", "SAFE") if verdict.startswith(v))
        verdicts[short] += 1
        costs = [observation_cost(encoder, role, args.repeats) for role in ("user", "tool")]
        row = [
            family.name,
            "yes" if family.real else "stand-in",
            parser_of(family) or "-",
            paths(encoder),
            *(outcome(report, s) for s in SCENARIOS),
            short,
            *("raises" if c is None else f"{c:.3f}" for c in costs),
        ]
        print("| " + " | ".join(row) + " |", flush=True)
    print()
    print(", ".join(f"{k}: {v}" for k, v in verdicts.items()) + f" (of {len(FAMILIES)} families)")


if __name__ == "__main__":
    main()
