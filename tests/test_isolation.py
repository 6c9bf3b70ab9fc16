"""Harness runs cannot touch each other or the machine: real agent processes in real bubblewrap
sandboxes, one escape each (tests/harness_agents/escape_agent.py), each beside an honest run in the
same batch. Each test asserts the escape failed, the run ended as docs/gateway.md says, the honest
run was scored as usual, and nothing of the escapee is left on the machine."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
from gateway_fixtures import Recorder

from turnrl.app.kinds import harness_gateway
from turnrl.chat.encoder import ChatEncoder
from turnrl.config import HarnessConfig
from turnrl.engines.scripted import ScriptedEngine
from turnrl.harness import HarnessRunner
from turnrl.support import imports
from turnrl.support.imports import add_search_path
from turnrl.types import Sample, StopReason, Trajectory

AGENTS = Path(__file__).parent / "harness_agents"
add_search_path(AGENTS)
import escape_task  # noqa: E402  (beside the agent: the run's env.reward)


def batch(
    tokenizer: Any, tmp_path: Path, mode: str, agents: Path = AGENTS, **harness: Any
) -> tuple[HarnessRunner, Trajectory, list[Trajectory], str]:
    """The escapee and an honest run at once (the agent from ``agents``); the runner, the honest
    run, the escapee's trajectories, and the marker its leftover processes would carry."""
    add_search_path(AGENTS)
    marker = f"turnrl-escape-{uuid.uuid4().hex}"
    config = HarnessConfig.model_validate(
        {
            "kind": "harness",
            "command": ["python", str(agents / "escape_agent.py"), "{prompt}", marker],
            "reward": "escape_task:reward",
            "setup": "escape_task:setup",
            "env": {"HONEST_WAIT": "2"},
            **harness,
        }
    )
    engine = Recorder(ScriptedEngine(tokenizer, ["Hi."] * 8))
    gateway = harness_gateway(config, engine, ChatEncoder(tokenizer), "m", tmp_path / "out")  # type: ignore[arg-type]
    runner = HarnessRunner(config, gateway, tmp_path / "out")
    escape_task.OPEN[:] = [runner]
    escape_task.FOUND.clear()
    spec: Any = type("Spec", (), {"sampling": None, "engine": None})()

    async def go() -> tuple[list[Trajectory], list[Trajectory]]:
        try:
            honest = runner(Sample("honest", [{"role": "user", "content": "honest"}]), 0, spec)
            escapee = runner(Sample("escapee", [{"role": "user", "content": mode}]), 0, spec)
            return tuple(await asyncio.gather(honest, escapee))  # type: ignore[return-value]
        finally:
            await runner.close()

    honest, escapee = asyncio.run(go())
    [good] = honest
    assert good.stop_reason == StopReason.AGENT_DONE and good.reward == 1.0, good.error  # unharmed
    assert good.run.calls == 1  # and nobody else wrote into its session
    return runner, good, escapee, marker


# Sandboxed runs start two ways: a new process in a bubblewrap sandbox, or forked by a fork server
# in a sandbox of its own (env.preload), entering the run's namespaces after the fork.
STARTS = pytest.mark.parametrize("preload", [[], ["openai"]], ids=["process", "forked"])


