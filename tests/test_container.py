"""The podman runtime (``env.sandbox.runtime: podman``), with real podman over an image built here
from Debian packages (``scripts/install_podman.sh``): a task whose Dockerfile installs a tool with
``RUN`` is refused by the local sandbox and runs in a container of its image, checked by ``turnrl
check-tasks --podman`` and rolled out with a real agent that calls its gateway from inside the
container, sees none of the host and reaches nothing else on loopback; no container is left."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from turnrl.config import SandboxConfig
from turnrl.harness.container import ROOTLESS, PodmanRuntime, podman_missing
from turnrl.harness.process import run_command
from turnrl.harness.runtime import Bind, View
from turnrl.tasks import TaskError, load_task

REPO = Path(__file__).resolve().parents[1]
IMAGE = "localhost/turnrl-debian:bookworm"
# this machine withholds CAP_SYS_RESOURCE and a cgroup mount in containers: runc through the shim
PODMAN = ["podman", "--runtime", str(REPO / "scripts" / "podman_runc.sh")]
DOCKERFILE = f"""\
FROM {IMAGE}
RUN printf '#!/bin/sh\\necho "$1" | tr a-z A-Z\\n' > /usr/local/bin/shout && chmod +x /usr/local/bin/shout
WORKDIR /app
COPY words.txt ./
RUN mkdir -p out && echo made > out/.keep
"""
TESTS = """\
#!/bin/bash
[ "$(cat /app/out/loud.txt)" = "$(printf 'APPLE\\nPEAR')" ] && echo 1 > /logs/verifier/reward.txt \
  || echo 0 > /logs/verifier/reward.txt
"""
SOLVE = 'cd /app && for w in $(cat words.txt); do shout "$w"; done > out/loud.txt\n'


def shout_task(root: Path) -> Path:
    """A Harbor task that needs its image: `shout` exists only there, made by a RUN step."""
    folder = root / "shout"
    for sub in ("environment", "tests", "solution"):
        (folder / sub).mkdir(parents=True)
    (folder / "instruction.md").write_text(
        "Write `shout WORD` for each word of words.txt into out/loud.txt.\n"
    )
    (folder / "task.toml").write_text("[agent]\ntimeout_sec = 120\n[verifier]\ntimeout_sec = 60\n")
    (folder / "environment" / "Dockerfile").write_text(DOCKERFILE)
    (folder / "environment" / "words.txt").write_text("apple\npear\n")
    (folder / "tests" / "test.sh").write_text(TESTS)
    (folder / "solution" / "solve.sh").write_text(SOLVE)
    return folder


def containers() -> set[str]:
    done = subprocess.run(
        [*PODMAN, "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True, check=True
    )
    return {name for name in done.stdout.split() if name.startswith("turnrl-")}


@pytest.fixture(scope="module")
def image_version() -> str:
    """The image's Debian version (this machine's may differ), once the image is there."""
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "install_podman.sh")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    read = [*PODMAN, "run", "--rm", "--network", "none", IMAGE, "cat", "/etc/debian_version"]
    return subprocess.run(read, capture_output=True, text=True, check=True).stdout.strip()


def turnrl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnrl.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=900
    )


def test_a_task_that_installs_a_tool_is_checked_in_a_container_of_its_image(
    tmp_path: Path, image_version: str
) -> None:
    task = shout_task(tmp_path / "tasks")
    with pytest.raises(TaskError, match="Dockerfile line 2: RUN needs a container runtime"):
        load_task(task)
    refused = turnrl("check-tasks", str(task))
    assert refused.returncode == 2 and "--podman checks it in containers" in refused.stderr
    before = containers()
    done = turnrl("check-tasks", str(task), "--podman", " ".join(PODMAN), "--keep", str(tmp_path / "kept"))
    assert done.returncode == 0, done.stdout + done.stderr
    said = done.stdout + done.stderr
    assert "shout: keep; untouched: fail" in said and "solved: pass" in said
    solved = tmp_path / "kept" / "shout" / "solved" / "work"
    # the folder began as the image's /app (the COPY and what RUN made there), the solution's file added
    assert sorted(p.name for p in solved.rglob("*")) == [".keep", "loud.txt", "out", "words.txt"]
    assert (solved / "out" / "loud.txt").read_text() == "APPLE\nPEAR\n"
    assert containers() == before


def test_a_view_sees_its_folder_and_binds_only_and_the_image_system(
    tmp_path: Path, image_version: str
) -> None:
    """What a command in the container sees: the image's system, the folder at the working
    directory, its binds read-only where asked, none of the host's files."""
    runtime = PodmanRuntime(SandboxConfig(runtime="podman", podman=PODMAN, image=IMAGE), hidden=[tmp_path])
    folder, tests = tmp_path / "work", tmp_path / "tests"
    folder.mkdir()
    tests.mkdir()
    (tests / "t.sh").write_text("x")
    (tmp_path / "secret").write_text("s")
    script = textwrap.dedent(f"""\
        cat /etc/debian_version; pwd; ls /tests; echo hi > here.txt
        touch /tests/no 2>/dev/null && echo wrote-tests; test -e {tmp_path}/secret && echo host-visible
        touch /usr/x 2>/dev/null; echo done""")
    view = View("/srv/task", binds=(Bind(tests, "/tests"),), env=(("MODE", "v3"),))
    result = run_command(runtime.launch(["bash", "-c", script + "; echo $MODE"], folder, {}, view=view), 120)
    lines = result.stdout.split()
    assert result.exit_code == 0, result.stderr
    assert lines == [image_version, "/srv/task", "t.sh", "done", "v3"]
    assert (folder / "here.txt").read_text() == "hi\n"


