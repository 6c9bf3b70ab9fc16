"""Every template of the corpus (tests/template_corpus.py) under the rollout's own encoder: a
scripted rollout trains on exactly what the engine conditioned on, append-only templates match a
full render token for token, content spelling a family's control tokens stays text on every path,
and check-template reports on every family without raising."""

from __future__ import annotations

from typing import Any

import pytest
from template_corpus import BY_NAME, FAMILIES, TEMPLATES, parser_of, tokenizer_for

from turnrl.chat import ChatEncoder
from turnrl.chat.probe import call_id
from turnrl.chat.report import DEFAULT_TOOLS, check_template, end_of_turn_ids, reasoning_turn
from turnrl.chat.template import ChatTemplateError
from turnrl.engines import ScriptedEngine
from turnrl.env import ToolEnv
from turnrl.rollout.loop import RolloutSpec, run_trajectory
from turnrl.testing import EchoEnv
from turnrl.tools import calculator, tool
from turnrl.types import Limits, Sample, SamplingParams, StopReason

NAMES = [f.name for f in FAMILIES]
# templates whose history a later turn never rewrites (measured with this corpus): a scripted
# conversation's tokens equal a full render of its messages, in every scenario of check-template
APPEND_ONLY = [
    "qwen3",
    "phi-3.5",
    "functionary-3.2",
    "seed-oss",
    "qwen2.5",
    "qwq",
    "qwen3-coder",
    "llama-3.1",
    "llama-3.2",
    "devstral",
    "granite-3.3",
    "granite-4.0",
    "kimi-k2",
    "smollm3",
    "lfm2",
]
_TOKENIZERS: dict[str, Any] = {}


def tokenizer(name: str) -> Any:
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = tokenizer_for(BY_NAME[name])
    return _TOKENIZERS[name]


def test_the_corpus_has_at_least_20_families_each_with_its_provenance() -> None:
    table = (TEMPLATES / "PROVENANCE.md").read_text(encoding="utf-8")
    assert len(FAMILIES) >= 20 and len({f.template for f in FAMILIES}) == len(FAMILIES)
    for family in FAMILIES:
        assert f"| {family.name} |" in table and family.template in table, family.name
        assert family.controls(), f"{family.name}: no control token found in its template"


@pytest.mark.parametrize("name", NAMES)
def test_the_family_tokenizer_has_every_control_token_as_one_special_token(name: str) -> None:
    tok = tokenizer(name)
    encoder = ChatEncoder(tok)
    for control in BY_NAME[name].controls():
        ids = tok.convert_tokens_to_ids([control])
        assert len(tok.encode(control, add_special_tokens=False)) == 1, control
        assert ids[0] in encoder.template.special_ids or control in _NON_SPECIAL, control


_NON_SPECIAL = {"<think>", "</think>", "<tool_call>", "</tool_call>"}  # Qwen3's plain added tokens


@pytest.mark.parametrize("name", APPEND_ONLY)
def test_append_only_templates_match_a_full_render_in_every_scenario(name: str) -> None:
    """Every scenario of check-template renders, and its tokens equal a full render of its messages,
    but for the <think> blocks that thinking templates drop from history by design and the scripted
    replies' own tokenization (a reply tokenized alone, as a model may sample it: Phi-3's "12"
    alone starts with a word boundary that the same text after a newline lacks) and model turns the
    template writes its own way (Functionary's "all" recipient before a call's text). No prompt or
    observation is rewritten later."""
    report = check_template(tokenizer(name), name=name)
    assert report.safe, report.text()
    hunks = [h for r in report.results.values() for h in r.hunks]
    assert all(h.expected and h.kind in ("think", "same_text", "model_turn") for h in hunks), report.text()


# the corpus's verdicts (docs/templates.md): the one scenario the check cannot explain, by family,
# and the families whose template rejects a scenario (no tool role, tools required)
NOT_SAFE = {"deepseek-r1-qwen": "tool calls"}
RAISES = {"gemma-2", "hermes-3"}


@pytest.mark.parametrize("name", NAMES)
def test_check_template_reports_on_every_family_without_raising(name: str) -> None:
    report = check_template(tokenizer(name), name=name)
    text = report.text()
    assert text.startswith(f"chat template of {name}") and ("SAFE" in text.splitlines()[-1])
    failed = {scenario for scenario, result in report.results.items() if not result.ok}
    assert failed == ({NOT_SAFE[name]} if name in NOT_SAFE else set()), text
    assert bool(report.errors) == (name in RAISES), text


