"""Agent harnesses: real agent processes (the plain openai SDK) against a real gateway on loopback,
scored into trajectories; what a run that misbehaves becomes; advantages over runs, not branches;
and ``turnrl train`` on a harness, end to end."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from gateway_fixtures import START, Recorder, assert_exact, gateway_for

from turnrl.app.kinds import harness_gateway
from turnrl.chat.encoder import ChatEncoder
from turnrl.config import HarnessConfig, SandboxConfig
from turnrl.engines.scripted import ScriptedEngine
from turnrl.harness import HarnessRunner
from turnrl.harness.process import argv_for, check_command
from turnrl.support.imports import add_search_path, search_path
from turnrl.train.advantages import AdvantageOptions, compute_advantages
from turnrl.train.exclusions import exclude_failures
from turnrl.types import AgentRun, Sample, SamplingParams, SessionBranch, StopReason, Trajectory

ROOT = Path(__file__).resolve().parents[1]
AGENTS = Path(__file__).parent / "harness_agents"
LOOKUP = ROOT / "examples" / "harness"
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "alpha"}}\n</tool_call>'
SAMPLE = Sample(
    "q1",
    [{"role": "user", "content": "What is the secret code of 'alpha'?"}],
    data_source="lookup",
    metadata={"table": {"alpha": "42", "beta": "7"}, "key": "alpha"},
)


def runner_for(
    tokenizer: Any, tmp_path: Path, replies: list[str], **harness: Any
) -> tuple[HarnessRunner, Recorder]:
    add_search_path(LOOKUP)
    config = HarnessConfig.model_validate(
        {"kind": "harness", "reward": "lookup_task:reward", "setup": "lookup_task:setup", **harness}
    )
    engine = Recorder(ScriptedEngine(tokenizer, replies))
    gateway = harness_gateway(config, engine, ChatEncoder(tokenizer), "m", tmp_path)  # type: ignore[arg-type]
    runner = HarnessRunner(config, gateway, tmp_path)
    return runner, engine


def run_once(runner: HarnessRunner, sample: Sample = SAMPLE, index: int = 0) -> list[Trajectory]:
    spec: Any = SimpleNamespace(sampling=SamplingParams(max_tokens=64, seed=1), engine=runner.gateway.engine)

    async def go() -> list[Trajectory]:
        try:
            return await runner(sample, index, spec)
        finally:
            await runner.close()

    return asyncio.run(go())


async def test_runs_that_start_at_once_share_one_gateway_and_close_leaves_no_listener(
    qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    """The first runs of a step (or of a warm start's replays) ask for the gateway together: one
    server starts, and ``close`` stops it (before, each started its own and all but one leaked)."""
    import socket

    runner, _ = runner_for(qwen3_tokenizer, tmp_path, [], command=["true"])
    urls = await asyncio.gather(*(runner.url() for _ in range(4)))
    assert len(set(urls)) == 1
    port = int(urls[0].rsplit(":", 1)[1])
    await runner.close()
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # nothing listens there any more


async def test_a_harness_run_made_again_samples_the_same_tokens(
    tiny_qwen3_model: Any, qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    """A run's calls take seeds from the run's seed, its sample and its group member (as an env
    trajectory's turns do), not from its session's unique name: the same run made again samples the
    same tokens on a real engine, and another member of its group other tokens."""
    from turnrl.engines.hf import HFEngine

    add_search_path(LOOKUP)
    config = HarnessConfig.model_validate(
        {
            "kind": "harness",
            "command": ["python", str(LOOKUP / "lookup_agent.py"), "{prompt}"],
            "reward": "lookup_task:reward",
            "setup": "lookup_task:setup",
        }
    )
    async with HFEngine(tiny_qwen3_model, seed=0) as engine:
        gateway = harness_gateway(config, engine, ChatEncoder(qwen3_tokenizer), "m", tmp_path)
        runner = HarnessRunner(config, gateway, tmp_path)
        spec: Any = SimpleNamespace(
            sampling=SamplingParams(temperature=1.0, max_tokens=24, seed=7), engine=engine
        )
        try:
            first, again, other = [await runner(SAMPLE, index, spec) for index in (0, 0, 1)]
        finally:
            await runner.close()
    assert all(t.stop_reason == StopReason.AGENT_DONE for t in first + again + other)
    assert [t.response_ids for t in first] == [t.response_ids for t in again]
    assert [t.response_ids for t in first] != [t.response_ids for t in other]


class Stuck:
    """An engine whose calls never end (a model mid-generation when the run is stopped)."""

    def __init__(self) -> None:
        self.called = asyncio.Event()

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.called.set()
        await asyncio.Event().wait()

    async def close(self) -> None:
        pass


def test_a_stopped_run_does_not_report_its_calls_in_flight_as_errors(
    qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    """Ctrl-C mid-step: the loop cancels every task, the calls in flight among them; uvicorn logged
    each as an error with two tracebacks. Now it says nothing of them."""
    import logging

    import httpx

    from turnrl.gateway.serving import serve

    stuck = Stuck()
    gateway = gateway_for(stuck, qwen3_tokenizer, tmp_path)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("uvicorn.error")

    async def main() -> None:
        served = await serve(gateway)
        logger.addHandler(handler)  # after uvicorn configured its logging, which drops handlers
        client = httpx.AsyncClient()
        body = {"model": "tiny-qwen3", "messages": START}
        call = asyncio.create_task(client.post(f"{served.url}/v1/chat/completions", json=body))
        await asyncio.wait_for(stuck.called.wait(), 30)
        assert not call.done()
        left = asyncio.all_tasks() - {asyncio.current_task()}
        for task in left:  # what asyncio.run does to the tasks left when Ctrl-C ends the run
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        await client.aclose()
        for listener in served.server.servers:
            listener.close()

    try:
        asyncio.run(main())
    finally:
        logger.removeHandler(handler)
    assert stuck.called.is_set()
    assert [r.getMessage() for r in records if r.levelno >= logging.ERROR] == []


@pytest.mark.parametrize("preload", [[], ["openai"]], ids=["process", "forked"])
def test_an_openai_sdk_agent_is_one_exact_branch_scored_by_its_reward(
    qwen3_tokenizer: Any, tmp_path: Path, preload: list[str]
) -> None:
    command = ["python", str(LOOKUP / "lookup_agent.py"), "{prompt}"]
    runner, engine = runner_for(
        qwen3_tokenizer, tmp_path, [CALL, "<answer>42</answer>"], command=command, preload=preload
    )
    [traj] = run_once(runner)
    assert traj.stop_reason == StopReason.AGENT_DONE, traj.error
    assert traj.reward == 1.0  # the agent looked alpha up in its folder's codes.json and wrote 42
    assert (traj.id, traj.group_id, traj.sample_index) == ("q1/0", "q1", 0)
    assert traj.branch.reason == "first" and traj.run.calls == 2
    assert traj.info["num_tool_calls"] == 1  # counted as an env's tool calls are (summary, step)
    assert_exact(traj, engine.seen)  # trained tokens are exactly what the engine conditioned on
    assert traj.messages[-2]["role"] == "tool" and traj.messages[-2]["content"] == "42"
    assert not list(tmp_path.iterdir()) or not any(tmp_path.rglob("answer.txt"))  # folders removed


def test_a_compacting_agent_leaves_two_branches_each_with_its_own_reward(
    qwen3_tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lookup_task

    monkeypatch.setattr(lookup_task, "reward", lambda sample, result: [0.25, 1.0][: len(result.branches)])
    command = ["python", str(AGENTS / "compacting_agent.py"), "{prompt}"]
    runner, engine = runner_for(qwen3_tokenizer, tmp_path, ["One.", "Two.", "Done."], command=command)
    first, compacted = run_once(runner, index=3)
    assert [first.branch.reason, compacted.branch.reason] == ["first", "compaction"]
    assert (first.id, compacted.id) == ("q1/3", "q1/3/1")
    assert [first.reward, compacted.reward] == [0.25, 1.0]
    assert first.run.reward == compacted.run.reward == 0.625
    assert_exact(first, engine.seen[:2])
    assert_exact(compacted, engine.seen[2:])


@pytest.mark.parametrize(
    ("mode", "stop", "said"),
    [
        ("crash", StopReason.AGENT_ERROR, "the agent exited with code 3: giving up"),
        ("silent", StopReason.AGENT_ERROR, "the agent never called the model (exit code 0)"),
        ("loop", StopReason.TOKEN_BUDGET, "the agent made 3 calls, its limit (env.max_calls)"),
    ],
)
@pytest.mark.parametrize("preload", [[], ["openai"]], ids=["process", "forked"])
def test_a_misbehaving_agent_ends_with_a_stop_reason_of_its_own(
    qwen3_tokenizer: Any, tmp_path: Path, mode: str, stop: StopReason, said: str, preload: list[str]
) -> None:
    command = ["python", str(AGENTS / "stubborn_agent.py"), mode]
    runner, _ = runner_for(
        qwen3_tokenizer, tmp_path, ["Hi."] * 10, command=command, max_calls=3, preload=preload
    )
    trajs = run_once(runner)
    assert {t.stop_reason for t in trajs} == {stop}
    assert trajs[0].error == said
    if stop == StopReason.TOKEN_BUDGET:  # the calls before the limit are kept, and scored
        assert len(trajs) == 1 and trajs[0].run.calls == 3 and trajs[0].num_turns == 3
    kept, left_out = exclude_failures(trajs, keep=False)
    assert (not kept) == (stop in (StopReason.AGENT_ERROR,)) and sum(left_out.values()) == len(trajs) - len(
        kept
    )


def test_an_exit_code_listed_as_scored_is_the_models_failure_scored_and_trained(
    qwen3_tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`codex exec` exits 1 when the model's reply is cut off: with `env.scored_exit_codes: [0, 1]`
    such a run is rewarded and trained (agent_done, its exit code kept); other codes still crash."""
    import lookup_task

    monkeypatch.setattr(lookup_task, "reward", lambda sample, result: 0.0)
    command = ["python", str(AGENTS / "stubborn_agent.py"), "crash"]  # exit 3 after one call
    for scored, stop in (([0, 3], StopReason.AGENT_DONE), ([0, 1], StopReason.AGENT_ERROR)):
        runner, _ = runner_for(
            qwen3_tokenizer, tmp_path / str(scored[1]), ["Hi."], command=command, scored_exit_codes=scored
        )
        [traj] = run_once(runner)
        assert traj.stop_reason == stop and traj.run.exit_code == 3
        kept, _ = exclude_failures([traj], keep=False)
        assert (
            (traj.reward == 0.0 and traj.error is None and kept)
            if stop == StopReason.AGENT_DONE
            else not kept
        )


@pytest.mark.parametrize("preload", [[], ["openai"]], ids=["process", "forked"])
def test_a_timeout_kills_the_agent_and_everything_it_started(
    qwen3_tokenizer: Any, tmp_path: Path, preload: list[str]
) -> None:
    pid_file = (
        tmp_path / "child.pid"
    )  # outside the run's folder: unsandboxed runs (tests/test_isolation.py: sandboxed)
    command = ["python", str(AGENTS / "stubborn_agent.py"), "sleep"]
    env = {"PID_FILE": str(pid_file)}
    runner, _ = runner_for(
        qwen3_tokenizer,
        tmp_path / "runs",
        [],
        command=command,
        timeout_s=3,
        env=env,
        preload=preload,
        sandbox="none",
    )
    t0 = time.monotonic()
    [traj] = run_once(runner)
    assert time.monotonic() - t0 < 30
    assert traj.stop_reason == StopReason.AGENT_TIMEOUT
    assert traj.error and traj.error.startswith("the agent ran past env.timeout_s 3 s and was killed")
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child, "time.sleep(600)") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child, "time.sleep(600)")  # the agent's child is gone from the process table too
    if runner.forks is not None:  # and the fork server, once the runner closed
        assert runner.forks.pid is not None
        while _alive(runner.forks.pid) and time.monotonic() < deadline:  # a loaded machine reaps late
            time.sleep(0.1)
        assert not _alive(runner.forks.pid)