def leftovers(marker: str) -> list[int]:
    """Processes of this machine whose command line carries ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(pid))
    return found


@STARTS
def test_a_sandboxed_run_cannot_write_outside_its_folder(
    qwen3_tokenizer: Any, tmp_path: Path, preload: list[str]
) -> None:
    outside = tmp_path / "outside.txt"
    home = Path.home() / "escaped"
    _, _, [traj], _ = batch(
        qwen3_tokenizer,
        tmp_path,
        "write",
        env={"ESCAPE_PATHS": f"{outside}:{tmp_path}/out/x"},
        keep_folders=True,
        preload=preload,
    )
    assert traj.stop_reason == StopReason.AGENT_DONE, traj.error
    assert escape_task.FOUND["escapee"]["wrote"]  # it tried: what it wrote went to its private /tmp
    assert not outside.exists() and not (tmp_path / "out" / "x").exists()  # the host's /tmp, turnrl's output
    assert not home.exists()  # the user's home
    assert not list((tmp_path / "out" / "harness").glob("*/escaped"))  # the run's own ../


@STARTS
def test_a_sandboxed_run_sees_no_other_process_and_no_session_key(
    qwen3_tokenizer: Any, tmp_path: Path, preload: list[str]
) -> None:
    _, _, [traj], _ = batch(qwen3_tokenizer, tmp_path, "environ", preload=preload)
    found = escape_task.FOUND["escapee"]
    assert traj.stop_reason == StopReason.AGENT_DONE, traj.error
    assert found["others"] == []  # not the honest run's agent, not turnrl
    assert int(found["processes"]) <= 4  # its PID namespace: the keeper's init, the keeper, the agent


@pytest.mark.parametrize("sandbox", ["bubblewrap", "bubblewrap-forked", "none"])
def test_a_run_that_knows_another_sessions_name_cannot_call_it(
    qwen3_tokenizer: Any, tmp_path: Path, sandbox: str
) -> None:
    runner, good, [traj], _ = batch(qwen3_tokenizer, tmp_path, "call", **_sandbox(sandbox))
    assert escape_task.FOUND["escapee"]["status"] == 401  # its own key opens its own session only
    assert runner.gateway.counts["unauthorized"] == 1
    assert "turnrl_gateway_unauthorized_total 1" in runner.gateway.metrics()
    assert traj.run.calls == 1 and good.run.calls == 1


@pytest.mark.parametrize(
    ("sandbox", "preload"),
    [("bubblewrap", []), ("bubblewrap", ["openai"]), ("none", []), ("none", ["openai"])],
    ids=["sandboxed", "sandboxed-forked", "process", "forked"],
)
@pytest.mark.parametrize("mode", ["setsid", "double_fork"])
def test_nothing_the_agent_started_outlives_its_run(
    qwen3_tokenizer: Any, tmp_path: Path, mode: str, sandbox: str, preload: list[str]
) -> None:
    _, _, [traj], marker = batch(qwen3_tokenizer, tmp_path, mode, preload=preload, **_sandbox(sandbox))
    assert traj.stop_reason == StopReason.AGENT_DONE, traj.error
    assert leftovers(marker) == []


@pytest.mark.alone  # 256 processes forking without end: no other test's timing beside it
@STARTS
def test_a_fork_bomb_ends_at_its_timeout_and_leaves_nothing(
    qwen3_tokenizer: Any, tmp_path: Path, preload: list[str]
) -> None:
    _, _, [traj], marker = batch(qwen3_tokenizer, tmp_path, "fork_bomb", timeout_s=15, preload=preload)
    assert traj.stop_reason in (StopReason.AGENT_TIMEOUT, StopReason.AGENT_ERROR)
    assert leftovers(marker) == []


@STARTS
def test_a_memory_hog_is_stopped_by_the_default_limit(
    qwen3_tokenizer: Any, tmp_path: Path, preload: list[str]
) -> None:
    _, _, [traj], _ = batch(qwen3_tokenizer, tmp_path, "memory", preload=preload)
    assert traj.stop_reason == StopReason.AGENT_DONE, traj.error  # it caught its MemoryError
    assert 0 < escape_task.FOUND["escapee"]["held_mb"] <= 4096  # env.sandbox.memory_mb's default


@STARTS
def test_a_sandboxed_run_reaches_no_loopback_port_but_its_gateway(
    qwen3_tokenizer: Any, tmp_path: Path, preload: list[str]
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        port = listener.getsockname()[1]
        _, _, [traj], _ = batch(
            qwen3_tokenizer, tmp_path, "port", env={"ESCAPE_PORT": str(port)}, preload=preload
        )
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    assert traj.stop_reason == StopReason.AGENT_DONE, traj.error  # and its gateway answered its call
    assert escape_task.FOUND["escapee"] == {
        "mode": "port",
        "connected": False,
        "error": "ConnectionRefusedError",
    }


def test_the_reward_runs_the_tasks_tests_in_the_runs_sandbox(
    qwen3_tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def reward(sample: Sample, result: Any) -> float:
        if sample.id == "honest":
            return 1.0
        tests = result.run(
            f"cat escape.json; echo; touch ran.txt {tmp_path}/out.txt; ls /proc | grep -c '^[0-9]'"
        )
        seen.update(code=tests.exit_code, out=tests.stdout, folder=sorted(os.listdir(result.folder)))
        return float(tests.ok)

    monkeypatch.setattr(escape_task, "reward", reward)
    _, _, [traj], _ = batch(qwen3_tokenizer, tmp_path, "honest")
    assert seen["code"] == 0 and '"mode": "honest"' in seen["out"]
    assert "ran.txt" in seen["folder"] and not (tmp_path / "out.txt").exists()  # its folder, not the host's
    assert int(seen["out"].splitlines()[-1]) <= 5  # in a PID namespace of its own
    assert traj.reward == 1.0 and traj.run.commands[0]["exit_code"] == 0


@STARTS
def test_an_agent_kept_under_tmp_is_seen_over_the_runs_private_tmp(
    qwen3_tokenizer: Any, tmp_path: Path, preload: list[str]
) -> None:
    agents = tmp_path / "agents"  # /tmp/pytest-of-.../agents: read-only, and shown over the run's /tmp
    agents.mkdir()
    shutil.copy(AGENTS / "escape_agent.py", agents)
    escape = {"ESCAPE_PATHS": f"{agents}/escaped"}
    _, _, [traj], _ = batch(qwen3_tokenizer, tmp_path, "write", agents, preload=preload, env=escape)
    assert traj.stop_reason == StopReason.AGENT_DONE, traj.error  # it ran, from its folder under /tmp
    assert f"{agents}/escaped" not in escape_task.FOUND["escapee"]["wrote"]  # read-only there
    assert sorted(os.listdir(agents)) == ["escape_agent.py"]


def test_a_config_kept_in_tmp_shows_no_other_runs_folder_and_keeps_the_runs_home(
    qwen3_tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config in /tmp makes /tmp a folder the runs are shown (its modules'), which would cover
    each run's private /tmp (its home) with the host's, other runs' folders in it: /tmp is never
    shown whole."""
    sibling = Path(tempfile.mkdtemp(prefix="turnrl-", dir="/tmp"))  # another run's folder
    (sibling / "session.jsonl").write_text("another run's tokens")
    monkeypatch.setattr(imports, "_SEARCHED", [*imports.search_path(), "/tmp"])  # the config's folder
    try:
        paths = {"ESCAPE_PATHS": f"{sibling}/session.jsonl"}
        _, _, [traj], _ = batch(qwen3_tokenizer, tmp_path, "read", env=paths)
    finally:
        shutil.rmtree(sibling)
    assert traj.stop_reason == StopReason.AGENT_DONE, traj.error
    found = escape_task.FOUND["escapee"]
    assert found["seen"] == [] and found["home"] is True, found


