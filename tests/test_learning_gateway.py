"""The learning gateway: it serves real clients, takes their rewards over HTTP, trains the served
model in the background and swaps the new weights in between calls; bad rewards are refused and
counted; a killed one resumes from its folder with no rewarded session lost or trained twice."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml
from gateway_fixtures import served
from openai import OpenAI
from rich.console import Console

from turnrl.app.learner import ProcessLearner
from turnrl.app.learning import Baselines, Learning, LearningGatewayConfig
from turnrl.chat.encoder import ChatEncoder
from turnrl.gateway.rewards import LEARNED, REWARDED, RewardDesk
from turnrl.gateway.routes import make_app
from turnrl.gateway.server import Gateway
from turnrl.gateway.store import CallLog
from turnrl.support.cpus import usable_cores
from turnrl.tools.parsers import get_parser

HELD_OUT_SCORES: list[float] = []  # what the held-out reward below answers, in turn


def held_out_reward(sample: Any, reply: str) -> float:
    """A held-out reward that says what the test wants: the served weights' score, then the new."""
    return HELD_OUT_SCORES.pop(0) if HELD_OUT_SCORES else 0.0


def session_reward(messages: list[dict[str, Any]]) -> float | None:
    """A reward function over a finished session: by its first user message."""
    asked = messages[0]["content"]
    return {"score me": 0.75, "leave me": None, "broken": float("inf")}[asked]


def learning_gateway(
    tiny_qwen3_dir: Path, tokenizer: Any, out: Path, max_tokens: int = 12, **learn: Any
) -> tuple[Gateway, RewardDesk, Learning]:
    from turnrl.app.engines import hf_engine
    from turnrl.config import HFEngineConfig

    config = LearningGatewayConfig.model_validate(
        {
            "model": str(tiny_qwen3_dir),
            "output_dir": str(out),
            "sampling": {"max_tokens": max_tokens, "temperature": 1.0},
            "learn": {"sessions_per_step": 2, "optim": {"lr": 1e-3}, "learner": "thread", **learn},
        }
    )
    engine = hf_engine(str(tiny_qwen3_dir), HFEngineConfig())
    gateway = Gateway(engine, ChatEncoder(tokenizer), get_parser("hermes"), config, CallLog(out))
    desk = RewardDesk(gateway, out / "learn", config.learn.expire_s)
    return gateway, desk, Learning(config, gateway, desk, Console(stderr=True, quiet=True))


def chat(url: str, session: str, text: str) -> str:
    client = OpenAI(base_url=f"{url}/s/{session}/v1", api_key="unused", max_retries=0)
    try:
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}])
        return reply.choices[0].message.content or ""
    finally:
        client.close()