def _alive(pid: int, marker: str = "") -> bool:
    """Whether ``pid`` runs, and is still the process whose command line holds ``marker`` (pids
    are reused within seconds on a busy machine: pid_max is 32768 here)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return "State:\tZ" not in status and marker in cmdline  # a zombie is dead, waiting to be reaped


@pytest.mark.parametrize(
    ("reward", "said"),
    [
        (lambda s, r: 1 / 0, "env.reward: the reward raised ZeroDivisionError at {at}: division by zero"),
        (lambda s, r: math.nan, "env.reward: the reward returned nan: a finite number is needed"),
        (lambda s, r: [1.0, 2.0], "env.reward: the reward returned 2 values for 1 branches"),
    ],
)
def test_a_bad_reward_is_one_line_and_keeps_the_tokens(
    qwen3_tokenizer: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    reward: Any,
    said: str,
) -> None:
    add_search_path(LOOKUP)
    import lookup_task

    monkeypatch.setattr(lookup_task, "reward", reward)
    command = ["python", str(LOOKUP / "lookup_agent.py"), "{prompt}"]
    runner, _ = runner_for(qwen3_tokenizer, tmp_path, [CALL, "<answer>42</answer>"], command=command)
    with caplog.at_level(logging.WARNING, logger="turnrl.harness.runner"):
        [traj] = run_once(runner)
    said = said.format(
        at=f"{reward.__code__.co_filename}:{reward.__code__.co_firstlineno}"
    )  # the user's line
    assert traj.stop_reason == StopReason.INTERNAL_ERROR and traj.error == said
    assert traj.num_turns == 2 and any(traj.loss_mask)
    assert [r.getMessage() for r in caplog.records] == [f"{said} (the run's branches end as internal_error)"]


def test_a_reward_of_none_leaves_the_run_out_and_says_why(
    qwen3_tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lookup_task

    monkeypatch.setattr(lookup_task, "reward", lambda s, r: None)
    command = ["python", str(LOOKUP / "lookup_agent.py"), "{prompt}"]
    runner, _ = runner_for(qwen3_tokenizer, tmp_path, [CALL, "<answer>42</answer>"], command=command)
    trajs = run_once(runner)
    kept, left_out = exclude_failures(trajs, keep=False)
    assert not kept and left_out == {"reward_none": 1}


@pytest.mark.parametrize("sandbox", ["none", "bubblewrap"])
def test_a_forked_run_sees_what_a_new_process_would(
    qwen3_tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sandbox: str
) -> None:
    """The fork server's runs: own folder, argv, sys.path[0], variables, stdin, process group,
    stdout and stderr, as a new ``python`` process's; a preloaded module that prints is not heard.
    Sandboxed, a forked run also has what a new sandboxed process has: no capability, its own
    processes only, the same limits, home and an empty private /tmp."""
    add_search_path(LOOKUP)
    import lookup_task

    tails: list[tuple[str, str]] = []
    probes: dict[str, Any] = {}

    def reward(sample: Sample, result: Any) -> float:
        tails.append((result.stdout, result.stderr))
        probes[result.folder.parents[2].name] = json.loads((result.folder / "probe.json").read_text())
        return 1.0

    monkeypatch.setattr(lookup_task, "reward", reward)
    command = ["python", str(AGENTS / "probe_agent.py"), "{prompt}"]
    seen = {}
    warm = ["turnrl.harness.warm:openai", "turnrl.harness.warm:anthropic"]
    for name, preload in (("process", []), ("forked", ["openai", "noisy_module", *warm])):
        env = {"PROBE_FILE": "{folder}/probe.json", "PROBE_VAR": name, "PYTHONPATH": str(AGENTS)}
        runner, engine = runner_for(
            qwen3_tokenizer,
            tmp_path / name,
            ["Hi."],
            command=command,
            env=env,
            preload=preload,
            sandbox=sandbox if sandbox == "none" else {},
            keep_folders=True,
        )
        [traj] = run_once(runner)
        assert traj.stop_reason == StopReason.AGENT_DONE and traj.reward == 1.0, traj.error
        assert_exact(traj, engine.seen)
        seen[name] = probes[name]
        assert seen[name].pop("var") == name
        assert Path(seen[name].pop("cwd")).name == "work"  # the run's own folder
        seen[name]["few processes"] = seen[name].pop("processes") <= 3  # its PID namespace's, or all
        if sandbox == "none":  # the machine's own /tmp, which other processes change meanwhile
            seen[name].pop("tmp")
    assert seen["forked"] == seen["process"]
    assert seen["forked"]["leader"] and seen["forked"]["argv"][1] == SAMPLE.prompt[0]["content"]
    if sandbox != "none":
        assert all(line.split()[1] == "0000000000000000" for line in seen["forked"]["capabilities"][:4])
        own = [tmp_path.relative_to("/tmp").parts[0]] if tmp_path.is_relative_to("/tmp") else []
        assert seen["forked"]["few processes"] and seen["forked"]["tmp"] == sorted(["home", *own])
    assert tails == [("to stdout\n", "to stderr\n")] * 2


def test_a_forked_run_leaves_the_preloaded_objects_to_the_collectors_permanent_generation(
    tmp_path: Path,
) -> None:
    """The fork server freezes what it holds before each fork, so a run's collections skip the
    preloaded SDK's objects and leave their pages shared; the run's own objects are still
    collected."""
    from turnrl.harness.forkserver import ForkServer

    agent = tmp_path / "agent.py"
    agent.write_text(
        "import gc, json, sys\n"
        "class Cycle:\n    pass\n"
        "a = Cycle(); a.me = a; del a\n"
        "found = gc.collect()\n"
        "json.dump([gc.get_freeze_count(), gc.isenabled(), found], open(sys.argv[1], 'w'))\n"
    )
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    out.touch()
    err.touch()

    async def run() -> int:
        server = ForkServer(["openai"])
        try:
            argv = [sys.executable, str(agent), str(tmp_path / "seen.json")]
            pid = await server.spawn(argv, str(tmp_path), dict(os.environ), str(out), str(err))
            return await server.wait(pid)
        finally:
            await server.close()

    assert asyncio.run(run()) == 0, err.read_text()
    frozen, enabled, found = json.loads((tmp_path / "seen.json").read_text())
    assert frozen > 10_000 and enabled and found >= 1


ENDINGS = {
    "left open": """
