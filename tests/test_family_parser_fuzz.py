"""The family tool-call formats (Mistral, DeepSeek, Kimi, gpt-oss, Nemotron, Granite, Command-R,
Functionary, GLM, MiniMax, DSML, Seed-OSS, pythonic, LFM2, Gemma 4) under generated and degenerate
text, as tests/test_parser_fuzz.py does for Hermes, Qwen3-Coder and Llama 3: they never raise, never
run a call written inside the family's reasoning, read back every well-formed call exactly, and
stay linear in the text. The inputs are the same on every run (derandomized)."""

from __future__ import annotations

import json
import keyword
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnrl.tools.base import ParseResult
from turnrl.tools.parsers import get_parser

Calls = list[tuple[str, dict[str, Any]]]
Q = '<|"|>'


def _gemma(value: Any) -> str:
    if isinstance(value, str):
        return Q + value + Q
    if isinstance(value, dict):
        return "{" + ",".join(f"{Q}{k}{Q}:{_gemma(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_gemma(v) for v in value) + "]"
    return json.dumps(value)


def _pythonic(calls: Calls) -> str:
    return "[" + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls) + "]"


def _tagged(calls: Calls, invoke: str, parameter: str, extra: str = "") -> str:
    return "".join(
        f'<{invoke} name="{n}">'
        + "".join(f'<{parameter} name="{k}"{extra}>{json.dumps(v)}</{parameter}>' for k, v in a.items())
        + f"</{invoke}>"
        for n, a in calls
    )


DS = "<｜DSML｜"
WRITERS: dict[str, Callable[[Calls], str]] = {
    "mistral": lambda c: "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in c),
    "deepseek_v3": lambda c: (
        "<｜tool▁calls▁begin｜>"
        + "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a)}<｜tool▁call▁end｜>" for n, a in c)
        + "<｜tool▁calls▁end｜>"
    ),
    "kimi_k2": lambda c: (
        "<|tool_calls_section_begin|>"
        + "".join(
            f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a)}<|tool_call_end|>"
            for i, (n, a) in enumerate(c)
        )
        + "<|tool_calls_section_end|>"
    ),
    "harmony": lambda c: "".join(
        f"<|start|>assistant<|channel|>commentary to=functions.{n} <|constrain|>json"
        f"<|message|>{json.dumps(a)}<|call|>"
        for n, a in c
    ),
    "nemotron": lambda c: (
        "<TOOLCALL>" + json.dumps([{"name": n, "arguments": a} for n, a in c]) + "</TOOLCALL>"
    ),
    "granite": lambda c: "<|tool_call|>" + json.dumps([{"name": n, "arguments": a} for n, a in c]),
    "command_r": lambda c: (
        "<|START_ACTION|>"
        + json.dumps(
            [{"tool_call_id": str(i), "tool_name": n, "parameters": a} for i, (n, a) in enumerate(c)]
        )
        + "<|END_ACTION|>"
    ),
    "functionary": lambda c: "".join(f">>>{n}\n{json.dumps(a)}" for n, a in c),
    "glm45": lambda c: "".join(
        f"<tool_call>{n}\n"
        + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{json.dumps(v)}</arg_value>\n" for k, v in a.items())
        + "</tool_call>"
        for n, a in c
    ),
    "minimax_m2": lambda c: (
        "<minimax:tool_call>" + _tagged(c, "invoke", "parameter") + "</minimax:tool_call>"
    ),
    "deepseek_v32": lambda c: (
        f"{DS}function_calls>"
        + _tagged(c, "｜DSML｜invoke", "｜DSML｜parameter", ' string="false"')
        + f"</{DS[1:]}function_calls>"
    ),
    "seed_oss": lambda c: "".join(
        f"<seed:tool_call><function={n}>"
        + "".join(f"<parameter={k}>{json.dumps(v)}</parameter>" for k, v in a.items())
        + "</function></seed:tool_call>"
        for n, a in c
    ),
    "pythonic": _pythonic,
    "lfm2": lambda c: f"<|tool_call_start|>{_pythonic(c)}<|tool_call_end|>",
    "gemma4": lambda c: "".join(f"<|tool_call>call:{n}{_gemma(a)}<tool_call|>" for n, a in c),
}
PIECES = [
    "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>", "<|start|>", "<|channel|>", "<|message|>", " to=functions.f", "<|call|>", "<|end|>",
    "<TOOLCALL>", "</TOOLCALL>", "<|tool_call|>", "<|START_ACTION|>", "<|END_ACTION|>", ">>>", "\n",
    "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "<minimax:tool_call>", '<invoke name="f">', "</invoke>", '<parameter name="a">', "</parameter>",
    f"{DS}function_calls>", f"{DS}invoke", "<seed:tool_call>", "<function=f>", "<parameter=a>",
    "<|tool_call_start|>", "<|tool_call_end|>", "[f(a=1)]", "<|tool_call>", "<tool_call|>", "call:f{", Q,
    "{", "}", "[", "]", "(", ")", '"', ":", ",", "=", "1e999", "\\", " ", "\x00",
]  # fmt: skip

identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,7}", fullmatch=True).filter(
    lambda n: not keyword.iskeyword(n)
)
# text that spells no structure of any family (their tags all use <, >, [, ], | or the fullwidth bar)
plain_text = st.text(st.characters(exclude_characters="<>[]|｜\x00"), max_size=8)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | plain_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(identifiers, inner, max_size=3),
    max_leaves=6,
)
arguments = st.dictionaries(identifiers, json_values, max_size=3)
FUZZ = settings(
    max_examples=250,
    deadline=1000,  # milliseconds: no input may take a second
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def well_formed(result: ParseResult) -> Calls:
    """The calls of a result, after checking what every result must be."""
    assert all(isinstance(e, str) and e for e in result.errors)
    assert [c.id for c in result.calls] == [f"call{i:05d}" for i in range(len(result.calls))]
    assert all(isinstance(c.name, str) and c.name and isinstance(c.arguments, dict) for c in result.calls)
    assert isinstance(result.content, str) and isinstance(result.reasoning, str)
    return [(c.name, c.arguments) for c in result.calls]


@pytest.mark.parametrize("name", list(WRITERS))
def test_well_formed_calls_read_back_exactly(name: str) -> None:
    parser = get_parser(name)

    @FUZZ
    @given(calls=st.lists(st.tuples(identifiers, arguments), min_size=1, max_size=3))
    def check(calls: Calls) -> None:
        assert well_formed(parser.parse(WRITERS[name](calls))) == calls

    check()


@pytest.mark.parametrize("name", list(WRITERS))
def test_generated_turns_never_raise_and_reasoning_never_calls(name: str) -> None:
    parser = get_parser(name)
    call = st.builds(lambda n, a: WRITERS[name]([(n, a)]), identifiers, arguments)
    turns = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=12), call), max_size=24).map("".join)

    @FUZZ
    @given(visible=turns, hidden=turns)
    def check(visible: str, hidden: str) -> None:
        calls = well_formed(parser.parse(visible))
        well_formed(parser.parse(hidden + visible))
        if parser.reasoning is not None:
            opening, closing = parser.reasoning
            if opening not in visible and closing not in visible and closing not in hidden:
                assert well_formed(parser.parse(f"{opening}{hidden}{closing}{visible}")) == calls
                assert well_formed(parser.parse(f"{opening}{hidden}")) == []  # unclosed: all reasoning

    check()


ADVERSARIAL = {
    "deep brackets": "[" * 100_000,
    "deep braces": "{" * 100_000,
    "deep gemma": "<|tool_call>call:f" + "{a:" * 100_000 + "<tool_call|>",
    "deep pythonic": "<|tool_call_start|>[f(a=" + "[" * 100_000 + ")]<|tool_call_end|>",
    "long pythonic": "[" + "f(a=1), " * 50_000 + "f()]",
    "20,000 [TOOL_CALLS]": "[TOOL_CALLS]" * 20_000,
    "20,000 call begins": "<｜tool▁call▁begin｜>" * 20_000,
    "20,000 kimi sections": "<|tool_calls_section_begin|>" * 20_000,
    "20,000 <|start|>": "<|start|>" * 20_000,
    "20,000 invokes": "<minimax:tool_call>" + '<invoke name="f">' * 20_000,
    "20,000 arg keys": "<tool_call>f\n" + "<arg_key>" * 20_000 + "</tool_call>",
    "20,000 >>>": ">>>" * 20_000,
    "20,000 gemma quotes": "<|tool_call>call:f{a:" + Q * 20_001 + "}<tool_call|>",
    "1,000 calls": "[TOOL_CALLS]f[ARGS]{}" * 1000,
    "1 MB of text": "x<" * 500_000,
}


@pytest.mark.parametrize("name", list(WRITERS))
@pytest.mark.parametrize("case", list(ADVERSARIAL))
def test_degenerate_turns_are_parsed_in_one_pass(name: str, case: str) -> None:
    started = time.perf_counter()
    well_formed(get_parser(name).parse(ADVERSARIAL[case]))
    seconds = time.perf_counter() - started
    assert seconds < 1.0, f"{case}: {seconds:.2f}s"
