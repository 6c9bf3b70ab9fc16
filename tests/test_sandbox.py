"""The code sandbox against the escapes a model will try: each is contained, the host is untouched,
and the model is told, as a tool error, what stopped its code. Real bubblewrap, real processes."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import pytest

from turnrl.chat.encoder import ChatEncoder
from turnrl.engines.scripted import ScriptedEngine
from turnrl.env.tool_env import ToolEnv
from turnrl.rollout.loop import RolloutSpec, run_trajectory
from turnrl.tools import load_tools_config
from turnrl.tools.sandbox import CodeInterpreter, Sandbox, SandboxLimits, SandboxResult
from turnrl.types import Limits, Sample, SamplingParams, StopReason

if os.environ.get("CI") != "true":
    pytest.importorskip("shutil").which("bwrap") or pytest.skip("no bwrap (scripts/install_sandbox.sh)")

LIMITS = SandboxLimits(cpu_s=2, wall_s=4, memory_mb=256, file_size_mb=4, max_processes=8, output_chars=2000)


def run(code: str) -> SandboxResult:
    return asyncio.run(Sandbox(LIMITS).run(code))


def leftovers() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("turnrl-sandbox-*")}


def test_code_runs_in_its_own_folder_and_the_folder_is_removed() -> None:
    before = leftovers()
    result = run("import os\nopen('note.txt', 'w').write('x')\nprint(os.getcwd(), sorted(os.listdir('.')))")
    assert result.ok and result.stdout == "/sandbox ['main.py', 'note.txt']\n"
    assert leftovers() == before


def test_reading_outside_its_folder_finds_nothing_of_the_host(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("host data")
    result = run(f"print(open({str(secret)!r}).read())")
    assert not result.ok and "FileNotFoundError" in result.stderr and "host data" not in result.stdout
    assert "FileNotFoundError" in run("open('/etc/passwd').read()").stderr  # only what Python needs
    listing = run("import os; print(sorted(os.listdir('/')))").stdout
    assert "home" not in listing and "root" not in listing and "work" not in listing


def test_writing_outside_its_folder_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "victim.txt"
    target.write_text("original")
    for path in ("/usr/lib/evil.py", "/etc/evil"):
        result = run(f"open({path!r}, 'w').write('pwned')")
        assert not result.ok and ("Read-only file system" in result.stderr or "No such file" in result.stderr)
    # its /tmp is its own (empty, in memory): a host path under /tmp is not the host's file
    inside = run(f"import os\nos.makedirs({str(tmp_path)!r})\nopen({str(target)!r}, 'w').write('pwned')")
    assert inside.ok
    assert target.read_text() == "original" and not Path("/usr/lib/evil.py").exists()


def test_no_network_not_even_the_hosts_loopback() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    result = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('in')")
    assert not result.ok and "in" not in result.stdout
    assert "ConnectionRefusedError" in result.stderr or "Network is unreachable" in result.stderr
    with pytest.raises(TimeoutError):  # nothing reached the host's listener
        server.accept()
    server.close()
    assert not run("import socket; socket.getaddrinfo('pypi.org', 443)").ok


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        ("import os\nwhile True:\n    os.fork()", "process limit (8)"),
        ("x = []\nwhile True:\n    x.append(bytearray(10**7))", "memory limit (256 MiB)"),
        ("while True:\n    pass", "CPU time limit (2 s)"),
        ("import time\ntime.sleep(60)", "wall time limit (4 s)"),
        ("while True:\n    print('x' * 100)", "output limit (2000 characters)"),
        ("open('big', 'wb').write(b'0' * (64 << 20))", "file size limit (4 MiB)"),
    ],
)
def test_each_bomb_is_stopped_by_its_limit(code: str, reason: str) -> None:
    before = leftovers()
    result = run(code)
    assert result.reason == reason and result.exit_code is None and not result.ok
    assert result.seconds < LIMITS.wall_s + 3
    if reason.startswith("output"):
        assert result.truncated and len(result.stdout) == LIMITS.output_chars
    assert leftovers() == before
    assert run("print('after')").stdout == "after\n"  # the next run is unaffected


def test_killing_its_parent_or_everything_harms_nothing_outside() -> None:
    result = run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('parent', os.getppid())")
    assert result.stdout.startswith("parent")  # its parent is the sandbox's own init: signals do nothing
    everything = run("import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('alive')")
    assert "ProcessLookupError" in everything.stderr or everything.stdout == "alive\n"
    assert os.getpid() > 0 and run("print(1)").ok  # this process and the next run are fine


def call(code: str) -> str:
    body = json.dumps({"name": "code_interpreter", "arguments": {"code": code}})
    return f"<tool_call>\n{body}\n</tool_call>"


async def test_the_code_interpreter_tool_in_a_rollout(qwen3_tokenizer: Any) -> None:
    (tool,) = load_tools_config(
        {"tools": [{"class_name": "turnrl.tools.sandbox.CodeInterpreter", "config": {"cpu_s": 2}}]}
    )
    assert isinstance(tool, CodeInterpreter) and tool.name == "code_interpreter"
    replies = [call("print(sum(range(101)))"), call("while True: pass"), call("import os; os.fork"), "5050"]
    spec = RolloutSpec(
        env_factory=lambda s: ToolEnv(s, [tool], tool_timeout_s=30),
        engine=ScriptedEngine(qwen3_tokenizer, replies),
        encoder=ChatEncoder(qwen3_tokenizer, {"enable_thinking": False}),
        sampling=SamplingParams(max_tokens=64),
        limits=Limits(max_turns=5),
    )
    traj = await run_trajectory(Sample("s", [{"role": "user", "content": "Sum 0..100 with code."}]), spec)
    assert traj.stop_reason is StopReason.NO_TOOL_CALL
    answers = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert answers[0] == "5050"
    assert answers[1] == "Error: stopped: CPU time limit (2 s)"
    assert answers[2] == "(no output)"
    assert traj.info["num_tool_errors"] == 1 and traj.info["num_tool_calls"] == 3
    assert traj.metrics["check/ok"] is True