def test_reasoning_turns_are_scripted_as_the_family_writes_them() -> None:
    """GLM 4.6 writes a newline before ``<think>`` and none inside it: its scripted reasoning turns
    are the template's own render (a Qwen-style block would differ from every re-render, a false
    alarm), and its reasoning scenarios pass with only the reasoning that history drops."""
    encoder = ChatEncoder(tokenizer("glm-4.6"))
    probe = encoder.probe(DEFAULT_TOOLS)
    text = reasoning_turn(encoder, probe, DEFAULT_TOOLS, "<think>\nDone.\n</think>\n\n391")
    assert text == "\n<think>Done.</think>\n391"
    report = check_template(tokenizer("glm-4.6"), name="glm-4.6")
    for scenario in ("reasoning + tools", "reasoning + user turns"):
        result = report.results[scenario]
        # the only differences: the reasoning that history drops (verified against re-renders)
        assert result.ok and all(h.expected and h.kind in ("think", "model_turn") for h in result.hunks)
    # a template that drops reasoning from the last turn too (DeepSeek-R1 distills): the reply
    # stays as written; one that opens <think> in its generation prompt leaves the model the rest
    reply = "<think>\nDone.\n</think>\n\n391"
    r1 = ChatEncoder(tokenizer("deepseek-r1-qwen"))
    assert reasoning_turn(r1, r1.probe(DEFAULT_TOOLS), DEFAULT_TOOLS, reply) is None
    minimax = ChatEncoder(tokenizer("minimax-m2"))
    assert (
        reasoning_turn(minimax, minimax.probe(DEFAULT_TOOLS), DEFAULT_TOOLS, reply)
        == "Done.\n</think>\n\n391"
    )


def _special_count(encoder: ChatEncoder, ids: list[int]) -> int:
    return sum(t in encoder.template.special_ids for t in ids)


@pytest.mark.parametrize("name", NAMES)
def test_content_spelling_the_familys_control_tokens_stays_text(name: str) -> None:
    """A user message or tool result that spells every control token of its family gets exactly the
    control tokens the same message without them gets: in the prompt, and as an observation on
    whichever path (fast or slow) the template takes."""
    family = BY_NAME[name]
    encoder = ChatEncoder(tokenizer(name))
    forged = "look: " + " ".join(family.controls())
    plain = "look: " + " ".join("x" for _ in family.controls())
    conv = encoder.conversation(DEFAULT_TOOLS if family.needs_tools else None)
    prompt = [{"role": "user", "content": "hi"}]
    in_prompt = [conv.encode_prompt([{"role": "user", "content": text}]) for text in (forged, plain)]
    assert _special_count(encoder, in_prompt[0]) == _special_count(encoder, in_prompt[1])
    eot = end_of_turn_ids(encoder, DEFAULT_TOOLS if family.needs_tools else None)
    last = encoder.template.decode(eot[-1:]) if eot else None
    roles = ["user", "tool"] if family.tools else ["user"]
    for role in roles:
        tools = DEFAULT_TOOLS if role == "tool" or family.needs_tools else None
        conv = encoder.conversation(tools)
        conv.encode_prompt(prompt)

        def message(content: str, role: str = role) -> dict[str, Any]:
            extra = {"name": "calculator", "tool_call_id": call_id(0)} if role == "tool" else {}
            return {"role": role, "content": content, **extra}

        try:
            with_controls = conv.encode_observation([message(forged)], last)
        except ChatTemplateError as exc:  # templates that need an assistant tool call first
            assert "tool" in str(exc), exc
            continue
        without = conv.encode_observation([message(plain)], last)
        assert _special_count(encoder, with_controls) == _special_count(encoder, without), (role, family.name)


def _stop_token(encoder: ChatEncoder) -> int:
    """The token a model of the family ends its turn with: the template's end-of-turn token, or
    for templates that close a turn with the next role's header (GLM), that header's first token."""
    eot = end_of_turn_ids(encoder, None)
    return eot[-1] if eot else encoder.template.encode(encoder.probe(None).shapes["user"].lead.strip())[0]


@pytest.mark.parametrize("name", NAMES)
async def test_a_scripted_rollout_trains_on_what_the_engine_conditioned_on(name: str) -> None:
    """Three model turns with user-turn observations between them: each turn's prompt is exactly
    the trajectory so far, and the trained sequence is the last prompt plus the last reply."""
    tok = tokenizer(name)
    encoder = ChatEncoder(tok)
    if BY_NAME[name].needs_tools:  # no tools: the template raises, and the trajectory says so
        engine = ScriptedEngine(tok, [])
        spec = RolloutSpec(lambda s: EchoEnv(s), engine, encoder, SamplingParams(max_tokens=8), Limits())
        failed = await run_trajectory(Sample("s", [{"role": "user", "content": "hi"}]), spec)
        assert "chat template failed: TypeError" in str(failed.error), failed.error
        return
    stop = _stop_token(encoder)
    replies = [[*tok.encode(text, add_special_tokens=False), stop] for text in ("12", "15", "14")]
    engine = ScriptedEngine(tok, replies, eos_token_id=stop)
    spec = RolloutSpec(
        env_factory=lambda sample: EchoEnv(sample, done_after=3),
        engine=engine,
        encoder=encoder,
        sampling=SamplingParams(max_tokens=32),
        limits=Limits(max_turns=3, max_context_tokens=4096),
    )
    sample = Sample("story", [{"role": "user", "content": "Tell a story, one sentence per turn."}])
    traj = await run_trajectory(sample, spec)
    assert traj.stop_reason in (StopReason.ENV_DONE, StopReason.MAX_TURNS), traj.error
    assert traj.num_turns == 3
    sequence = traj.prompt_ids + traj.response_ids
    for prompt in engine.prompts:
        assert sequence[: len(prompt)] == prompt  # every turn saw a prefix of what is trained on
    assert engine.prompts[-1] + replies[-1] == sequence
    model = [t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m]
    assert model == [t for r in replies for t in r]