import atexit, gc, os, sys, threading, time
gc.disable()  # python's last collection at exit runs anyway
os.kept = open("kept.txt", "w")  # held by a module, as a library holds its own files
os.kept.write("written, never closed")
os.raw = open("kept.bin", "wb")
os.raw.write(b"bytes, never closed")
cycle = [open("cycle.txt", "w")]
cycle.append(cycle)
cycle[0].write("in a cycle")
del cycle
atexit.register(lambda: open("atexit.txt", "w").write("at exit"))
threading.Thread(target=lambda: (time.sleep(0.3), open("thread.txt", "w").write("joined"))).start()
print("no newline", end="")
sys.exit(3)
""",
    "raises": "import json\n\ndef agent():\n    raise ValueError('boom')\n\nagent()\n",
    "says why": "import sys\nprint('out')\nsys.exit('bye')\n",
    "interrupted": "raise KeyboardInterrupt\n",
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_forked_run_ends_as_a_new_process_would(tmp_path: Path, ending: str) -> None:
    """A forked run exits without freeing every object (that would copy the pages it shares with the
    server), yet ends as ``python agent.py`` does: the same status, output and traceback, atexit
    functions run, threads joined, and the files it left open written out and closed."""
    from turnrl.harness.forkserver import ForkServer

    agent = tmp_path / "agent.py"
    agent.write_text(ENDINGS[ending])

    def seen(folder: Path, code: int) -> dict[str, Any]:
        files = {
            p.name: p.read_text() for p in sorted(folder.iterdir()) if p.name not in ("stdout", "stderr")
        }
        return {
            "code": code,
            "out": (folder / "stdout").read_text(),
            "err": (folder / "stderr").read_text(),
            **files,
        }

    def process(folder: Path) -> dict[str, Any]:
        with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
            code = subprocess.run([sys.executable, str(agent)], cwd=folder, stdout=out, stderr=err).returncode
        return seen(folder, code)

    async def forked(folder: Path) -> dict[str, Any]:
        out, err = folder / "stdout", folder / "stderr"
        out.touch()
        err.touch()
        server = ForkServer(["openai"])
        try:
            argv = [sys.executable, str(agent)]
            code = await server.wait(
                await server.spawn(argv, str(folder), dict(os.environ), str(out), str(err))
            )
        finally:
            await server.close()
        return seen(folder, code)

    (tmp_path / "process").mkdir()
    (tmp_path / "forked").mkdir()
    expected = process(tmp_path / "process")
    assert asyncio.run(forked(tmp_path / "forked")) == expected
    if ending == "left open":
        assert expected["code"] == 3 and expected["out"] == "no newline"
        assert expected["kept.bin"] == "bytes, never closed" and expected["thread.txt"] == "joined"
        assert len(expected) == 8
    else:
        assert expected["code"] == {"raises": 1, "says why": 1, "interrupted": -signal.SIGINT}[ending]


def test_the_warm_up_shares_one_ssl_context_among_a_runs_default_clients() -> None:
    """After ``turnrl.harness.warm:openai`` (in a process of its own: it patches the HTTP stack), the
    openai and anthropic SDKs' clients share one SSL context, made once; a client with a CA file
    variable of its own, or without verification, still gets a context of its own."""
    script = """
