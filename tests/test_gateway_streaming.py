"""Real streaming: a streamed call's content reaches the client while the engine still samples, in
each API's events, and what the client was shown is what the session keeps and the record holds."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from gateway_fixtures import Timed, assert_exact, gateway_for, served, serving
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import OpenAI

from turnrl.gateway.call import Begun
from turnrl.gateway.messages import reply_message
from turnrl.gateway.streaming import ReplyStream, held_back
from turnrl.tools.parsers import get_parser


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def streamed(
    text: str, parser: str = "hermes", piecewise: bool = True
) -> tuple[ReplyStream, str, str | None, dict[str, Any]]:
    """``text`` pushed one character (token) at a time: the stream, the content and the reasoning
    shown before the end, and the reply's message as the gateway writes it."""
    parse = get_parser(parser).parse
    live = ReplyStream()
    live.begin(lambda ids: "".join(map(chr, ids)), piecewise, lambda text: text, parse, Begun("m", 1, 0))
    shown, reasoning = "", None
    for c in text:
        live.push(chars(c))
        said, delta = live.take()
        reasoning = said if said is not None else reasoning
        shown += delta
    parsed = parse(text)
    message = reply_message(
        parsed.content, parsed.reasoning.strip(), parsed.calls, [c.id for c in parsed.calls]
    )
    return live, shown, reasoning, message


def test_content_is_shown_as_it_comes_and_held_where_a_tag_or_call_may_start() -> None:
    text = "Let me look.\n<tool_call>\n" + '{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>'
    live, shown, _, message = streamed(text)
    assert shown == "Let me look." and live.shown.frozen  # the call's tag froze it; nothing of it shown
    reasoning, rest, disagreed = live.settle(message)
    assert (reasoning, rest, disagreed) == (None, "", False)
    live, shown, reasoning, message = streamed("<think>\nplan it\n</think>\n\nThe answer is 4.")
    assert (reasoning, shown) == ("plan it", "The answer is 4.")
    assert live.settle(message) == (None, "", False)
    assert streamed('{"name": "lookup", "arguments": {}}', "llama3_json")[1] == ""  # a bare call waits
    assert (
        held_back("a <tool_c") == "a " and held_back("x [TOOL_CA") == "x " and held_back("ok\ufffd") == "ok"
    )


def test_a_lone_closing_tag_after_shown_content_keeps_what_the_client_was_shown() -> None:
    live, shown, _, message = streamed("It is 4.</think>Four.")
    assert shown == "It is 4." and message["content"] == "Four."
    _, rest, disagreed = live.settle(message)
    assert disagreed and rest == "" and message["content"] == "It is 4."  # the session matches on this


PIECES = st.sampled_from(
    ["Hello", " world", "\n", " ", "<", ">", "[", "]", "{", "}", "<think>", "</think>", "<tool_call>",
     "</tool_call>", '{"name": "f", "arguments": {}}', "é", "2 < 3", "x]"]
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    st.lists(PIECES, max_size=12),
    st.sampled_from(["hermes", "llama3_json", "pythonic", "mistral"]),
    st.booleans(),
)
def test_what_is_shown_and_the_rest_make_the_reply_unless_a_reasoning_tag_follows_shown_text(
    pieces: list[str], parser: str, piecewise: bool
) -> None:
    text = "".join(pieces)
    live, shown, reasoning, message = streamed(text, parser, piecewise)
    final_reasoning = message.get("reasoning_content")
    unsent, rest, disagreed = live.settle(message)
    if not disagreed:
        assert shown + rest == (message["content"] or "")
        assert (reasoning or unsent or None) == final_reasoning
    else:  # the model wrote a reasoning tag after text that was shown as content
        assert "think>" in text and rest == ""
        assert message["content"] == (shown or None)


@pytest.fixture(scope="module")
def embedded(tiny_qwen3_dir: Path) -> Any:
    from turnrl.app.engines import hf_engine
    from turnrl.config import HFEngineConfig

    return hf_engine(str(tiny_qwen3_dir), HFEngineConfig())


def _openai(url: str, messages: list[dict[str, Any]]) -> tuple[list[tuple[float, str]], str]:
    client = OpenAI(base_url=f"{url}/v1", api_key="chat")
    got = []
    for chunk in client.chat.completions.create(model="tiny-qwen3", messages=messages, stream=True):  # type: ignore[arg-type]
        if chunk.choices and chunk.choices[0].delta.content:
            got.append((time.monotonic(), chunk.choices[0].delta.content))
    return got, "chat"


def _anthropic(url: str, messages: list[dict[str, Any]]) -> tuple[list[tuple[float, str]], str]:
    client = anthropic.Anthropic(base_url=url, api_key="messages")
    got = []
    with client.messages.stream(model="tiny-qwen3", max_tokens=200, messages=messages) as stream:  # type: ignore[arg-type]
        for text in stream.text_stream:
            got.append((time.monotonic(), text))
    return got, "messages"


