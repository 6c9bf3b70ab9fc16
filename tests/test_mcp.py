"""MCP tools against a real MCP server process (tests/mcp_server.py, on the official SDK): over stdio
and streamable HTTP, schemas as OpenAI functions, exact tokens in a rollout, and every failure a
tool error for the model or one clear line at load time."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from turnrl.chat.encoder import ChatEncoder
from turnrl.engines.process import free_port, port_in_use
from turnrl.engines.scripted import ScriptedEngine
from turnrl.env.tool_env import ToolEnv
from turnrl.rollout.loop import RolloutSpec, run_trajectory
from turnrl.tools import BaseTool, ToolConfigError, load_tools_config
from turnrl.tools.mcp import MCPTool
from turnrl.types import Limits, Sample, SamplingParams, StopReason

pytest.importorskip("mcp")  # installed by the test command (the envs extra): never skipped in CI

SERVER = str(Path(__file__).with_name("mcp_server.py"))
STDIO = {"command": sys.executable, "args": [SERVER, "stdio"]}


def load(servers: dict[str, Any], **block: Any) -> list[BaseTool]:
    return load_tools_config({"tools": [{"mcp": {"servers": servers, **block}}]})


@pytest.fixture(scope="module")
def stdio_tools() -> list[BaseTool]:
    return load({"calc": STDIO})


@pytest.fixture(scope="module")
def http_url() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "http", str(port)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not port_in_use(port):
            assert proc.poll() is None and time.monotonic() < deadline, "the MCP HTTP server did not start"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def by_name(tools: list[BaseTool], name: str) -> BaseTool:
    return next(t for t in tools if t.name == name)


def test_an_mcp_servers_tools_become_openai_functions(stdio_tools: list[BaseTool]) -> None:
    assert {t.name for t in stdio_tools} == {"add", "lookup", "slow", "square", "crash", "pid"}
    schema = by_name(stdio_tools, "add").schema
    assert schema["type"] == "function" and schema["function"]["name"] == "add"
    assert schema["function"]["description"] == "Add two integers."
    params = schema["function"]["parameters"]
    assert params["type"] == "object" and params["required"] == ["a", "b"]
    assert {k: v["type"] for k, v in params["properties"].items()} == {"a": "integer", "b": "integer"}
    assert "$schema" not in params and "title" not in params


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


async def test_a_rollout_calls_mcp_tools_with_exact_tokens(
    stdio_tools: list[BaseTool], qwen3_tokenizer: Any
) -> None:
    replies = [call("lookup", key="alpha") + "\n" + call("lookup", key="beta"), call("add", a=17, b=23), "40"]
    spec = RolloutSpec(
        env_factory=lambda s: ToolEnv(s, stdio_tools),
        engine=ScriptedEngine(qwen3_tokenizer, replies),
        encoder=ChatEncoder(qwen3_tokenizer, {"enable_thinking": False}),
        sampling=SamplingParams(max_tokens=96),
        limits=Limits(max_turns=4),
    )
    prompt = [{"role": "user", "content": "Add the values of alpha and beta."}]
    traj = await run_trajectory(Sample("s", prompt), spec)
    assert traj.stop_reason is StopReason.NO_TOOL_CALL and traj.num_turns == 3
    tool_texts = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert tool_texts == ["17", "23", "40"]
    assert traj.info["num_tool_calls"] == 3 and traj.info["num_tool_errors"] == 0
    assert traj.turns[0].info["tool_metrics"] == [{"mcp_server": "calc"}, {"mcp_server": "calc"}]
    assert traj.metrics["check/ok"] is True and traj.metrics["check/mismatches"] == 0


async def test_images_and_errors_of_mcp_tools(stdio_tools: list[BaseTool]) -> None:
    env = ToolEnv(Sample("s", [{"role": "user", "content": "go"}]), stdio_tools)
    await env.reset()
    result = await env.step(call("square", size=3) + call("lookup", key="zeta") + call("add", a="x", b=1))
    square, missing, bad = result.observation
    assert square["content"][0]["image"].size == (3, 3)  # an image part, for VLMs
    assert missing["content"] == "Error: Error executing tool lookup: no key 'zeta'; keys: alpha, beta"
    assert bad["content"].startswith("Error: ") and result.info["num_tool_errors"] == 2
    await env.close()


async def test_a_server_that_dies_mid_call_is_a_tool_error_and_comes_back(qwen3_tokenizer: Any) -> None:
    tools = load({"fragile": STDIO})
    tool = by_name(tools, "pid")
    assert isinstance(tool, MCPTool)
    first = (await tool.execute("i", {})).text
    env = ToolEnv(Sample("s", [{"role": "user", "content": "go"}]), tools)
    await env.reset()
    died = await env.step(call("crash"))
    (message,) = died.observation
    assert message["content"].startswith("Error: MCP server 'fragile'")
    assert "died during the call" in message["content"] and "crashing on purpose" in message["content"]
    assert died.info["num_tool_errors"] == 1
    again = await env.step(call("pid"))  # the next call starts the server again
    assert again.info["num_tool_errors"] == 0 and again.observation[0]["content"] != first
    assert tool.connection.restarts == 1
    await env.close()


async def test_a_slow_call_times_out_and_the_server_goes_on(stdio_tools: list[BaseTool]) -> None:
    # 2 s: far below the slow call's 5 s, far above a healthy call's round trip on a loaded machine
    env = ToolEnv(Sample("s", [{"role": "user", "content": "go"}]), stdio_tools, tool_timeout_s=2.0)
    await env.reset()
    result = await env.step(call("slow", seconds=5) + call("add", a=1, b=2))
    slow, add = result.observation
    assert slow["content"] == "Error: tool 'slow' timed out after 2 s" and add["content"] == "3"
    assert (await env.step(call("add", a=2, b=2))).observation[0]["content"] == "4"
    await env.close()


async def test_tools_over_streamable_http(http_url: str) -> None:
    tools = load({"remote": {"url": http_url}}, tools=["add", "lookup"], prefix=True)
    assert [t.name for t in tools] == ["remote__add", "remote__lookup"]
    env = ToolEnv(Sample("s", [{"role": "user", "content": "go"}]), tools)
    await env.reset()
    result = await env.step(call("remote__add", a=20, b=22) + call("remote__lookup", key="beta"))
    assert [m["content"] for m in result.observation] == ["42", "23"]
    await env.close()
    tool = tools[0]
    assert isinstance(tool, MCPTool)
    tool.connection.close()  # before the server: its session is ended cleanly


def test_servers_from_a_claude_desktop_style_file(tmp_path: Path) -> None:
    (tmp_path / "servers.json").write_text(json.dumps({"mcpServers": {"calc": STDIO}}))
    config = tmp_path / "tools.yaml"  # verl's keys; the file's path is relative to the config
    config.write_text("tools:\n  - mcp: {mcp_servers_config_path: servers.json, tool_selected_list: [add]}\n")
    (tool,) = load_tools_config(config)
    assert tool.name == "add"


@pytest.mark.parametrize(
    ("servers", "block", "message"),
    [
        (
            {"broken": {**STDIO, "env": {"MCP_TEST_FAIL_AT_START": "no licence"}}},
            {},
            "tools[0].mcp: MCP server 'broken' (",
        ),
        ({"gone": {"command": "/no/such/server"}}, {}, "MCP server 'gone' (/no/such/server) "),
        ({"calc": STDIO}, {"tools": ["add", "divide"]}, "MCP tools ['divide'] are not offered"),
        ({"both": {"command": "x", "url": "http://x"}}, {}, "needs exactly one of 'command'"),
        ({"calc": STDIO}, {"tool_list": ["add"]}, "unknown key(s) ['tool_list']"),
    ],
)
def test_bad_mcp_setups_are_one_line_errors(
    servers: dict[str, Any], block: dict[str, Any], message: str
) -> None:
    with pytest.raises(ToolConfigError) as info:
        load(servers, start_timeout_s=30, **block)
    text = str(info.value)
    assert message in text and "\n" not in text
    if "broken" in servers:
        assert "its stderr ends: cannot start: no licence" in text