def reward(url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/rewards", json=body, timeout=30)


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in /metrics")


def _children(pid: int) -> set[int]:
    """The processes whose parent is ``pid``."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def until(check: Any, timeout_s: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_each_task_is_measured_against_its_own_running_mean() -> None:
    baselines = Baselines(0.5)
    assert baselines.advantage("a", 1.0) == 1.0  # nothing seen yet: against 0
    assert baselines.advantage("a", 1.0) == 0.5  # a's baseline is 0.5 now, then 0.75
    assert baselines.advantage("b", 0.0) == -0.75  # a new task: against every task's mean
    assert baselines.advantage("a", 0.0) == -0.75  # b's rewards do not move a's baseline
    assert baselines.values == {"a": 0.375, "b": 0.375}


def test_rewards_train_the_served_model_and_stale_sessions_are_left_out(
    tiny_qwen3_dir: Path, qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    gateway, desk, learning = learning_gateway(
        tiny_qwen3_dir, qwen3_tokenizer, tmp_path, algorithm={"max_staleness": 0}, learner="process"
    )
    before = learning.learner.call("state_dict")
    with served(gateway, make_app(gateway, desk, [learning.metrics])) as (url, loop):
        task = asyncio.run_coroutine_threadsafe(learning.run(), loop)
        for k in range(4):  # four sessions sampled under version 0
            chat(url, f"user{k}", f"Question {k}?")
        assert reward(url, session="user0", reward=1.0, task="q").json()["branches"] == 1
        assert reward(url, session="user1", reward=0.0, task="q").status_code == 200
        until(lambda: learning.step == 1, what="the first step")
        until(lambda: gateway.engine.weight_version == 1, what="the new weights served")
        assert metric(url, "turnrl_learn_steps_total") == 1
        # the other two were sampled by version 0: one version too old for max_staleness 0
        reward(url, session="user2", reward=1.0, task="q")
        reward(url, session="user3", reward=0.0, task="q")
        until(lambda: learning.counts["stale"] == 2, what="the two left out")
        time.sleep(0.5)
        assert learning.step == 1 and gateway.engine.weight_version == 1  # no step: nothing fresh
        chat(url, "later", "Another question?")  # a call after the swap: sampled by version 1
        versions = {v for v in gateway.sessions["later"].branches[0].episode.record.policy_versions if v >= 0}
        assert versions == {1}
        assert metric(url, "turnrl_learn_sessions_learned_total") == 4
        assert metric(url, "turnrl_learn_sessions_stale_total") == 2
        # the learner in a process of its own (learn.learner: process), at nice 19: it only takes
        # the CPU that serving leaves (learn.nice), on half the cores (learn.threads)
        assert isinstance(learning.learner, ProcessLearner) and learning.learner.call("niceness") == 19
        assert learning.learner.call("threads") == max(1, usable_cores() // 2)
        assert learning.learner.pid != os.getpid() and learning.learner.pid in _children(os.getpid())
        changed = [k for k, v in learning.learner.call("state_dict").items() if not torch.equal(v, before[k])]
        assert changed  # the policy learned from the rewarded sessions
        # a learner killed (for memory, say) fails its steps, counted; the gateway goes on serving
        os.kill(learning.learner.pid, signal.SIGKILL)
        for k in (4, 5):
            chat(url, f"user{k}", f"Question {k}?")
            reward(url, session=f"user{k}", reward=float(k % 2), task="q")
        until(lambda: learning.counts["failed_steps"] == 1, what="the step without a learner, failed")
        assert metric(url, "turnrl_learn_failed_steps_total") == 1 and learning.step == 1
        assert chat(url, "after", "Still there?") is not None and gateway.engine.weight_version == 1
        task.cancel()
    learning.learner.close()
    learned = [json.loads(line) for line in (tmp_path / "learn" / LEARNED).read_text().splitlines()]
    assert {r["session"]: (r["step"], r.get("left_out")) for r in learned} == {
        "user0": (1, None), "user1": (1, None), "user2": (1, "stale"), "user3": (1, "stale"),
        "user4": (2, "failed"), "user5": (2, "failed"),
    }  # fmt: skip


def test_bad_rewards_are_refused_counted_and_never_trained(
    tiny_qwen3_dir: Path, qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    gateway, desk, learning = learning_gateway(tiny_qwen3_dir, qwen3_tokenizer, tmp_path, expire_s=0.5)
    with served(gateway, make_app(gateway, desk, [learning.metrics])) as (url, _):
        chat(url, "kept", "Hello?")
        chat(url, "forgotten", "Hello?")
        assert reward(url, session="nobody", reward=1.0).status_code == 404
        raw = httpx.post(
            f"{url}/v1/rewards", content=b'{"session": "kept", "reward": NaN}', timeout=30
        )  # Python's json reads NaN
        assert raw.status_code == 400 and "finite" in raw.json()["error"]["message"]
        assert reward(url, session="kept", reward="1").status_code == 400
        assert reward(url, session="kept", reward=1.0, branch=3).status_code == 400
        assert reward(url, session="kept", reward=1.0, extra=1).status_code == 400
        assert reward(url, session="kept", reward=0.5).status_code == 200
        again = reward(url, session="kept", reward=0.5)
        assert again.status_code == 409 and "already" in again.json()["error"]["message"]
        time.sleep(0.6)
        assert desk.expire() == ["forgotten"]
        assert reward(url, session="forgotten", reward=1.0).status_code == 410
        text = httpx.get(f"{url}/metrics", timeout=30).text
    for reason, n in (("unknown", 1), ("invalid", 4), ("duplicate", 1), ("expired", 1)):
        assert f'turnrl_learn_rewards_refused_total{{reason="{reason}"}} {n}' in text
    assert "turnrl_learn_sessions_expired_total 1" in text and "turnrl_learn_rewards_total 1" in text
    assert [t[0].branch.session for t in desk.ready if t[0].branch] == ["kept"]  # only the good one waits
    rewarded = (tmp_path / "learn" / REWARDED).read_text().splitlines()
    assert [json.loads(line)["reward"] for line in rewarded] == [0.5]


def test_a_reward_function_scores_finished_sessions(
    tiny_qwen3_dir: Path, qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    gateway, desk, learning = learning_gateway(
        tiny_qwen3_dir, qwen3_tokenizer, tmp_path, reward=f"{__name__}:session_reward", finished_s=0.4,
        sessions_per_step=4,
    )  # fmt: skip
    with served(gateway, make_app(gateway, desk, [learning.metrics])) as (url, loop):
        task = asyncio.run_coroutine_threadsafe(learning.run(), loop)
        for name in ("score me", "leave me", "broken"):
            chat(url, name.replace(" ", "-"), name)
        until(lambda: metric(url, "turnrl_learn_rewards_total") == 1, what="the finished session scored")
        time.sleep(1.0)  # more rounds of the learner: nothing else is scored
        text = httpx.get(f"{url}/metrics", timeout=30).text
        task.cancel()
    assert [(t[0].branch.session, t[0].reward) for t in desk.ready if t[0].branch] == [("score-me", 0.75)]
    assert 'turnrl_learn_rewards_refused_total{reason="scored"} 1' in text
    assert set(gateway.sessions) == {"leave-me", "broken"}  # left for a reward over HTTP, or expiry


def test_a_step_that_scores_worse_on_held_out_prompts_is_held_back(
    tiny_qwen3_dir: Path, qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    rows = tmp_path / "held_out.jsonl"
    rows.write_text(json.dumps({"prompt": [{"role": "user", "content": "Say hi."}]}) + "\n")
    HELD_OUT_SCORES[:] = [1.0, 0.2]  # served: 1.0; the new weights: 0.2, past the margin of 0.1
    hold = {"data": {"path": str(rows)}, "reward": f"{__name__}:held_out_reward", "max_tokens": 4}
    gateway, desk, learning = learning_gateway(
        tiny_qwen3_dir, qwen3_tokenizer, tmp_path, hold_back=hold
    )  # the learner's thread (the default): the held-out reward's scores are this module's
    served_weights = learning.learner.call("state_dict")
    with served(gateway, make_app(gateway, desk, [learning.metrics])) as (url, loop):
        asyncio.run_coroutine_threadsafe(learning.start(), loop).result(60)
        assert learning.served_score == 1.0
        chat(url, "a", "One?")
        chat(url, "b", "Two?")
        reward(url, session="a", reward=1.0)
        reward(url, session="b", reward=0.0)
        asyncio.run_coroutine_threadsafe(learning.learn_step(), loop).result(120)
        assert metric(url, "turnrl_learn_held_back_total") == 1
    assert gateway.engine.weight_version == 0  # users keep the served weights
    learned = [json.loads(line) for line in (tmp_path / "learn" / LEARNED).read_text().splitlines()]
    assert {r["session"]: r.get("left_out") for r in learned} == {"a": "held_back", "b": "held_back"}
    for name, value in learning.learner.call("state_dict").items():
        assert torch.equal(value, served_weights[name]), f"{name}: the learner went on from held-back weights"


def test_an_in_flight_swap_serves_new_weights_without_waiting_for_the_calls_under_way(
    tiny_qwen3_dir: Path, qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    """``learn.swap: in_flight``: a step's weights go in while streamed calls generate, without
    waiting for them; no call is lost, and a reply that spans the swap records its tokens' versions
    as sampled, the old then the new (never silently one)."""
    gateway, desk, learning = learning_gateway(
        tiny_qwen3_dir, qwen3_tokenizer, tmp_path, max_tokens=1000, swap="in_flight", nice=0
    )  # long replies; the learner's thread not starved by them
    with served(gateway, make_app(gateway, desk, [learning.metrics])) as (url, loop):
        started = threading.Barrier(4)
        texts: dict[int, str] = {}

        def call(k: int) -> None:
            client = OpenAI(base_url=f"{url}/s/long{k}/v1", api_key="unused", max_retries=0)
            stream = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"Tell a long story {k}."}], stream=True
            )
            parts = []
            for n, chunk in enumerate(stream):
                if n == 3:  # a few tokens in
                    started.wait(60)
                parts.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
            texts[k] = "".join(parts)

        threads = [threading.Thread(target=call, args=(k,)) for k in range(3)]
        for thread in threads:
            thread.start()
        started.wait(60)  # every call is streaming
        asyncio.run_coroutine_threadsafe(learning._serve(), loop).result(60)
        assert gateway._generating == 3  # the swap did not wait for them
        for thread in threads:
            thread.join(120)
    assert sorted(texts) == [0, 1, 2] and gateway.counts["errors"] == 0
    assert gateway.engine.weight_version == 1
    for k in range(3):
        record = gateway.sessions[f"long{k}"].branches[0].episode.record
        versions = [v for v in record.policy_versions if v >= 0]
        assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions), f"call {k}"


def _gateway_process(config: Path, *flags: str) -> tuple[subprocess.Popen[str], str, list[str]]:
    """``turnrl gateway CONFIG`` as a user starts it: the process, its URL, its stderr lines so far
    (read on, so that the pipe never fills)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TERM="dumb", HF_HUB_OFFLINE="1")
    # a process group of its own, as a terminal gives it
    process = subprocess.Popen(
        [sys.executable, "-m", "turnrl.cli", "gateway", str(config), *flags],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)
            if re.search(r"at (http://\S+)/v1", line):
                found.set()

    threading.Thread(target=read, daemon=True).start()
    if not found.wait(180):
        process.kill()
        raise AssertionError("the gateway did not start:\n" + "".join(lines))
    url = next(m.group(1) for line in lines if (m := re.search(r"at (http://\S+)/v1", line)))
    return process, url, lines