import os, time
from turnrl.harness import warm
warm.openai(); warm.anthropic()
import anthropic, openai
ctx = lambda c: c._client._transport._pool._ssl_context
a, b = (openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="k") for _ in range(2))
c = anthropic.Anthropic(base_url="http://127.0.0.1:9", api_key="k")
plain = openai.DefaultHttpxClient(verify=False)
unverified = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="k", http_client=plain)
os.environ["SSL_CERT_FILE"] = os.environ.get("SSL_CERT_FILE", "") + ".other"
try:
    other = ctx(openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="k"))
except OSError:  # the CA file does not exist: a context of its own was attempted
    other = None
print(ctx(a) is ctx(b) is ctx(c), ctx(unverified) is not ctx(a), other is not ctx(a))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "True"]


def test_a_preload_that_cannot_import_is_one_line(qwen3_tokenizer: Any, tmp_path: Path) -> None:
    from turnrl.harness.process import check_preload

    assert check_preload(["openai", "json"]) is None
    assert check_preload(["no_such_module_xyz"]) == (
        "env.preload: no module named 'no_such_module_xyz' (searched "
        f"{', '.join(search_path()) or Path.cwd()} and {sys.executable}'s environment)"
    )
    add_search_path(AGENTS)
    command = ["python", str(LOOKUP / "lookup_agent.py"), "{prompt}"]
    runner, _ = runner_for(qwen3_tokenizer, tmp_path, [], command=command, preload=["broken_module"])
    [traj] = run_once(runner)  # found, but raises when imported: the run did not start
    assert traj.stop_reason == StopReason.AGENT_ERROR
    assert traj.error and traj.error.endswith(
        "env.preload: 'broken_module' did not import: RuntimeError: broken on purpose"
    )


