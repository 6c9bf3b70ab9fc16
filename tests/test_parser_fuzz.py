"""Tool-call parsers under generated and adversarial text: they never raise (a malformed call is an
error line for the model), never count a call written inside the reasoning, read back every
well-formed call exactly, and stay linear in the text (no input takes a second).

hypothesis builds turns from the pieces that matter (tags, JSON punctuation, call objects, reasoning
tags, noise): 2,000 examples of 5 inputs each per parser (a turn, and that turn behind or before
reasoning in four ways), plus 500 of well-formed calls, so 10,500 inputs per parser; the
adversarial cases are the degenerate outputs a model produces (a tag repeated thousands of times,
JSON nested 100,000 deep, 1,000 calls in one turn). The inputs are the same on every run.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnrl.tools.base import ParseResult
from turnrl.tools.parsers import get_parser

PARSERS = ["hermes", "qwen3_coder", "llama3_json"]
PIECES = [
    "<tool_call>", "</tool_call>", "<function=", "<function=f>", "</function>", "<parameter=",
    "<parameter=a>", "</parameter>", "<|python_tag|>", "<|eom_id|>", "<|eot_id|>", "{", "}", "[", "]",
    '"', ":", ",", ";", '"name"', '"arguments"', '"parameters"', "null", "1e999", "\\", "\n", " ", "\x00",
]  # fmt: skip
REASONING = ["<think>", "</think>"]

names = st.text(st.characters(codec="utf-8", exclude_characters="<>\n"), min_size=1, max_size=8).filter(
    lambda n: n.strip() == n and n.strip()
)
# Argument text may hold anything but the formats' own tags: in a tag-based format a tag inside a
# JSON string still reads as structure (and a reasoning tag makes the rest of the turn reasoning,
# the safe side: such a call is not run).
TAGS = [*PIECES[:11], *REASONING]
plain_text = st.text(max_size=8).filter(lambda t: not any(tag in t for tag in TAGS))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | plain_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
keys = st.text(st.characters(exclude_characters="<>\n"), min_size=1, max_size=6).filter(
    lambda k: k.strip() == k
)
arguments = st.dictionaries(keys, json_values, max_size=3)


def written(name: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """``calls`` written the way the format ``name`` writes them."""
    if name == "llama3_json":  # one python tag, calls separated by ";"
        return "<|python_tag|>" + ";".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    if name == "hermes":
        return "".join(f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>" for n, a in calls)
    return "".join(
        f"<tool_call><function={n}>"
        + "".join(f"<parameter={k}>\n{json.dumps(v)}\n</parameter>" for k, v in a.items())
        + "</function></tool_call>"
        for n, a in calls
    )


def without(text: str, *tags: str) -> str:
    """``text`` with every ``tags`` removed, also those that removing others would form."""
    while any(tag in text for tag in tags):
        for tag in tags:
            text = text.replace(tag, "")
    return text


def turns(name: str, reasoning: bool) -> st.SearchStrategy[str]:
    """Model turns: tags, punctuation, calls and noise in any order (with or without reasoning tags)."""
    pieces = PIECES + (REASONING if reasoning else [])
    call = st.builds(lambda n, a: written(name, [(n, a)]), names, arguments)
    text = st.lists(st.one_of(st.sampled_from(pieces), st.text(max_size=12), call), max_size=24).map("".join)
    return text if reasoning else text.map(lambda t: without(t, *REASONING))


def well_formed(result: ParseResult) -> list[tuple[str, dict[str, Any]]]:
    """The calls of a result, after checking what every result must be."""
    assert all(isinstance(e, str) and e for e in result.errors)
    assert [c.id for c in result.calls] == [f"call{i:05d}" for i in range(len(result.calls))]
    assert all(isinstance(c.name, str) and c.name and isinstance(c.arguments, dict) for c in result.calls)
    assert isinstance(result.content, str)
    return [(c.name, c.arguments) for c in result.calls]


FUZZ = settings(
    max_examples=2_000,
    deadline=1000,  # milliseconds: no input may take a second
    derandomize=True,  # the same inputs on every run: CI cannot be green by luck
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("name", PARSERS)
def test_generated_turns_never_raise_and_reasoning_never_calls(name: str) -> None:
    parser = get_parser(name)

    @FUZZ
    @given(visible=turns(name, reasoning=False), hidden=turns(name, reasoning=True))
    def check(visible: str, hidden: str) -> None:
        calls = well_formed(parser.parse(visible))
        well_formed(parser.parse(hidden + visible))  # any mix of reasoning tags: never raises
        inside = without(hidden, "</think>")  # a closed block's body holds no closing tag
        assert well_formed(parser.parse(f"<think>{inside}</think>{visible}")) == calls
        assert well_formed(parser.parse(f"{visible}<think>{inside}")) == calls  # unclosed: all reasoning
        before = without(inside, *REASONING)
        assert well_formed(parser.parse(f"{before}</think>{visible}")) == calls  # a lone </think>

    check()


@pytest.mark.parametrize("name", PARSERS)
def test_well_formed_calls_read_back_exactly(name: str) -> None:
    parser = get_parser(name)

    @settings(FUZZ, max_examples=500)
    @given(calls=st.lists(st.tuples(names, arguments), min_size=1, max_size=4))
    def check(calls: list[tuple[str, dict[str, Any]]]) -> None:
        assert well_formed(parser.parse(written(name, calls))) == calls

    check()


ADVERSARIAL = {
    "deep JSON": "<tool_call>" + "[" * 100_000 + "</tool_call>",
    "deep JSON arguments": '<tool_call>{"name": "f", "arguments": "' + "[" * 100_000 + '"}</tool_call>',
    "deep JSON, llama": '{"name": "f", "parameters": ' + "[" * 100_000,
    "deep JSON value": "<tool_call><function=f><parameter=a>"
    + "[" * 100_000
    + "</parameter></function></tool_call>",
    "20,000 unclosed <tool_call>": "<tool_call>" * 20_000,
    "20,000 unclosed <function=": "<tool_call>" + "<function=" * 20_000 + "></tool_call>",
    "20,000 unclosed <parameter=": "<tool_call><function=f>"
    + "<parameter=" * 20_000
    + "</function></tool_call>",
    "20,000 parameters": "<tool_call><function=f>" + "<parameter=a>x" * 20_000 + "</function></tool_call>",
    "1,000 calls": '<tool_call>{"name": "f", "arguments": {}}</tool_call>' * 1000,
    "20,000 <think>": "<think>" * 20_000,
    "20,000 </think>": "</think>" * 20_000,
    "5,000 llama calls": "<|python_tag|>" + '{"name": "f", "parameters": {}};' * 5000,
    "1 MB of braces": "x{" * 500_000,
}


@pytest.mark.parametrize("name", PARSERS)
@pytest.mark.parametrize("case", list(ADVERSARIAL))
def test_degenerate_turns_are_parsed_in_one_pass(name: str, case: str) -> None:
    started = time.perf_counter()
    result = get_parser(name).parse(ADVERSARIAL[case])
    seconds = time.perf_counter() - started
    well_formed(result)
    assert seconds < 1.0, f"{case}: {seconds:.2f}s"  # a regex rescanning from every tag took 17-38 s