def test_an_agent_runs_in_its_tasks_container_reaching_its_gateway_only(
    tmp_path: Path, image_version: str
) -> None:
    """`turnrl rollout` with env.sandbox.runtime podman on a task that needs its image: the agent (a
    Python script of turnrl's environment, run by the image's Python) calls the gateway through the
    run's bridge, uses the tool the image's RUN step made, cannot see a host file nor reach another
    loopback port, and the task's tests score its folder 1."""
    task = shout_task(tmp_path / "tasks")
    (tmp_path / "host").mkdir()  # named by a variable: an argument naming a file shows its folder
    (tmp_path / "host" / "secret.txt").write_text("not for agents")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    out = tmp_path / "out"
    agent = REPO / "tests" / "harness_agents" / "container_agent.py"
    config = {
        "model": "tiny-qwen3",
        "env": {
            "kind": "harness",
            "command": [
                "python",
                str(agent),
                "{prompt}",
                str(listener.getsockname()[1]),
            ],
            "env": {"HOST_FILE": str(tmp_path / "host" / "secret.txt")},
            "reward": "turnrl.tasks:reward",
            "keep_folders": True,
            "sandbox": {"runtime": "podman", "podman": PODMAN},
        },
        "data": {"generator": "turnrl.tasks:rows", "kwargs": {"path": str(task.parent)}},
        "sampling": {"max_tokens": 4},
        "rollout": {"group_size": 2},
        "output_dir": str(out),
    }
    (tmp_path / "cfg").mkdir()  # a config's folder is shown to runs (the modules it names): its own
    (tmp_path / "cfg" / "run.yaml").write_text(json.dumps(config))
    before = containers()
    local = dict(config, env={**config["env"], "sandbox": {}}, output_dir=str(tmp_path / "local"))  # type: ignore[dict-item]
    (tmp_path / "cfg" / "local.yaml").write_text(json.dumps(local))
    refused = turnrl("rollout", str(tmp_path / "cfg" / "local.yaml"))
    assert refused.returncode == 2 and "RUN needs a container runtime" in refused.stderr, refused.stderr[
        -2000:
    ]
    assert "set env.sandbox.runtime: podman" in refused.stderr
    done = turnrl("rollout", str(tmp_path / "cfg" / "run.yaml"))
    listener.close()
    assert done.returncode == 0, done.stderr[-3000:]
    trajs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert [(t["stop_reason"], t["reward"]) for t in trajs] == [("agent_done", 1.0)] * 2, trajs[0].get(
        "error"
    )
    assert all(t["num_turns"] == 1 and sum(t["loss_mask"]) > 0 for t in trajs)
    for kept in (out / "harness").glob("shout-*"):
        seen = json.loads((kept / "work" / "seen.json").read_text())
        assert seen["cwd"] == "/app" and seen["files"] == ["out", "words.txt"]
        assert not seen["tests"] and not seen["solution"] and not seen["host_file"]
        assert seen["other_port"] == "ConnectionRefusedError"
        assert seen["system"] == image_version
        assert (kept / "logs" / "verifier" / "output.txt").read_text().startswith("reward 1\n")
    assert containers() == before


def test_a_command_past_its_timeout_leaves_no_container(tmp_path: Path, image_version: str) -> None:
    runtime = PodmanRuntime(SandboxConfig(runtime="podman", podman=PODMAN, image=IMAGE), hidden=[tmp_path])
    before = containers()
    result = run_command(runtime.launch(["sleep", "60"], tmp_path, {}, view=View("/app")), 3)
    assert result.timed_out and result.seconds < 30
    assert containers() == before


def test_rootless_podman_checks_tasks_but_runs_no_agent_behind_the_gateways_bridge(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rootless podman cannot start inside the bridge's network namespace (a user namespace in a
    user namespace; tried on this machine as a second user): a run with agents is refused in one
    line that says what to do, while check-tasks (no agent, no bridge) and the machine's network run."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    config = SandboxConfig(runtime="podman", podman=PODMAN, image=IMAGE)
    assert podman_missing(config) == ROOTLESS and "\n" not in ROOTLESS
    assert podman_missing(config, agents=False) is None
    assert podman_missing(SandboxConfig(runtime="podman", network="host")) is None
    runtime = PodmanRuntime(config, gateway=(1, Path("/nonexistent.sock")))
    with pytest.raises(RuntimeError, match="rootless podman cannot start inside the network namespace"):
        runtime.launch(["true"], Path("/tmp"), {}, view=View("/app"))