def call_agent(sample: dict[str, Any], folder: Path) -> None:
    """An agent given as a Python callable: one call, its reply written to the folder."""
    from openai import OpenAI

    reply = OpenAI().chat.completions.create(model="any", messages=sample["prompt"], max_tokens=8)
    (folder / "answer.txt").write_text(reply.choices[0].message.content or "")


@pytest.mark.parametrize("preload", [[], ["openai"]], ids=["process", "forked"])
def test_an_agent_given_as_a_python_callable_runs_in_a_process_of_its_own(
    qwen3_tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preload: list[str]
) -> None:
    monkeypatch.setenv("PYTHONPATH", f"{Path(__file__).parent}:{os.environ.get('PYTHONPATH', '')}")
    runner, _ = runner_for(
        qwen3_tokenizer,
        tmp_path,
        ["<answer>42</answer>"],
        command="test_harness:call_agent",
        preload=preload,
        sandbox="none",  # PYTHONPATH and the answer outside the folder: unsandboxed, as with preload
    )
    [traj] = run_once(runner)
    assert traj.stop_reason == StopReason.AGENT_DONE and traj.reward == 1.0
    assert traj.messages[0] == SAMPLE.prompt[0]


def bash(command: str) -> str:
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"<think>\nNext step.\n</think>\n\n<tool_call>\n{call}\n</tool_call>"


