"""Tool-call parsers: well-formed, several calls, calls inside reasoning, malformed calls."""

from __future__ import annotations

import json

import pytest

from turnrl.tools import PARSERS, get_parser, strip_reasoning
from turnrl.tools.parsers import HermesParser, Llama3JsonParser, Qwen3CoderParser


def _hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def _coder(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_registry_and_aliases() -> None:
    assert isinstance(get_parser("hermes"), HermesParser)
    assert PARSERS["qwen"] is PARSERS["qwen3"] is HermesParser
    assert isinstance(get_parser("qwen3_coder"), Qwen3CoderParser)
    assert isinstance(get_parser("llama3_json"), Llama3JsonParser)
    with pytest.raises(ValueError, match=r"unknown tool parser 'nope'; available: .*hermes"):
        get_parser("nope")


@pytest.mark.parametrize(
    ("text", "visible"),
    [
        ("<think>a</think>b", "b"),
        ("a</think>b", "b"),
        ("a</think>b<think>c</think>d", "bd"),
        ("b<think>still thinking", "b"),
        ("plain", "plain"),
    ],
)
def test_strip_reasoning(text: str, visible: str) -> None:
    assert strip_reasoning(text) == visible


# hermes


def test_hermes_well_formed() -> None:
    text = "Let me compute.\n" + _hermes("calc", '{"expression": "1 + 2"}')
    result = get_parser("hermes").parse(text)
    assert result.errors == []
    assert result.content == "Let me compute."
    (call,) = result.calls
    assert (call.name, call.arguments, call.id) == ("calc", {"expression": "1 + 2"}, "call00000")
    assert call.raw.startswith("<tool_call>") and call.raw.endswith("</tool_call>")


def test_hermes_several_calls_and_string_arguments() -> None:
    text = _hermes("a", '{"x": 1}') + "\n" + _hermes("b", '"{\\"y\\": [1, 2]}"') + _hermes("c", "{}")
    result = get_parser("qwen").parse(text)
    assert [(c.name, c.arguments, c.id) for c in result.calls] == [
        ("a", {"x": 1}, "call00000"),
        ("b", {"y": [1, 2]}, "call00001"),
        ("c", {}, "call00002"),
    ]
    assert result.errors == [] and result.content == ""


def test_hermes_ignores_calls_inside_reasoning() -> None:
    inside = "<think>maybe " + _hermes("a", "{}") + "</think>\n" + _hermes("b", "{}")
    assert [c.name for c in get_parser("hermes").parse(inside).calls] == ["b"]
    lone = "I could call " + _hermes("a", "{}") + "\n</think>\n\nThe answer is 4."
    result = get_parser("hermes").parse(lone)
    assert result.calls == [] and result.errors == []
    assert result.content == "The answer is 4."


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            '<tool_call>{"name": "a" "arguments": {}}</tool_call>',
            "invalid JSON in <tool_call>: Expecting ',' delimiter",
        ),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call> has no "name"'),
        ("<tool_call>[1, 2]</tool_call>", "<tool_call> must hold a JSON object, got list"),
        (
            '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
            "the arguments of tool call 'a' must be a JSON object",
        ),
        (
            '<tool_call>{"name": "a", "arguments": "{bad"}</tool_call>',
            "invalid JSON in the arguments of tool call 'a'",
        ),
        ('<tool_call>{"name": "a", "arguments": {}}', "unclosed <tool_call> tag"),
    ],
)
def test_hermes_malformed(text: str, error: str) -> None:
    result = get_parser("hermes").parse("Hi. " + text)
    assert result.calls == []
    (message,) = result.errors
    assert message.startswith(error)
    assert result.content == "Hi."


def test_hermes_mixes_good_and_bad_calls() -> None:
    text = _hermes("a", "{}") + '<tool_call>{"name": }</tool_call>' + _hermes("b", "{}")
    result = get_parser("hermes").parse(text)
    assert [(c.name, c.id) for c in result.calls] == [("a", "call00000"), ("b", "call00001")]
    assert len(result.errors) == 1


def test_no_calls_gives_empty_result() -> None:
    for name in ("hermes", "qwen3_coder", "llama3_json"):
        result = get_parser(name).parse("<think>hmm</think>The answer is 42.")
        assert result.calls == [] and result.errors == []
        assert result.content == "The answer is 42."