def _responses(url: str, messages: list[dict[str, Any]]) -> tuple[list[tuple[float, str]], str]:
    client = OpenAI(base_url=f"{url}/v1", api_key="responses")
    got = []
    for event in client.responses.create(model="tiny-qwen3", input=messages, stream=True):  # type: ignore[arg-type]
        if event.type == "response.output_text.delta":
            got.append((time.monotonic(), event.delta))
    return got, "responses"


@pytest.mark.parametrize("client", [_openai, _anthropic, _responses], ids=["chat", "messages", "responses"])
def test_a_real_models_reply_streams_while_it_is_sampled_and_is_recorded_as_shown(
    client: Any, embedded: Any, qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    """The embedded engine on a random-init tiny Qwen3: the first text reaches the client before the
    engine has sampled the whole reply; the text shown is the session's message, and the branch
    holds exactly the tokens sampled."""
    gateway = gateway_for(
        embedded, qwen3_tokenizer, tmp_path, sampling={"max_tokens": 160, "temperature": 1.0}
    )
    gateway.engine = Timed(embedded)
    messages = [{"role": "user", "content": "Tell me a long story."}]
    with serving(gateway) as url:
        got, session = client(url, messages)
    engine: Timed = gateway.engine  # type: ignore[assignment]
    assert len(engine.ended) == 1 and len(got) >= 2
    assert got[0][0] < engine.ended[0]  # shown while the engine was still sampling
    branch = gateway.sessions[session].branches[0]
    assert "".join(text for _, text in got) == branch.seen[-1]["content"]
    assert_exact(branch.trajectory(session), engine.seen)
    assert gateway.counts["stream_diverged"] == 0


def test_a_client_that_leaves_mid_stream_aborts_the_call_and_leaves_its_session_as_it_was(
    embedded: Any, qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    gateway = gateway_for(
        embedded, qwen3_tokenizer, tmp_path, sampling={"max_tokens": 1500, "temperature": 1.0}
    )
    body = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Go on."}], "stream": True}
    with serving(gateway) as url:
        with httpx.stream("POST", f"{url}/s/leaver/v1/chat/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if '"content": "' in line and '"content": ""' not in line:
                    break  # the first text: then the client goes away
        deadline = time.monotonic() + 30
        while gateway.counts["aborted"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gateway.counts["aborted"] == 1
        session = gateway.sessions["leaver"]
        assert session.calls == 0 and session.branches == []  # nothing kept of the aborted call
        assert gateway.engine.seen == []  # type: ignore[attr-defined]  # the generation never returned
        client = OpenAI(base_url=f"{url}/s/leaver/v1", api_key="unused")
        reply = client.chat.completions.create(model="tiny-qwen3", messages=body["messages"], max_tokens=8)  # type: ignore[arg-type]
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert session.calls == 1


def test_streamed_calls_under_a_weight_swap_each_keep_one_version(
    embedded: Any, qwen3_tokenizer: Any, tiny_qwen3_model: Any, tmp_path: Path
) -> None:
    """Streamed calls in flight while the weights are swapped: none is lost or fails, each reply's
    tokens carry one weight version, and calls that began after the swap carry the new one."""
    gateway = gateway_for(
        embedded, qwen3_tokenizer, tmp_path, sampling={"max_tokens": 40, "temperature": 1.0}
    )
    before = int(embedded.weight_version)
    state = {k: v.clone() for k, v in tiny_qwen3_model.state_dict().items()}
    with served(gateway) as (url, loop):
        results: dict[int, str] = {}

        def call(k: int) -> None:
            client = OpenAI(base_url=f"{url}/s/swap{k}/v1", api_key="unused")
            stream = client.chat.completions.create(
                model="tiny-qwen3", messages=[{"role": "user", "content": f"Call {k}."}], stream=True
            )
            results[k] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        threads = [threading.Thread(target=call, args=(k,)) for k in range(6)]
        for thread in threads[:3]:
            thread.start()
        time.sleep(0.2)

        async def load() -> None:
            await embedded.update_weights(state)

        swap = asyncio.run_coroutine_threadsafe(gateway.update_weights(load), loop)
        while gateway._open.is_set() and not swap.done():  # new calls wait from here until it is done
            time.sleep(0.001)
        for thread in threads[3:]:
            thread.start()
        swap.result(120)
        for thread in threads:
            thread.join(120)
    assert sorted(results) == list(range(6)) and gateway.counts["errors"] == 0
    for k in range(6):
        versions = [
            v for v in gateway.sessions[f"swap{k}"].branches[0].episode.record.policy_versions if v >= 0
        ]
        assert len(set(versions)) == 1, f"call {k} mixed weight versions {set(versions)}"
        if k >= 3:
            assert versions[0] == before + 1