def test_the_mini_swe_agent_cli_unchanged_fixes_a_toy_repository_in_one_exact_branch(
    qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    env = yaml.safe_load((LOOKUP / "train_mini_swe.yaml").read_text())["env"]
    env["folder"] = str(ROOT / env["folder"])
    replies = [
        bash("printf 'def add(a, b):\\n    return a + b\\n' > calc.py"),
        bash("python test_calc.py && echo passed"),
        bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"),
    ]
    runner, engine = runner_for(qwen3_tokenizer, tmp_path, replies, setup=None, **env)
    [traj] = run_once(runner, Sample("calc/0", [{"role": "user", "content": "Make test_calc.py pass."}]))
    assert traj.stop_reason == StopReason.AGENT_DONE, f"{traj.error}"
    assert traj.reward == 1.0  # the test passes in the folder mini-swe-agent worked in
    assert traj.run.calls == 3 and traj.branch.reason == "first"
    assert_exact(traj, engine.seen)
    outputs = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert "passed" in outputs[1]
    assert (
        (ROOT / env["folder"] / "calc.py").read_text().endswith("raise NotImplementedError\n")
    )  # a copy was used


def test_a_command_that_does_not_exist_is_one_line() -> None:
    assert (
        check_command(["no-such-agent-xyz", "run"])
        == f"env.command: 'no-such-agent-xyz' is not a program on PATH nor beside {sys.executable}"
    )
    assert (
        check_command("agent")
        == "env.command 'agent': a Python callable is 'module:function' (or give an argv list)"
    )
    looked = ", ".join(dict.fromkeys([*search_path(), str(Path.cwd())]))
    assert check_command(["python", "no_such_agent.py", "{prompt}"]) == (
        f"env.command: no file 'no_such_agent.py' (looked in {looked})"
    )


def test_a_script_in_env_command_is_found_beside_the_config_or_from_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_dir, elsewhere = tmp_path / "task", tmp_path / "elsewhere"
    config_dir.mkdir()
    elsewhere.mkdir()
    (config_dir / "my_agent.py").write_text("print('hi')\n")
    monkeypatch.chdir(elsewhere)
    assert check_command(["python", "my_agent.py", "{prompt}"]) is not None  # not from here, not yet
    add_search_path(config_dir)  # what loading the config does: its folder, where env.reward is found
    assert check_command(["python", "my_agent.py", "{prompt}"]) is None
    assert argv_for(["python", "my_agent.py", "{prompt}"], "Hi.") == [
        sys.executable, str(config_dir / "my_agent.py"), "Hi.",
    ]  # fmt: skip
    (elsewhere / "my_agent.py").write_text("print('here')\n")
    assert argv_for(["python", "my_agent.py"], "")[1] == str(config_dir / "my_agent.py")  # as modules are
    (config_dir / "bin").mkdir()
    (config_dir / "bin" / "agent.sh").write_text("#!/bin/sh\necho hi\n")
    not_executable = "env.command: 'bin/agent.sh' is not an executable file"
    assert check_command(["bin/agent.sh", "{prompt}"]) == not_executable
    (config_dir / "bin" / "agent.sh").chmod(0o755)
    assert check_command(["bin/agent.sh", "{prompt}"]) is None  # a program by its path, beside the config
    assert argv_for(["bin/agent.sh", "{prompt}"], "Hi.") == [str(config_dir / "bin" / "agent.sh"), "Hi."]


def test_sandbox_paths_and_agent_variables_may_name_the_home_and_turnrls_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TURNRL_CACHE_DIR", str(tmp_path / "cache"))
    config = SandboxConfig(read_only=["{cache}/agents", "~/tools", "/opt/x"])
    assert config.read_only == [str(tmp_path / "cache" / "agents"), str(Path.home() / "tools"), "/opt/x"]


def branch(group: str, run: int, reward: float, run_reward: float, index: int = 0) -> Trajectory:
    traj = Trajectory(f"{group}/{run}/{index}", group, "d", StopReason.AGENT_DONE, reward=reward, num_turns=1)
    traj.sample_index = run
    traj.branch = SessionBranch(f"{group}-{run}", index)
    traj.run = AgentRun(0, 1.0, 1, reward=run_reward)
    return traj


def test_grpo_and_rloo_baselines_are_over_runs_not_branches() -> None:
    # group g: run 0 left 3 branches (reward 1 each), run 1 one branch (reward 0), run 2 one (0.5)
    trajs = [branch("g", 0, 1.0, 1.0, k) for k in range(3)] + [
        branch("g", 1, 0.0, 0.0),
        branch("g", 2, 0.5, 0.5),
    ]
    # runs 1, 0, 0.5: mean 0.5, sample std 0.5 (not 1,1,1,0,0.5 over branches: mean 0.7)
    got = compute_advantages("grpo", trajs, AdvantageOptions(eps=0.0))
    assert got == [[1.0], [1.0], [1.0], [-1.0], [0.0]]
    got = compute_advantages("rloo", trajs, AdvantageOptions())
    assert got == [[0.75], [0.75], [0.75], [-0.75], [0.0]]  # R - mean of the other runs


def test_the_numbers_a_user_reads_count_runs_with_their_branches_beside() -> None:
    from turnrl.rollout.metrics import summarize
    from turnrl.train.metrics import _console_line, rollout_metrics

    # run 0 left 3 branches (run reward 1), run 1 one (0.5), run 2 failed (its one branch, 0)
    trajs = [branch("g", 0, 1.0, 1.0, k) for k in range(3)] + [branch("g", 1, 0.5, 0.5)]
    failed = branch("g", 2, 0.0, 0.0)
    failed.stop_reason = StopReason.AGENT_ERROR
    trajs.append(failed)
    step = rollout_metrics(trajs)
    assert (step["runs"], step["branches"]) == (3, 5)
    assert step["reward/mean"] == 0.5  # (1 + 0.5 + 0) / 3 runs, not 0.7 over 5 branches
    assert step["reward/scored_mean"] == 0.75  # the runs that did not fail: the progress bar's
    assert summarize(trajs)["reward/mean"] == 0.5 and summarize(trajs)["runs"] == 3
    line = _console_line(1, 2, step)
    assert line.startswith("step 1/2 reward 0.500 ±0.41 (3 runs, 5 branches)"), line


def test_per_branch_rewards_score_against_the_runs_baseline() -> None:
    # run 0: branches 0.0 and 1.0 (run reward 0.5); run 1: one branch 1.5
    trajs = [branch("g", 0, 0.0, 0.5, 0), branch("g", 0, 1.0, 0.5, 1), branch("g", 1, 1.5, 1.5)]
    got = compute_advantages("grpo", trajs, AdvantageOptions(normalize_std=False))
    assert got == [[-1.0], [0.0], [0.5]]  # baseline: mean of runs 0.5 and 1.5 = 1.0


def test_reinforce_last_and_skip_system_mark_the_branches_not_to_train(
    qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    command = ["python", str(AGENTS / "compacting_agent.py"), "{prompt}"]
    runner, _ = runner_for(
        qwen3_tokenizer, tmp_path, ["One.", "Two.", "Done."], command=command, reinforce="last"
    )
    first, compacted = run_once(runner)
    assert first.exclude == "not_reinforced" and compacted.exclude is None
    kept, left_out = exclude_failures([first, compacted], keep=True)
    assert kept == [compacted] and left_out == {"not_reinforced": 1}
    runner, _ = runner_for(
        qwen3_tokenizer, tmp_path, ["One.", "Two.", "Done."], command=command, skip_system=["terse"]
    )
    assert all(t.exclude == "not_reinforced" for t in run_once(runner))


def turnrl(
    *args: str, cwd: Path = ROOT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    command = [sys.executable, "-m", "turnrl.cli", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def small(out: Path) -> list[str]:
    """The harness example, made small: tiny-qwen3, one step of 2 prompts, 4 demonstrations."""
    sets = [f"output_dir={out}", "model=tiny-qwen3", "train.steps=1", "train.prompts_per_step=2"]
    sets += ["eval.every=0", "warm_start.data.kwargs.size=4", "warm_start.epochs=1"]
    return [arg for value in sets for arg in ("--set", value)]


def test_turnrl_train_runs_an_unchanged_agent_and_trains_on_its_sessions(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = turnrl("train", "examples/harness/train_lookup.yaml", *small(out))
    assert done.returncode == 0, done.stderr[-3000:]
    from turnrl.rollout.collector import read_trajectories

    trajs = read_trajectories(out / "rollouts" / "step_000001.jsonl")
    assert len({(t.group_id, t.sample_index) for t in trajs}) == 2 * 4  # every run, exactly once
    assert all(t.stop_reason == StopReason.AGENT_DONE and t.branch.session for t in trajs)
    assert all(t.prompt_ids and any(t.loss_mask) for t in trajs)
    assert turnrl("validate", str(out)).returncode == 0
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    # the 4 demonstrations were replayed through the agent itself, each rewarded, then trained on
    assert first["warm_start/demos"] == 4 and first["warm_start/demo_turns"] == 2


def test_turnrl_train_warm_starts_mini_swe_agent_unchanged_then_trains_on_its_branches(
    tmp_path: Path,
) -> None:
    """The coding-harness example as a user runs it (the held-out set cut to one greedy run per
    evaluation): the solved episode is replayed through ``mini`` and learned, and the GRPO step
    trains on every branch of every run whose group's rewards differ, but for the replies mini
    dropped (a reply with no well-formed command, replaced by its format error)."""
    out = tmp_path / "run"
    sets = [f"output_dir={out}", "eval.group_size=1", "eval.data.kwargs.size=1"]
    done = turnrl("train", "examples/harness/train_mini_swe.yaml", *(a for v in sets for a in ("--set", v)))
    assert done.returncode == 0, done.stderr[-3000:]
    from turnrl.rollout.collector import read_trajectories

    first, step = (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()[:2])
    assert first["warm_start/demos"] == 4 and first["warm_start/demo_turns"] == 2
    assert first["warm_start/loss_last"] < first["warm_start/loss_first"] / 100
    assert first["eval/reward/mean"] == 1.0  # greedy, the warm-started model fixes the repository
    trajs = read_trajectories(out / "rollouts" / "step_000001.jsonl")
    assert len({(t.group_id, t.sample_index) for t in trajs}) == 2 * 4  # every run, exactly once
    assert all(t.stop_reason == StopReason.AGENT_DONE and t.reward in (0.0, 1.0) for t in trajs)
    assert turnrl("validate", str(out)).returncode == 0
    varied = [
        g for g in {t.group_id for t in trajs} if len({t.run.reward for t in trajs if t.group_id == g}) > 1
    ]
    trained = sum(1 for t in trajs if t.group_id in varied and not t.exclude)
    assert step["train/samples"] == trained, (step, varied)  # every branch of a varied group it trains
    # each sampled token once: what branches copy from their parents is context
    assert step["train/trunk_tokens"] == sum(t.branch.trunk_tokens for t in trajs)
    assert step["train/excluded/unchosen_tokens"] == sum(t.branch.unchosen_tokens for t in trajs)


def test_a_run_where_every_agent_failed_exits_non_zero(tmp_path: Path) -> None:
    out = tmp_path / "run"
    agent = str(AGENTS / "stubborn_agent.py")
    sets = [*small(out), "--set", f"env.command=[python, {agent}, crash]", "--set", "warm_start=null"]
    done = turnrl("train", "examples/harness/train_lookup.yaml", *sets)
    assert done.returncode == 1
    said = " ".join(done.stderr.split())
    assert "trajectories ended in an error" in said
    assert "most: agent_error x" in said and "first: the agent exited with code 3: giving up" in said


def test_turnrl_train_with_an_agent_that_does_not_exist_stops_at_once_with_one_line(tmp_path: Path) -> None:
    sets = [*small(tmp_path / "run"), "--set", "env.command=[no-such-agent-xyz, run]"]
    done = turnrl("train", "examples/harness/train_lookup.yaml", *sets)
    assert done.returncode == 2
    assert "env.command: 'no-such-agent-xyz' is not a program on PATH" in done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_overlapped_training_keeps_agents_running_while_the_trainer_steps(tmp_path: Path) -> None:
    out = tmp_path / "run"
    sets = [*small(out), "--set", "warm_start=null", "--set", "train.steps=3", "--set", "train.overlap=true"]
    sets += ["--set", "algorithm.max_staleness=1", "--set", "env.reward=varied_reward:reward"]
    path = f"{AGENTS}:{os.environ.get('PYTHONPATH', '')}"
    done = turnrl("train", "examples/harness/train_lookup.yaml", *sets, env={"PYTHONPATH": path})
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all("async/staleness_max" in r for r in records) and sum(r["train/samples"] for r in records) > 0
    from turnrl.rollout.collector import read_trajectories

    trajs = [t for step in (1, 2, 3) for t in read_trajectories(out / "rollouts" / f"step_{step:06d}.jsonl")]
    versions = {v for t in trajs for v in t.policy_versions if v >= 0}
    assert versions >= {0, 1}  # each token carries the weight version the gateway's engine sampled it with


@pytest.mark.parametrize("right", [True, False], ids=["demonstrated", "wrong tool"])
def test_the_calculator_recipe_scores_its_demonstrations_and_only_them(
    qwen3_tokenizer: Any, tmp_path: Path, right: bool
) -> None:
    """docs/gateway.md's from-scratch recipe, as shipped: the calculator agent's two tools reach
    the model through its prompt, a hermes reply comes back as a tool call the agent runs, and the
    reward reads the answer file it wrote: the demonstrated replies score 1.0, the other tool 0.0."""
    add_search_path(LOOKUP)
    import calc_task

    config = yaml.safe_load((LOOKUP / "train_calc.yaml").read_text())
    [row] = [r for r in calc_task.dataset(8, seed=3) if r["metadata"]["op"] == "multiply"][:1]
    sample = Sample(row["id"], [{"role": "user", "content": row["prompt"]}], metadata=row["metadata"])
    replies = calc_task.demonstration(sample)
    if not right:  # the sum where a product was asked: the tool's own answer, and still wrong
        meta = row["metadata"]
        replies = [replies[0].replace("multiply", "add"), f"<answer>{meta['a'] + meta['b']}</answer>"]
    harness = {**config["env"], "command": ["python", str(LOOKUP / "calc_agent.py"), "{prompt}"]}
    engine = Recorder(ScriptedEngine(qwen3_tokenizer, replies))
    env = HarnessConfig.model_validate(harness)
    gateway = harness_gateway(env, engine, ChatEncoder(qwen3_tokenizer), "m", tmp_path)  # type: ignore[arg-type]
    runner = HarnessRunner(env, gateway, tmp_path)
    [traj] = run_once(runner, sample)
    assert traj.stop_reason == StopReason.AGENT_DONE and traj.num_turns == 2
    assert traj.reward == (1.0 if right else 0.0)
    tool_result = traj.messages[-2]  # what the agent's tool returned, in the conversation trained on
    meta = row["metadata"]
    assert tool_result["role"] == "tool"
    assert tool_result["content"] == str(meta["a"] * meta["b"] if right else meta["a"] + meta["b"])
    assert_exact(traj, engine.seen)