# qwen3_coder


def test_qwen3_coder_well_formed_with_typed_values() -> None:
    text = "Checking.\n" + _coder(
        "get_weather", city="Paris", days="3", units='["c", "f"]', note="two\nlines"
    )
    result = get_parser("qwen3_coder").parse(text)
    assert result.errors == [] and result.content == "Checking."
    (call,) = result.calls
    assert call.name == "get_weather"
    assert call.arguments == {"city": "Paris", "days": 3, "units": ["c", "f"], "note": "two\nlines"}
    assert call.id == "call00000"


def test_qwen3_coder_several_calls_and_reasoning() -> None:
    text = "<think>" + _coder("hidden") + "</think>" + _coder("a", x="1") + "\n" + _coder("b")
    result = get_parser("qwen3_coder").parse(text)
    assert [(c.name, c.arguments, c.id) for c in result.calls] == [
        ("a", {"x": 1}, "call00000"),
        ("b", {}, "call00001"),
    ]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            "<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n</tool_call>",
            "unclosed <function=...> tag",
        ),
        ("<tool_call>\nhello\n</tool_call>", "no <function=NAME> in <tool_call>"),
        ("<tool_call>\n<function=>\n</function>\n</tool_call>", "<function=> has no name"),
        ("<tool_call>\n<function=a>\n</function>", "unclosed <tool_call> tag"),
    ],
)
def test_qwen3_coder_malformed(text: str, error: str) -> None:
    result = get_parser("qwen3_coder").parse(text)
    assert result.calls == []
    (message,) = result.errors
    assert message.startswith(error)


# llama3_json


def test_llama3_json_well_formed() -> None:
    text = '{"name": "calc", "parameters": {"expression": "2 * 3"}}'
    (call,) = get_parser("llama3_json").parse(text).calls
    assert (call.name, call.arguments, call.id, call.raw) == (
        "calc",
        {"expression": "2 * 3"},
        "call00000",
        text,
    )


def test_llama3_json_python_tag_and_several_calls() -> None:
    text = (
        'Sure.<|python_tag|>{"name": "a", "parameters": {"q": "x; y"}}; '
        '{"name": "b", "arguments": {"n": 2}}<|eom_id|>'
    )
    result = get_parser("llama3_json").parse(text)
    assert [(c.name, c.arguments, c.id) for c in result.calls] == [
        ("a", {"q": "x; y"}, "call00000"),
        ("b", {"n": 2}, "call00001"),
    ]
    assert result.errors == [] and result.content == "Sure."


def test_llama3_json_ignores_reasoning() -> None:
    text = '<think>{"name": "a", "parameters": {}}</think>The answer is 4.'
    result = get_parser("llama3_json").parse(text)
    assert result.calls == [] and result.content == "The answer is 4."


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"name": "a", "parameters": {"x": 1}', "invalid JSON in tool call"),
        ('<|python_tag|>{"parameters": {}}', 'tool call has no "name"'),
        ('{"name": "a", "parameters": 3}', "the arguments of tool call 'a' must be a JSON object, got int"),
    ],
)
def test_llama3_json_malformed(text: str, error: str) -> None:
    result = get_parser("llama3_json").parse(text)
    assert result.calls == []
    (message,) = result.errors
    assert message.startswith(error)


def test_llama3_json_keeps_good_calls_before_a_bad_one() -> None:
    result = get_parser("llama3_json").parse('{"name": "a", "parameters": {}}; {"name": "b", ')
    assert [c.name for c in result.calls] == ["a"]
    assert len(result.errors) == 1


# each family's own format, as its real chat template renders it (tests/template_corpus.py)