@STARTS
@pytest.mark.parametrize("keep_folders", [False, True], ids=["tmp", "kept"])
def test_a_sandboxed_run_cannot_unmount_its_way_to_the_other_runs(
    qwen3_tokenizer: Any, tmp_path: Path, preload: list[str], keep_folders: bool
) -> None:
    _, _, [traj], _ = batch(qwen3_tokenizer, tmp_path, "unmount", preload=preload, keep_folders=keep_folders)
    found = escape_task.FOUND["escapee"]
    assert traj.stop_reason == StopReason.AGENT_DONE, traj.error
    assert found["unmounted"] == []  # no capability left, and a user namespace's mounts are locked
    assert [name.split("-")[0] for name in found["runs"]] == ["escapee"]  # its own run's folder only


def _sandbox(name: str) -> dict[str, Any]:
    return {"sandbox": "none"} if name == "none" else {"preload": ["openai"]} if "forked" in name else {}


def test_a_fork_server_that_cannot_make_runs_sandboxes_says_so_in_one_line(tmp_path: Path) -> None:
    """A sandboxed fork server on a machine (here: a sandbox without capabilities) where a run could
    not make its namespaces stops at its start with one line, before importing anything."""
    from turnrl.harness.forkserver import ForkServer

    def sandbox() -> list[str]:  # every capability dropped: no unshare is allowed in it
        bwrap = ["bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--cap-drop", "ALL"]
        return [*bwrap, "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--"]

    server = ForkServer(["json"], sandbox=sandbox)
    out = tmp_path / "out"
    out.touch()

    async def go() -> None:
        try:
            await server.spawn(["python", "-c", "pass"], str(tmp_path), {}, str(out), str(out), {})
        finally:
            await server.close()

    with pytest.raises(OSError, match=r"^env.preload with env.sandbox: this machine does not let a"):
        asyncio.run(go())
