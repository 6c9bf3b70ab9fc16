"""Real clients, unchanged, against the gateway on loopback: the ``anthropic`` SDK (messages with
tools and thinking), the ``openai`` SDK's Responses API, the OpenAI Agents SDK and a LangGraph
agent, each a multi-step tool agent whose session is token-exact; ``n`` replies as branches of
their own; a client that leaves mid-call aborts its generation; an agent that compacts its history
leaves two branches that say so."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_fixtures import ANSWER, CALL, START, TOOLS, assert_exact, calls_on, gateway_for, serving
from leftovers import free_left_sockets
from openai import OpenAI

from turnrl.engines.scripted import ScriptedEngine, ScriptedReply
from turnrl.gateway import Reason, read_branches
from turnrl.rollout.finish import check_metrics

SYSTEM, QUESTION = START[0]["content"], START[1]["content"]


@pytest.fixture(autouse=True)
def _free_the_clients_sockets() -> Iterator[None]:
    """The agent SDKs (openai-agents, LangGraph, anthropic) leave their HTTP clients to the garbage
    collector: freed at the end of the test that made them, not during the next one."""
    yield
    free_left_sockets()


def lookup(key: str) -> str:
    """The value stored under a key."""
    return json.dumps({"value": {"alpha": 42}[key]})


def one_exact_branch(gateway: Any, name: str, calls: int) -> None:
    """Session ``name`` is one branch of ``calls`` calls, exactly what the engine saw and sampled,
    and the same on disk."""
    session = gateway.sessions[name]
    assert [(b.reason, b.calls) for b in session.branches] == [(Reason.FIRST, calls)]
    branch = session.branches[0]
    traj = branch.trajectory(name)
    assert_exact(traj, gateway.engine.seen)
    check_metrics(traj, branch.conv, branch.episode.last_token_text, "strict")
    assert traj.metrics["check/mismatches"] == 0
    on_disk = [
        t for t in read_branches(Path(gateway.config.output_dir) / "calls.jsonl") if t.branch.session == name
    ]
    assert [t.input_ids for t in on_disk] == [traj.input_ids] and on_disk[0].loss_mask == traj.loss_mask


@pytest.mark.parametrize("stream", [False, True])
def test_an_anthropic_sdk_agent_with_thinking_and_tools(
    qwen3_tokenizer: Any, tmp_path: Path, stream: bool
) -> None:
    import anthropic

    gateway = gateway_for(ScriptedEngine(qwen3_tokenizer, [CALL, ANSWER]), qwen3_tokenizer, tmp_path)
    tools = [{"name": "lookup", "description": "The value stored under a key.",
              "input_schema": TOOLS[0]["function"]["parameters"]}]  # fmt: skip
    with serving(gateway) as url:
        client = anthropic.Anthropic(base_url=url, api_key="claude-agent", max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
        kinds = []
        while True:
            asked = dict(model="tiny-qwen3", max_tokens=256, system=SYSTEM, messages=messages, tools=tools,
                         thinking={"type": "enabled", "budget_tokens": 128})  # fmt: skip
            if stream:
                with client.messages.stream(**asked) as events:  # type: ignore[arg-type]
                    reply = events.get_final_message()
            else:
                reply = client.messages.create(**asked)  # type: ignore[arg-type]
            kinds.append([b.type for b in reply.content])
            messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
            if reply.stop_reason != "tool_use":
                break
            results = [{"type": "tool_result", "tool_use_id": b.id, "content": lookup(**b.input)}
                       for b in reply.content if b.type == "tool_use"]  # fmt: skip
            messages.append({"role": "user", "content": results})
        counted = client.messages.count_tokens(
            model="tiny-qwen3", system=SYSTEM, messages=messages[:1], tools=tools
        )  # type: ignore[arg-type]
    assert kinds == [["thinking", "tool_use"], ["thinking", "text"]]
    assert reply.content[-1].text == "The value of alpha is 42."  # type: ignore[union-attr]
    assert reply.usage.input_tokens == len(gateway.engine.seen[1][0])  # type: ignore[attr-defined]
    assert counted.input_tokens == len(gateway.engine.seen[0][0])  # type: ignore[attr-defined]
    one_exact_branch(gateway, "claude-agent", 2)


def test_anthropic_errors_come_in_anthropics_schema(qwen3_tokenizer: Any, tmp_path: Path) -> None:
    import anthropic

    engine = ScriptedEngine(qwen3_tokenizer, ["Hi."])
    gateway = gateway_for(engine, qwen3_tokenizer, tmp_path, any_model=False)  # the default answers any
    with serving(gateway) as url:
        client = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)
        with pytest.raises(anthropic.NotFoundError, match="not_found_error"):
            client.messages.create(
                model="claude-9", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
            )
        orphan = [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}
        ]
        with pytest.raises(anthropic.BadRequestError, match="answers tool call 'toolu_x'"):
            client.messages.create(model="tiny-qwen3", max_tokens=8, messages=orphan)  # type: ignore[arg-type]
        search = [{"type": "web_search_20250305", "name": "web_search"}]
        # a server tool the model cannot call is left out of its prompt, and counted
        hi = client.messages.create(model="tiny-qwen3", max_tokens=8, tools=search,  # type: ignore[list-item]
                                    messages=[{"role": "user", "content": "hi"}])  # fmt: skip
        assert hi.content[0].text == "Hi."  # type: ignore[union-attr]
        assert 'dropped_tools_total{type="web_search_20250305"} 1' in httpx.get(f"{url}/metrics").text
        raw = httpx.post(f"{url}/v1/messages", json={"model": "tiny-qwen3", "messages": []})
    assert raw.status_code == 400 and raw.json()["type"] == "error"
    assert raw.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_an_openai_responses_agent(qwen3_tokenizer: Any, tmp_path: Path, stream: bool) -> None:
    gateway = gateway_for(ScriptedEngine(qwen3_tokenizer, [CALL, ANSWER, "Yes."]), qwen3_tokenizer, tmp_path)
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    with serving(gateway) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="codex-like", max_retries=0)
        items: list[Any] = [{"role": "user", "content": QUESTION}]
        while True:
            asked = dict(model="tiny-qwen3", instructions=SYSTEM, input=items, tools=tools, store=False)
            if stream:
                events = list(client.responses.create(**asked, stream=True))  # type: ignore[call-overload]
                assert events[0].type == "response.created" and events[-1].type == "response.completed"
                response = events[-1].response
            else:
                response = client.responses.create(**asked)  # type: ignore[call-overload]
            items += [item.model_dump(exclude_none=True) for item in response.output]
            calls = [item for item in response.output if item.type == "function_call"]
            if not calls:
                break
            for c in calls:
                output = lookup(**json.loads(c.arguments))
                items.append({"type": "function_call_output", "call_id": c.call_id, "output": output})
        # a later request that continues the last response by its id extends the same branch
        more = client.responses.create(
            model="tiny-qwen3", previous_response_id=response.id, input="Sure?", tools=tools
        )
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output_text == "The value of alpha is 42." and more.output_text == "Yes."
    one_exact_branch(gateway, "codex-like", 3)


def test_the_openai_agents_sdk_runs_a_tool_agent(qwen3_tokenizer: Any, tmp_path: Path) -> None:
    from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool
    from openai import AsyncOpenAI

    gateway = gateway_for(ScriptedEngine(qwen3_tokenizer, [CALL, ANSWER]), qwen3_tokenizer, tmp_path)
    with serving(gateway) as url:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="agents-sdk", max_retries=0)
        agent = Agent(
            name="looker",
            instructions=SYSTEM,
            tools=[function_tool(lookup)],
            model=OpenAIResponsesModel("tiny-qwen3", client),
        )

        async def run() -> Any:
            async with client:  # its connections closed on the loop that opened them
                return await Runner.run(agent, QUESTION, run_config=RunConfig(tracing_disabled=True))

        result = asyncio.run(run())
    assert result.final_output == "The value of alpha is 42."
    one_exact_branch(gateway, "agents-sdk", 2)


def test_a_langgraph_react_agent(qwen3_tokenizer: Any, tmp_path: Path) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    gateway = gateway_for(ScriptedEngine(qwen3_tokenizer, [CALL, ANSWER]), qwen3_tokenizer, tmp_path)
    with serving(gateway) as url, httpx.Client() as http:
        model = ChatOpenAI(
            model="tiny-qwen3", base_url=f"{url}/v1", api_key="langgraph", max_retries=0, http_client=http
        )
        graph = create_react_agent(model, [tool(lookup)], prompt=SYSTEM)
        state = graph.invoke({"messages": [("user", QUESTION)]})
    assert state["messages"][-1].content == "The value of alpha is 42."
    one_exact_branch(gateway, "langgraph", 2)


def test_n_replies_are_branches_a_client_may_continue(qwen3_tokenizer: Any, tmp_path: Path) -> None:
    gateway = gateway_for(
        ScriptedEngine(qwen3_tokenizer, ["Red.", "Blue.", "Because."]), qwen3_tokenizer, tmp_path
    )
    with serving(gateway) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="best-of-2", max_retries=0)
        asked = [{"role": "user", "content": "Pick a colour."}]
        choices = client.chat.completions.create(model="tiny-qwen3", messages=asked, n=2).choices  # type: ignore[arg-type]
        picked = choices[1].message.model_dump(exclude_none=True)  # the client keeps the second
        client.chat.completions.create(
            model="tiny-qwen3",
            messages=[*asked, picked, {"role": "user", "content": "Why?"}],  # type: ignore[list-item]
        )
    assert [c.message.content for c in choices] == ["Red.", "Blue."]
    branches = gateway.sessions["best-of-2"].branches
    assert [(b.reason, b.parent, b.calls) for b in branches] == [
        (Reason.FIRST, None, 1),
        (Reason.SAMPLE, 0, 2),
    ]
    seen = gateway.engine.seen  # type: ignore[attr-defined]
    assert seen[0][0] == seen[1][0] and branches[1].shared_tokens == len(seen[0][0])
    assert_exact(branches[0].trajectory("best-of-2"), [seen[0]])
    assert_exact(branches[1].trajectory("best-of-2"), [seen[1], seen[2]])


def test_a_client_that_leaves_aborts_its_call(qwen3_tokenizer: Any, tmp_path: Path) -> None:
    slow = ScriptedReply(text="Too late.", delay_s=30)
    gateway = gateway_for(ScriptedEngine(qwen3_tokenizer, [slow, "Quick."]), qwen3_tokenizer, tmp_path)
    with serving(gateway) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="leaver", max_retries=0, timeout=1.0)
        with pytest.raises(Exception, match="timed out"):
            client.chat.completions.create(model="tiny-qwen3", messages=[{"role": "user", "content": "Hi."}])
        for _ in range(100):  # the abort lands within a poll of the disconnect
            if "turnrl_gateway_aborted_total 1" in httpx.get(f"{url}/metrics").text:
                break
            asyncio.run(asyncio.sleep(0.05))
        metrics = httpx.get(f"{url}/metrics").text
        again = client.chat.completions.create(
            model="tiny-qwen3", messages=[{"role": "user", "content": "Hi."}]
        )
    assert "turnrl_gateway_aborted_total 1" in metrics and "turnrl_gateway_calls_total 0" in metrics
    assert (
        again.choices[0].message.content == "Quick."
    )  # the session was left as it was: one branch, one call
    assert [(b.reason, b.calls) for b in gateway.sessions["leaver"].branches] == [(Reason.FIRST, 1)]


def test_an_agent_that_compacts_its_history_leaves_two_branches(qwen3_tokenizer: Any, tmp_path: Path) -> None:
    """A tool agent that, past a message budget, asks the model for a summary and goes on from it."""
    replies = [CALL, CALL, "<think>\n\n</think>\n\nSummary: alpha is 42.", ANSWER]
    gateway = gateway_for(ScriptedEngine(qwen3_tokenizer, replies), qwen3_tokenizer, tmp_path)
    with serving(gateway) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="compactor", max_retries=0)
        messages: list[dict[str, Any]] = [dict(m) for m in START]
        while True:
            if len(messages) > 5:  # compaction: the model summarizes, the history is replaced
                ask = [*messages, {"role": "user", "content": "Summarize what you found."}]
                summary = client.chat.completions.create(model="tiny-qwen3", messages=ask, tools=TOOLS)  # type: ignore[arg-type]
                messages = [
                    START[0],
                    {"role": "user", "content": f"{QUESTION} {summary.choices[0].message.content}"},
                ]
            reply = client.chat.completions.create(model="tiny-qwen3", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for c in message.tool_calls:
                output = lookup(**json.loads(c.function.arguments))
                messages.append({"role": "tool", "tool_call_id": c.id, "content": output})
    assert messages[-1]["content"] == "The value of alpha is 42."
    branches = gateway.sessions["compactor"].branches
    assert [(b.reason, b.parent, b.calls) for b in branches] == [
        (Reason.FIRST, None, 3),
        (Reason.COMPACTION, 0, 1),
    ]
    seen = gateway.engine.seen  # type: ignore[attr-defined]
    assert_exact(branches[0].trajectory("compactor"), seen[:3])
    assert_exact(branches[1].trajectory("compactor"), seen[3:])
    assert 0 < branches[1].shared_tokens < len(seen[3][0])  # the system prompt and tools


def test_images_through_the_gateway_are_exact(tmp_path: Path) -> None:
    """A real VLM (random-init tiny Qwen3-VL on the embedded engine): images in OpenAI user messages
    and in an Anthropic tool result, over several turns; every branch holds exactly the tokens and
    images the engine conditioned on."""
    import anthropic
    from gateway_fixtures import Recorder
    from PIL import Image, ImageDraw

    from turnrl.app.engines import hf_engine
    from turnrl.chat.encoder import ChatEncoder
    from turnrl.gateway import GatewayConfig
    from turnrl.gateway.server import Gateway
    from turnrl.gateway.store import CallLog
    from turnrl.tools.parsers import get_parser
    from turnrl.vision.content import data_url

    def picture(i: int) -> str:
        image = Image.new("RGB", (56 + 14 * i, 42), (40 * i % 255, 90, 160))
        ImageDraw.Draw(image).rectangle((2, 2, 10 + i, 12), fill=(255, 255, 0))
        return data_url(image)

    engine = hf_engine("tiny-qwen3-vl", seed=0)
    stops = list(range(0, 151000, 7))  # the random model rarely samples eos: short turns
    config = GatewayConfig.model_validate(
        {
            "model": "tiny-qwen3-vl",
            "output_dir": str(tmp_path),
            "sampling": {"max_tokens": 12, "stop_token_ids": stops},
        }
    )
    encoder = ChatEncoder(engine.tokenizer, vision=engine.vision)
    gateway = Gateway(Recorder(engine), encoder, get_parser("hermes"), config, CallLog(tmp_path))

    def image_part(i: int) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": picture(i)}}

    with serving(gateway) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="eyes", max_retries=0)
        messages: list[Any] = [
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image_part(0)]}
        ]
        for turn in range(1, 3):
            reply = client.chat.completions.create(model="tiny-qwen3-vl", messages=messages)
            parts = [{"type": "text", "text": f"And now {turn}?"}, image_part(turn), image_part(turn + 3)]
            messages += [
                reply.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": parts},
            ]
        edited = [
            *messages[:2],
            {"role": "user", "content": [{"type": "text", "text": "No:"}, image_part(7)]},
        ]
        client.chat.completions.create(model="tiny-qwen3-vl", messages=edited)  # forks after the first reply
        bad = {"type": "image_url", "image_url": {"url": "/etc/passwd"}}
        with pytest.raises(Exception, match="data:image"):
            client.chat.completions.create(
                model="tiny-qwen3-vl", messages=[{"role": "user", "content": [bad]}]
            )
        claude = anthropic.Anthropic(base_url=url, api_key="claude-eyes", max_retries=0)
        png = picture(5).split(",", 1)[1]
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
        history: list[Any] = [
            {"role": "user", "content": "Take a screenshot."},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [image]}],
            },
        ]
        tools = [{"name": "screenshot", "description": "The screen.", "input_schema": {"type": "object"}}]
        for _ in range(2):
            answer = claude.messages.create(
                model="tiny-qwen3-vl", max_tokens=12, messages=history, tools=tools
            )  # type: ignore[arg-type]
            history += [
                {"role": "assistant", "content": [b.model_dump() for b in answer.content] or ""},
                {"role": "user", "content": [image, {"type": "text", "text": "And this one?"}]},
            ]
    seen = gateway.engine.seen  # type: ignore[attr-defined]
    assert len(seen) == 5
    for name in ("eyes", "claude-eyes"):
        for branch in gateway.sessions[name].branches:
            traj = branch.trajectory(name)
            held = calls_on(gateway, name, branch.index)
            assert_exact(traj, [seen[k] for k in held])
            assert len(traj.images) == gateway.engine.images[held[-1]]  # type: ignore[attr-defined]
    reasons = [b.reason for b in gateway.sessions["eyes"].branches]
    assert reasons[0] == Reason.FIRST and reasons[-1] in (Reason.EDIT, Reason.CUT_REPLY)
    assert gateway.engine.images == [1, 3, 2, 1, 2]  # type: ignore[attr-defined]  # every image so far, each call
    branches = [
        b.trajectory(name) for name in ("eyes", "claude-eyes") for b in gateway.sessions[name].branches
    ]
    on_disk = read_branches(tmp_path / "calls.jsonl")
    assert [t.input_ids for t in on_disk] == [t.input_ids for t in branches]
    assert [len(t.images) for t in on_disk] == [len(t.images) for t in branches]
    assert [[i.size for i in t.images] for t in on_disk] == [[i.size for i in t.images] for t in branches]


def test_a_weight_update_lets_calls_in_flight_finish_and_holds_new_ones(
    qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    """Call A is generating when an update starts: it finishes under version 0 before the update
    runs; call B, sent during the update, reaches the engine only after it, under version 1."""
    from turnrl.gateway.call import ChatRequest

    class Versioned(ScriptedEngine):
        weight_version = 0

    engine = Versioned(qwen3_tokenizer, [ScriptedReply(text="Old weights.", delay_s=1.0), "New weights."])
    gateway = gateway_for(engine, qwen3_tokenizer, tmp_path)
    seen: list[tuple[str, int]] = []  # (moment, calls the engine had received)

    async def update() -> None:
        seen.append(("update starts", len(engine.calls)))
        await asyncio.sleep(0.5)
        engine.weight_version = 1
        seen.append(("update ends", len(engine.calls)))

    def ask(text: str) -> ChatRequest:
        return ChatRequest("", [{"role": "user", "content": text}], None, None)

    async def scenario() -> tuple[Any, Any]:
        first = asyncio.ensure_future(gateway.answer("a", ask("A")))
        await asyncio.sleep(0.2)  # A is generating
        updating = asyncio.ensure_future(gateway.update_weights(update))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(gateway.answer("b", ask("B")))
        done_a = await first
        seen.append(("A answered", len(engine.calls)))
        await updating
        return done_a, await second

    done_a, done_b = asyncio.run(scenario())
    assert done_a.reply.text == "Old weights." and done_b.reply.text == "New weights."
    assert ("update starts", 1) in seen and ("update ends", 1) in seen  # B waited for the update
    versions = {
        n: set(s.branches[0].episode.record.policy_versions) - {-1} for n, s in gateway.sessions.items()
    }
    assert versions == {"a": {0}, "b": {1}}


def test_an_anthropic_client_given_the_v1_url_and_its_own_model_name_is_answered(
    qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    import anthropic

    gateway = gateway_for(ScriptedEngine(qwen3_tokenizer, ["Hello."]), qwen3_tokenizer, tmp_path)
    with serving(gateway) as url:
        client = anthropic.Anthropic(base_url=f"{url}/v1", api_key="claude-v1", max_retries=0)
        reply = client.messages.create(
            model="claude-sonnet-4-5", max_tokens=16, messages=[{"role": "user", "content": "Hi."}]
        )
    assert reply.content[0].text == "Hello."  # type: ignore[union-attr]
    assert [b.calls for b in gateway.sessions["claude-v1"].branches] == [1]