CALLS = [
    ("search", {"query": 'café "quoted" a<b', "limit": 3}),
    ("calculator", {"expression": "17 * 23", "opts": {"exact": True, "digits": [1, 2]}}),
]
FAMILY_PARSERS = {
    "qwen3": "hermes", "qwen2.5": "hermes", "qwq": "hermes", "hermes-3": "hermes", "granite-4.0": "hermes",
    "qwen3-coder": "qwen3_coder", "qwen3.5": "qwen3_coder", "seed-oss": "seed_oss",
    "llama-3.1": "llama3_json", "llama-3.2": "llama3_json", "functionary-3.2": "functionary",
    "mistral-nemo": "mistral", "mistral-small-3.2": "mistral", "devstral": "mistral",
    "deepseek-r1-qwen": "deepseek_v3", "deepseek-v3.1": "deepseek_v3", "deepseek-v3.2": "deepseek_v32",
    "glm-4.6": "glm45", "gpt-oss": "harmony", "gemma-4": "gemma4", "granite-3.3": "granite",
    "kimi-k2": "kimi_k2", "minimax-m2": "minimax_m2", "nemotron-nano-v2": "nemotron",
    "lfm2": "lfm2", "command-r7b": "command_r",
}  # fmt: skip
# templates that render no tool calls in history: their models' documented format instead
DOCUMENTED = {
    "granite-3.3": "<|tool_call|>" + json.dumps([{"name": n, "arguments": a} for n, a in CALLS]),
    "lfm2": '<|tool_call_start|>[search(query="café \\"quoted\\" a<b", limit=3), '
    'calculator(expression="17 * 23", opts={"exact": True, "digits": [1, 2]})]<|tool_call_end|>Let me look.',
}


ONE_CALL = {"llama-3.1", "llama-3.2", "gpt-oss"}  # templates that render one call per turn
# templates that move the text beside the calls into a turn of its own (DeepSeek-R1 distills),
# before a second turn header (Nemotron) or into the reasoning channel (gpt-oss): no content to check
TEXT_ELSEWHERE = {"deepseek-r1-qwen", "nemotron-nano-v2", "gpt-oss"}


def _family_reply(name: str) -> tuple[str, list[tuple[str, dict[str, object]]]]:
    """The family's template's own text for an assistant turn with text and two calls (one call for
    Llama 3.x, whose template takes one per turn), and the calls it holds."""
    from template_corpus import BY_NAME, tokenizer_for

    from turnrl.chat import ChatEncoder
    from turnrl.chat.probe import model_turn
    from turnrl.chat.report import DEFAULT_TOOLS

    encoder = ChatEncoder(tokenizer_for(BY_NAME[name]))
    probe = encoder.probe(DEFAULT_TOOLS)
    calls = CALLS[:1] if name in ONE_CALL else CALLS
    for as_text in (False, True):  # arguments as a mapping, or as a JSON string (Functionary)
        message = {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": f"call{i:05d}",
                    "type": "function",
                    "function": {"name": n, "arguments": json.dumps(a) if as_text else a},
                }
                for i, (n, a) in enumerate(calls)
            ],
        }
        try:
            text, _ = model_turn(encoder.template, DEFAULT_TOOLS, probe.base, message, probe.assistant_close)
            return text, calls
        except ValueError:
            continue
    raise AssertionError(f"{name}: the template renders no assistant turn with tool calls")


def _family(name: str) -> object:
    """The family as a parameter, marked when its tokenizer is one of llama.cpp's vocabularies (the
    inner loop, ``--quick``, has no llama.cpp checkout)."""
    from template_corpus import BY_NAME

    gguf = BY_NAME[name].tokenizer.startswith("gguf:")
    return pytest.param(name, marks=[pytest.mark.llama_cpp_vocab] if gguf else [])


@pytest.mark.parametrize("name", [_family(name) for name in sorted(FAMILY_PARSERS)])
def test_each_familys_parser_reads_back_the_calls_its_own_template_renders(name: str) -> None:
    from template_corpus import BY_NAME

    from turnrl.tools.parsers import parser_for_template

    assert parser_for_template(BY_NAME[name].text) == FAMILY_PARSERS[name]
    text, calls = _family_reply(name)
    if name in DOCUMENTED:
        assert "search" not in text, f"{name} renders its calls now: test them instead"
        text = DOCUMENTED[name]
    result = get_parser(FAMILY_PARSERS[name]).parse(text)
    assert result.errors == [], (name, text)
    assert [(c.name, c.arguments) for c in result.calls] == calls, (name, text)
    assert [c.id for c in result.calls] == [f"call{i:05d}" for i in range(len(calls))]
    assert "search" not in result.content and "calculator" not in result.content, (name, result.content)
    if "Let me look." in text and name not in TEXT_ELSEWHERE:  # the text beside the calls, where kept
        assert result.content == "Let me look.", (name, text, result.content)