def _ended(process: subprocess.Popen[str]) -> None:
    process.wait(60)
    if process.stderr is not None:
        process.stderr.close()


def test_a_killed_learning_gateway_resumes_with_no_rewarded_session_lost(
    tiny_qwen3_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    config = tmp_path / "gateway.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_qwen3_dir),
                "served_name": "m",
                "output_dir": str(out),
                "port": 0,
                "sampling": {"max_tokens": 8, "temperature": 1.0},
                "learn": {
                    "sessions_per_step": 2,
                    "optim": {"lr": 1e-3},
                    "train": {"save_every": 1},
                    "learner": "process",  # a process of its own: none left behind by a kill
                },
            }
        )
    )
    process, url, _ = _gateway_process(config)
    try:
        for k in range(3):
            chat(url, f"s{k}", f"Question {k}?")
            assert reward(url, session=f"s{k}", reward=float(k % 2)).status_code == 200
        learned = out / "learn" / LEARNED  # written once the step's checkpoint is
        until(lambda: learned.is_file() and len(learned.read_text().splitlines()) == 2, what="step 1 saved")
        children = _children(process.pid)  # the learner's process among them
    finally:
        process.send_signal(signal.SIGKILL)  # s2 is rewarded, not trained on
        _ended(process)
    assert children  # the learner, and multiprocessing's resource tracker
    until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), 30, "no process left behind")
    process, url, said = _gateway_process(config, "--resume")
    try:
        assert any("resumed at step 1" in line for line in said), "".join(said)
        assert metric(url, "turnrl_learn_weight_version") == 1  # the checkpoint's weights are served
        assert metric(url, "turnrl_learn_sessions_waiting") == 1  # s2 is back
        chat(url, "s3", "Question 3?")
        reward(url, session="s3", reward=1.0)
        until(lambda: len(learned.read_text().splitlines()) == 4, what="the step after the restart, saved")
        assert metric(url, "turnrl_learn_steps_total") == 2
        assert reward(url, session="s0", reward=1.0).status_code == 409  # rewarded before the kill
    finally:
        process.send_signal(signal.SIGTERM)
        _ended(process)
    assert process.returncode == 0, "".join(said)  # SIGTERM: a clean stop, the update under way ended
    assert not any("Traceback" in line or "terminate called" in line for line in said), "".join(said)
    rows = [json.loads(line) for line in learned.read_text().splitlines()]
    assert sorted(r["session"] for r in rows) == ["s0", "s1", "s2", "s3"]  # each once
    assert [r["step"] for r in rows] == [1, 1, 2, 2]
    process, url, said = _gateway_process(config, "--overwrite")  # a fresh start: nothing of before
    try:
        assert metric(url, "turnrl_learn_weight_version") == 0
        assert reward(url, session="s0", reward=1.0).status_code == 404
    finally:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in its terminal: the learner's process gets it too
        _ended(process)
    assert process.returncode == 0 and not any("Traceback" in line for line in said), "".join(said)
    assert len(learned.read_text().splitlines()) == 4  # it answered no call: what it set aside is put back


@pytest.mark.parametrize(
    "bad",
    ["{learn: {sessions_per_step: 0}}", "{learn: {}, engine: {kind: openai, urls: ['http://127.0.0.1:9']}}"],
)
def test_a_bad_learn_section_is_one_line(bad: str, tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"model": "tiny-qwen3", **yaml.safe_load(bad)}))
    done = subprocess.run(
        [sys.executable, "-m", "turnrl.cli", "gateway", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert ("sessions_per_step" in done.stderr) or ("'openai' cannot take them" in done.stderr), done.stderr