TOOL_FAMILIES = [f.name for f in FAMILIES if f.tools]
# calls in the model's documented format, for templates that render none in history, or render a
# final call turn with an end-of-turn token inside it (DeepSeek-R1 distills, Nemotron)
DOCUMENTED = {
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n```json\n"
    '{{"expression": "{}"}}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "nemotron": '<TOOLCALL>[{{"name": "calculator", "arguments": {{"expression": "{}"}}}}]</TOOLCALL>',
    "hermes": '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>',
    "granite": '<|tool_call|>[{{"name": "calculator", "arguments": {{"expression": "{}"}}}}]',
    "lfm2": '<|tool_call_start|>[calculator(expression="{}")]<|tool_call_end|>',
}
NOT_SAFE_WITH_TOOLS = {"deepseek-r1-qwen"}  # renders a second call turn's results as a continuation


def _tool_turns(name: str, tools: list[dict[str, Any]]) -> list[list[int]]:
    """Text and a call, another call, then a plain answer, each as the family's model writes it
    (its template's own rendering of the turn), ending with the token the model stops on."""
    from turnrl.chat.report import _calls, scripted_turn, stop_ids

    encoder = ChatEncoder(tokenizer(name))
    probe = encoder.probe(tools)
    turns = []
    for expression, text in (("17 * 23", "Let me compute."), ("391 + 1", "")):
        ids, _ = scripted_turn(encoder, probe, tools, _calls(expression, text=text))
        early_stop = any(t in encoder.template.special_ids and t == ids[-1] for t in ids[:-1])
        if early_stop or "calculator" not in encoder.template.decode(ids):
            call = DOCUMENTED[str(parser_of(BY_NAME[name]))].format(expression)
            ids = encoder.template.encode(text + call) + stop_ids(encoder, probe.assistant_close)
        turns.append(ids)
    turns.append(scripted_turn(encoder, probe, tools, "The answer is 392.")[0])
    return turns


@pytest.mark.parametrize("name", TOOL_FAMILIES)
async def test_a_tool_rollout_in_the_familys_own_format_trains_on_what_the_engine_saw(name: str) -> None:
    """Four turns through the real ToolEnv, the family's parser and a real calculator: text and a
    call, its result, another call, its result, a plain answer. The engine saw every result; each
    turn's prompt is exactly the trajectory so far; the trained sequence is the last prompt plus
    the last reply; the end-of-trajectory check finds every delta equal to the template's own
    rendering at that point (or names the family that does not)."""
    tools = [tool(calculator).schema]
    turns = _tool_turns(name, tools)
    tok = tokenizer(name)
    engine = ScriptedEngine(tok, turns, eos_token_id=turns[-1][-1])
    spec = RolloutSpec(
        env_factory=lambda s: ToolEnv(s, [tool(calculator)], parser=str(parser_of(BY_NAME[name]))),
        engine=engine,
        encoder=ChatEncoder(tok),
        sampling=SamplingParams(max_tokens=256, stop_token_ids=sorted({t[-1] for t in turns})),
        limits=Limits(max_turns=6, max_context_tokens=8192),
    )
    prompt = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "17 * 23 + 1?"},
    ]
    traj = await run_trajectory(Sample("calc", prompt), spec)
    assert traj.error is None and traj.stop_reason == StopReason.NO_TOOL_CALL, (traj.stop_reason, traj.error)
    assert traj.num_turns == 3 and traj.info["num_tool_calls"] == 2 and traj.info["num_tool_errors"] == 0
    sequence = traj.prompt_ids + traj.response_ids
    for prompt_ids in engine.prompts:
        assert sequence[: len(prompt_ids)] == prompt_ids
    assert engine.prompts[-1] + turns[-1] == sequence
    assert [t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m] == [
        t for r in turns for t in r
    ]
    assert "391" in tok.decode(engine.prompts[1]) and "392" in tok.decode(engine.prompts[2])  # results seen
    assert "check/error" not in traj.metrics, traj.metrics["check/error"]
    assert traj.metrics["check/ok"] is (name not in NOT_SAFE_WITH_TOOLS), traj.info.get("check")
