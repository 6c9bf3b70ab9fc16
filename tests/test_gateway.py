"""The gateway: real OpenAI SDK clients, unchanged, against a real HTTP server on loopback; every
session is token-exact (the tokens recorded for training are the tokens the engine conditioned on
and sampled), and a rewritten history becomes a new branch that says why."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from gateway_fixtures import ANSWER, CALL, START, TOOLS, assert_exact, gateway_for, serving
from openai import BadRequestError, NotFoundError, OpenAI

from turnrl.engines.scripted import ScriptedEngine
from turnrl.gateway import Reason, read_branches
from turnrl.record.codec import trajectory_to_json
from turnrl.rollout.finish import check_metrics
from turnrl.train.advantages import AdvantageOptions, grpo
from turnrl.types import StopReason


def agent_loop(client: OpenAI, **extra: Any) -> list[dict[str, Any]]:
    """A plain tool agent on the OpenAI SDK: call, run the tools, until an answer."""
    messages: list[dict[str, Any]] = [dict(m) for m in START]
    while True:
        response = client.chat.completions.create(model="tiny-qwen3", messages=messages, tools=TOOLS, **extra)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # the SDK's own serialization
        if not message.tool_calls:
            return messages
        for call in message.tool_calls:
            value = {"alpha": 42}[json.loads(call.function.arguments)["key"]]
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"value": value})}
            )


def test_an_openai_sdk_tool_agent_is_recorded_exactly(qwen3_tokenizer: Any, tmp_path: Path) -> None:
    gateway = gateway_for(ScriptedEngine(qwen3_tokenizer, [CALL, ANSWER]), qwen3_tokenizer, tmp_path)
    with serving(gateway) as url:
        messages = agent_loop(OpenAI(base_url=f"{url}/v1", api_key="agent-1"))
    assert messages[2]["tool_calls"][0]["function"] == {"name": "lookup", "arguments": '{"key": "alpha"}'}
    assert messages[2]["reasoning_content"] == "I should look it up."
    assert messages[-1]["content"] == "The value of alpha is 42."
    session = gateway.sessions["agent-1"]
    assert len(session.branches) == 1  # the echoed reply (re-serialized by the SDK) stood for its tokens
    branch = session.branches[0]
    traj = branch.trajectory("agent-1")
    assert_exact(traj, gateway.engine.seen)  # type: ignore[attr-defined]
    check_metrics(traj, branch.conv, branch.episode.last_token_text, "strict")
    assert traj.metrics["check/ok"] is True and traj.metrics["check/mismatches"] == 0
    on_disk = read_branches(tmp_path / "calls.jsonl")
    assert len(on_disk) == 1 and on_disk[0].input_ids == traj.input_ids
    assert on_disk[0].loss_mask == traj.loss_mask and on_disk[0].rollout_logprobs == traj.rollout_logprobs
    # how its last reply ended, and no reward: nothing scored it, and training says so
    assert on_disk[0].stop_reason == StopReason.MODEL_STOP and on_disk[0].reward is None
    assert trajectory_to_json(on_disk[0])["reward"] is None
    with pytest.raises(ValueError, match="trajectory 'agent-1/0' has no reward: nothing scored it"):
        grpo(on_disk, AdvantageOptions())


def test_a_streamed_reply_carries_the_same_calls(qwen3_tokenizer: Any, tmp_path: Path) -> None:
    gateway = gateway_for(ScriptedEngine(qwen3_tokenizer, [CALL]), qwen3_tokenizer, tmp_path)
    with serving(gateway) as url:
        client = OpenAI(base_url=f"{url}/s/streamer/v1", api_key="unused")
        stream = client.chat.completions.create(
            model="tiny-qwen3",
            messages=START,
            tools=TOOLS,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    calls = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or ()]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("lookup", {"key": "alpha"})
    ]
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "tool_calls"
    usage = chunks[-1].usage
    prompt, sampled = gateway.engine.seen[0]  # type: ignore[attr-defined]
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), len(sampled))
    assert list(gateway.sessions) == ["streamer"]  # the URL names the session


def test_rewritten_histories_start_branches_that_say_why(qwen3_tokenizer: Any, tmp_path: Path) -> None:
    gateway = gateway_for(
        ScriptedEngine(qwen3_tokenizer, [CALL, ANSWER] + ["Fine."] * 5), qwen3_tokenizer, tmp_path
    )
    with serving(gateway) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="rewriter")
        done = agent_loop(client)
        # a client that re-encodes the call's arguments, renames its id and trims the text: the same reply
        echoed = json.loads(json.dumps(done))
        echoed[2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"key": "alpha"}, indent=2)
        echoed[2]["tool_calls"][0]["id"] = "my-own-id"
        echoed[3]["tool_call_id"] = "my-own-id"
        echoed[4]["content"] = "  The value of alpha is 42.\n"
        client.chat.completions.create(
            model="tiny-qwen3", messages=[*echoed, {"role": "user", "content": "Thanks!"}], tools=TOOLS
        )
        retry = [*echoed, {"role": "user", "content": "Thanks!"}]
        client.chat.completions.create(
            model="tiny-qwen3", messages=retry, tools=TOOLS
        )  # the same request again
        compacted = [START[0], {"role": "user", "content": "Summary: alpha is 42. Say it once more."}]
        client.chat.completions.create(model="tiny-qwen3", messages=compacted, tools=TOOLS)
        sub = [{"role": "system", "content": "You write titles."}, {"role": "user", "content": "Title?"}]
        client.chat.completions.create(model="tiny-qwen3", messages=sub)
        edited = [*json.loads(json.dumps(done[:3])), {**done[3], "content": json.dumps({"value": 41})}]
        client.chat.completions.create(model="tiny-qwen3", messages=edited, tools=TOOLS)
    branches = gateway.sessions["rewriter"].branches
    assert [(b.reason, b.parent) for b in branches] == [
        (Reason.FIRST, None),
        (Reason.RETRY, 0),
        (Reason.COMPACTION, 1),
        (Reason.SUBAGENT, 2),
        (Reason.EDIT, 0),
    ]
    assert branches[0].calls == 3  # the agent's two calls and the echoed continuation
    seen = gateway.engine.seen  # type: ignore[attr-defined]
    assert (
        branches[1].shared_tokens == branches[1].fork_at == len(seen[3][0])
    )  # a retry shares its whole prompt
    assert 0 < branches[2].shared_tokens < len(branches[2].episode.prompt_ids)  # the system prompt and tools
    assert branches[2].fork_at is None and branches[3].fork_at is None  # no exact prefix: encoded afresh
    assert_exact(branches[0].trajectory("rewriter"), seen[:3])
    assert_exact(
        branches[1].trajectory("rewriter"), [*seen[:2], seen[3]]
    )  # the agent's calls, then the retry
    assert_exact(branches[2].trajectory("rewriter"), seen[4:5])
    # the edited tool result follows the first call's reply, kept exactly; only the edit is new
    assert branches[4].fork_at == len(seen[0][0]) + len(seen[0][1])
    assert_exact(branches[4].trajectory("rewriter"), [seen[0], seen[6]])
    on_disk = read_branches(tmp_path / "calls.jsonl")
    assert [(t.branch.reason, t.branch.parent) for t in on_disk] == [
        ("first", None), ("retry", 0), ("compaction", 1), ("subagent", 2), ("edit", 0),
    ]  # fmt: skip
    assert [t.input_ids for t in on_disk] == [b.sequence for b in branches]


def test_bad_requests_get_the_apis_errors_and_the_server_goes_on(
    qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    gateway = gateway_for(
        ScriptedEngine(qwen3_tokenizer, ["Hello."]),
        qwen3_tokenizer,
        tmp_path,
        max_session_tokens=64,
        any_model=False,  # by default any name is answered
    )
    with serving(gateway) as url:
        raw = httpx.post(
            f"{url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]
        client = OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        with pytest.raises(NotFoundError, match=r"does not exist.*any_model: true answers any name"):
            client.chat.completions.create(model="gpt-9", messages=START)
        with pytest.raises(BadRequestError, match="at most 16 samples"):
            client.chat.completions.create(model="tiny-qwen3", messages=START, n=17)
        orphan = {"role": "tool", "tool_call_id": "call_nobody_made", "content": "42"}
        with pytest.raises(BadRequestError, match="answers tool call 'call_nobody_made'"):
            client.chat.completions.create(model="tiny-qwen3", messages=[*START, orphan])
        with pytest.raises(BadRequestError, match="unsupported parameter: 'logit_bias'"):
            client.chat.completions.create(model="tiny-qwen3", messages=START, logit_bias={"1": 5})
        with pytest.raises(BadRequestError, match="role is 'robot'"):
            client.chat.completions.create(
                model="tiny-qwen3", messages=[{"role": "robot", "content": "beep"}]
            )  # type: ignore[list-item,misc]
        with pytest.raises(BadRequestError, match="max_session_tokens"):
            client.chat.completions.create(
                model="tiny-qwen3", messages=[{"role": "user", "content": "word " * 100}]
            )
        ok = client.chat.completions.create(model="tiny-qwen3", messages=START)  # still serving
        assert ok.choices[0].message.content == "Hello."
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny-qwen3"
        metrics = httpx.get(f"{url}/metrics").text
    assert "turnrl_gateway_errors_total 7" in metrics and "turnrl_gateway_calls_total 1" in metrics


def lookup_policy(messages: list[dict[str, Any]], images: Any, sample: Any) -> str:
    """A scripted model for ``turnrl gateway``: look the key up, then answer."""
    return ANSWER if messages[-1]["role"] == "tool" else CALL


def test_the_cli_serves_and_a_kill_loses_no_completed_call(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    """``turnrl gateway CONFIG`` as a user starts it; an agent runs twice; ``kill -9``; every
    completed call is on disk, each session valid up to its last call."""
    config = {
        "model": str(tiny_qwen3_dir),
        "engine": {"kind": "scripted", "policy": "test_gateway:lookup_policy"},
        "output_dir": str(tmp_path / "gw"),
        "port": 0,
        "served_name": "tiny-qwen3",
    }
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "HF_HUB_OFFLINE": "1", "TERM": "dumb"}
    command = [sys.executable, "-m", "turnrl.cli", "gateway", str(tmp_path / "gateway.yaml")]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    timer = threading.Timer(120, proc.kill)  # a gateway that never says where it serves fails the test
    timer.start()
    try:
        url = None
        assert proc.stderr is not None
        for line in proc.stderr:
            found = re.search(r"at (http://\S+)/v1", line)
            if found:
                url = found.group(1)
                break
        assert url is not None, "the gateway never said where it serves"
        for agent in ("first", "second"):
            messages = agent_loop(OpenAI(base_url=f"{url}/v1", api_key=agent))
            assert messages[-1]["content"] == "The value of alpha is 42."
    finally:
        timer.cancel()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()
    branches = read_branches(tmp_path / "gw" / "calls.jsonl")
    assert [(t.branch.session, t.branch.reason, t.num_turns) for t in branches] == [
        ("first", "first", 2),
        ("second", "first", 2),
    ]
    assert all(
        sum(t.loss_mask) > 0 and len(t.input_ids) == len(t.prompt_ids) + len(t.loss_mask) for t in branches
    )
    # `turnrl view` shows a gateway's folder: every session's branches
    viewed = subprocess.run(
        [sys.executable, "-m", "turnrl.cli", "view", str(tmp_path / "gw")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert viewed.returncode == 0, viewed.stderr
    page = (tmp_path / "gw" / "view.html").read_text()
    assert '"session": "first"' in page and '"session": "second"' in page


def test_the_embedded_engine_behind_the_gateway_is_exact(
    tiny_qwen3_dir: Path, qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    """A real model (random-init tiny Qwen3 on the embedded engine): whatever it samples, each branch
    holds exactly the tokens it conditioned on and sampled."""
    from turnrl.app.engines import hf_engine
    from turnrl.config import HFEngineConfig

    engine = hf_engine(str(tiny_qwen3_dir), HFEngineConfig())
    gateway = gateway_for(engine, qwen3_tokenizer, tmp_path, sampling={"max_tokens": 12, "temperature": 1.0})
    with serving(gateway) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="real")
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi there."}]
        for turn in range(3):
            reply = client.chat.completions.create(model="tiny-qwen3", messages=messages, logprobs=True)
            messages += [
                reply.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": f"More {turn}."},
            ]
            lps = reply.choices[0].logprobs
            assert lps is not None and len(lps.content or []) == reply.usage.completion_tokens  # type: ignore[union-attr]
    seen = gateway.engine.seen  # type: ignore[attr-defined]
    branches = gateway.sessions["real"].branches
    assert sum(b.calls for b in branches) == 3
    start = 0
    for branch in branches:
        assert_exact(branch.trajectory("real"), seen[start : start + branch.calls])
        start += branch.calls
    assert [b.reason for b in branches] == [Reason.FIRST]  # replies cut at max_tokens continue the branch
