"""Task sets as data: Harbor task folders and SWE-style ones read into tasks, each run's folder
prepared and its tests run in the real bubblewrap sandbox at the task's own paths (``/app``,
``/tests``, ``/logs``), a Dockerfile that needs more than the sandbox refused in one line, and
``turnrl check-tasks`` on the shipped set and on tasks to drop."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from turnrl.config import SandboxConfig
from turnrl.harness.runtime import LocalRuntime, View
from turnrl.harness.sandbox import BubblewrapRuntime
from turnrl.support.cache import cache_dir
from turnrl.tasks import TaskError, Workspace, load_task, load_tasks, read_reward, rows

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "examples" / "tasks"
PASS = "echo 1 > /logs/verifier/reward.txt"
CODEX = cache_dir() / "agents" / "node_modules" / ".bin" / "codex"


def turnrl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnrl.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=600
    )


def write_task(
    root: Path,
    name: str,
    *,
    tests: str,
    solution: str | None = "true",
    dockerfile: str = "FROM python:3.11-slim\nWORKDIR /app\n",
    files: dict[str, str] | None = None,
    toml: str = "",
) -> Path:
    """A Harbor task folder under ``root``."""
    folder = root / name
    (folder / "environment").mkdir(parents=True)
    (folder / "tests").mkdir()
    (folder / "instruction.md").write_text(f"Do {name}.\n")
    (folder / "task.toml").write_text(toml)
    (folder / "environment" / "Dockerfile").write_text(textwrap.dedent(dockerfile))
    for rel, text in (files or {}).items():
        (folder / "environment" / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / "environment" / rel).write_text(text)
    (folder / "tests" / "test.sh").write_text(tests)
    if solution is not None:
        (folder / "solution").mkdir()
        (folder / "solution" / "solve.sh").write_text(solution)
    return folder


def sandbox(tmp_path: Path) -> BubblewrapRuntime:
    return BubblewrapRuntime(SandboxConfig(), hidden=[tmp_path])


def test_every_shipped_task_fails_untouched_and_passes_with_its_own_solution(tmp_path: Path) -> None:
    out = tmp_path / "checks.jsonl"
    done = turnrl("check-tasks", "examples/tasks", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) >= 12 and all(r["keep"] for r in records), [r for r in records if not r["keep"]]
    assert all(r["untouched"]["reward"] == 0.0 and r["solved"]["reward"] == 1.0 for r in records)
    said = " ".join(done.stderr.split())
    assert f"{len(records)} tasks: {len(records)} to keep, 0 to drop" in said
    train = {t.name for t in load_tasks(SHIPPED / "train")}
    held_out = {t.name for t in load_tasks(SHIPPED / "held_out")}
    assert len(train) >= 8 and len(held_out) >= 4 and not train & held_out
    assert load_task(SHIPPED / "train" / "calc-repo").tests is None  # the SWE-style one: its exit code


def test_the_family_set_is_its_generators_output_checked_and_split_by_instance(tmp_path: Path) -> None:
    """examples/task_families: what make.py writes (byte for byte), every task kept by check-tasks,
    the held-out tasks of the training tasks' families but with none of their names or words."""
    families = REPO / "examples" / "task_families"
    made = tmp_path / "made"
    subprocess.run([sys.executable, str(families / "make.py"), str(made)], check=True, timeout=60)
    splits = ("warm_start", "train", "held_out")
    for split in splits:
        ours = sorted(p.relative_to(made) for p in (made / split).rglob("*") if p.is_file())
        shipped = sorted(p.relative_to(families) for p in (families / split).rglob("*") if p.is_file())
        assert ours == shipped
        assert all((made / p).read_bytes() == (families / p).read_bytes() for p in ours)
    out = tmp_path / "checks.jsonl"
    done = turnrl("check-tasks", "examples/task_families", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert sum(json.loads(line)["keep"] for line in out.read_text().splitlines()) == 60

    def named(split: str) -> tuple[set[str], set[str]]:
        tasks = load_tasks(families / split)
        quoted = {w for t in tasks for part in t.instruction.split("`")[1::2] for w in part.split()}
        return {str(t.metadata["category"]) for t in tasks}, {w.removesuffix(".txt") for w in quoted}

    (warm, warm_words), (train, train_words), (held, held_words) = map(named, splits)
    assert warm == train == held and len(train) == 5
    assert not held_words & (train_words | warm_words)


def test_a_task_whose_tests_pass_untouched_or_fail_after_its_solution_is_one_to_drop(tmp_path: Path) -> None:
    root = tmp_path / "tasks"
    check = "if [ -f done.txt ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n"
    write_task(root, "good", tests=check, solution="touch done.txt\n")
    write_task(root, "trivial", tests=PASS + "\n", solution="true\n")
    write_task(root, "unsolvable", tests=check, solution="touch other.txt\n")
    write_task(root, "silent", tests="true\n", solution="touch done.txt\n")
    out = tmp_path / "checks.jsonl"
    done = turnrl("check-tasks", str(root), "--out", str(out))
    assert done.returncode == 1, done.stderr[-3000:]
    said = " ".join(done.stderr.split())
    assert "good: keep" in said
    assert "trivial: drop: its tests pass on the untouched folder" in said
    assert "unsolvable: drop: its tests fail after its solution (exit 0): reward 0" in said
    assert "silent: drop: its tests fail after its solution (exit 0): the tests wrote no reward file" in said
    assert "4 tasks: 1 to keep, 3 to drop" in said
    records = {r["task"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert records["good"]["keep"] and records["good"]["solved"]["passed"]
    assert not records["trivial"]["keep"] and records["trivial"]["untouched"]["passed"]


NEEDS = "needs a container runtime"
REFUSED = {
    "run": ("FROM debian\nWORKDIR /app\nRUN apt-get install -y jq\n", f"Dockerfile line 3: RUN {NEEDS}"),
    "stages": ("FROM golang AS build\nFROM debian\n", f"line 2: a second FROM (a multi-stage build) {NEEDS}"),
    "from": ("FROM debian\nCOPY --from=build /out /app\n", f"Dockerfile line 2: COPY --from=build {NEEDS}"),
    "outside": ("FROM debian\nCOPY a.txt /etc/a.txt\n", "COPY to /etc/a.txt, outside the working directory"),
    "url": (
        "FROM debian\nADD https://example.com/x.tgz /app/\n",
        f"ADD of a URL downloads at build time and {NEEDS}",
    ),
    "missing": ("FROM debian\nCOPY missing.txt /app/\n", "Dockerfile line 2: COPY missing.txt: no such file"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_dockerfile_that_needs_a_container_is_refused_in_one_line(tmp_path: Path, case: str) -> None:
    dockerfile, said = REFUSED[case]
    folder = write_task(tmp_path, "boxed", tests=PASS, dockerfile=dockerfile, files={"a.txt": "a"})
    with pytest.raises(TaskError, match="task boxed: ") as caught:
        load_task(folder)
    assert said in str(caught.value) and "\n" not in str(caught.value)


def test_check_tasks_refuses_such_a_task_before_running_any(tmp_path: Path) -> None:
    write_task(tmp_path, "fine", tests=PASS)
    write_task(tmp_path, "boxed", tests=PASS, dockerfile=REFUSED["run"][0])
    done = turnrl("check-tasks", str(tmp_path))
    assert done.returncode == 2 and done.stderr.strip() == (
        f"turnrl: error: task boxed: Dockerfile line 3: RUN {NEEDS} (the local sandbox runs FROM, WORKDIR,"
        " COPY, ENV and ARG only); turnrl check-tasks --podman checks it in containers"
    )


def test_services_or_a_prebuilt_image_need_a_container_too(tmp_path: Path) -> None:
    folder = write_task(tmp_path, "compose", tests=PASS, files={"docker-compose.yaml": "services: {}\n"})
    with pytest.raises(
        TaskError, match=r"environment/docker-compose.yaml \(services beside the task\) needs a"
    ):
        load_task(folder)
    image = write_task(tmp_path, "image", tests=PASS, toml='[environment]\ndocker_image = "org/env:1"\n')
    (image / "environment" / "Dockerfile").unlink()
    with pytest.raises(TaskError, match="the prebuilt image org/env:1 needs a container runtime"):
        load_task(image)


def test_the_dockerfile_places_its_files_and_variables_in_the_run(tmp_path: Path) -> None:
    dockerfile = """\
        # a comment
        FROM python:3.11-slim
        ARG VERSION=3
        ENV GREETING="hi there" \\
            MODE=v$VERSION
        WORKDIR /srv
        WORKDIR app
        COPY src/ lib/
        COPY a.txt b.txt ./data/
        COPY a.txt renamed.txt
        LABEL maintainer=someone
        """
    files = {"src/mod.py": "X = 1\n", "a.txt": "a\n", "b.txt": "b\n"}
    task = load_task(write_task(tmp_path, "placed", tests=PASS, dockerfile=dockerfile, files=files))
    assert task.workdir == "/srv/app" and task.base_image == "python:3.11-slim"
    assert task.env == {"VERSION": "3", "GREETING": "hi there", "MODE": "v3"}
    run = Workspace.in_runtime(task, tmp_path / "run", sandbox(tmp_path))
    folder = run.prepare()
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == [
        "data/a.txt",
        "data/b.txt",
        "lib/mod.py",
        "renamed.txt",
    ]
    done = run.run('echo "$GREETING $MODE"; pwd; cat lib/mod.py', timeout=30)
    assert done.ok and done.stdout.splitlines() == ["hi there v3", "/srv/app", "X = 1"], done


def test_a_run_sees_its_folder_at_the_workdir_and_never_the_tests_or_the_solution(tmp_path: Path) -> None:
    reward = "/logs/verifier/reward.txt"
    tests = f"touch /tests/x 2>/dev/null && echo 0 > {reward} || echo 1 > {reward}\n"  # read-only: 1
    task = load_task(write_task(tmp_path, "seen", tests=tests, solution="echo solved > /app/s.txt\n"))
    run = Workspace.in_runtime(task, tmp_path / "run", sandbox(tmp_path))
    folder = run.prepare()
    agent = run.run(
        "pwd; ls /tests /solution 2>&1 | head -2; touch /etc/x 2>&1 | tail -1; touch made.txt;"
        " echo note > /logs/agent/note.txt",
        timeout=30,
    )
    lines = agent.stdout.splitlines()
    assert lines[0] == "/app" and all("No such file or directory" in line for line in lines[1:3]), lines
    assert "Read-only file system" in lines[3]
    assert run.run("ls /logs", timeout=30).stdout.split() == ["agent"]  # not the verifier's folder
    assert (folder / "made.txt").is_file() and (run.logs / "agent" / "note.txt").read_text() == "note\n"
    assert run.solve().ok and (folder / "s.txt").read_text() == "solved\n"
    verdict = run.verify()  # the tests see /tests, read-only
    assert verdict.reward == 1.0 and verdict.why is None


def test_a_verifier_past_its_timeout_scores_zero_and_says_why(tmp_path: Path) -> None:
    task = load_task(
        write_task(tmp_path, "slow", tests="sleep 60\n" + PASS, toml="[verifier]\ntimeout_sec = 1\n")
    )
    run = Workspace.in_runtime(task, tmp_path / "run", sandbox(tmp_path))
    run.prepare()
    verdict = run.verify()
    assert verdict.reward == 0.0 and verdict.why == "the tests ran past 1 s" and verdict.seconds < 20


def test_a_swe_style_task_is_rewarded_by_its_test_commands_exit_code(tmp_path: Path) -> None:
    task = load_task(SHIPPED / "train" / "calc-repo")
    assert task.workdir == "/app" and task.test_command == "python3 test_calc.py"
    run = Workspace.in_runtime(task, tmp_path / "run", sandbox(tmp_path))
    folder = run.prepare()
    assert run.verify().reward == 0.0 and "NotImplementedError" in run.verify().output
    (folder / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    assert run.verify().reward == 1.0
    bad = tmp_path / "bad"
    (bad / "repo").mkdir(parents=True)
    (bad / "instruction.md").write_text("x")
    (bad / "task.toml").write_text('[swe]\nrepo = "repo"\n')
    with pytest.raises(TaskError, match=r"task bad: task.toml \[swe\] needs test_command"):
        load_task(bad)


def test_rewards_read_from_the_verifiers_files(tmp_path: Path) -> None:
    assert read_reward(tmp_path) == (
        0.0,
        "the tests wrote no reward file (/logs/verifier/reward.txt or reward.json)",
    )
    (tmp_path / "reward.json").write_text('{"reward": 0.5, "tests_passed": 3}')
    assert read_reward(tmp_path) == (0.5, None)
    (tmp_path / "reward.json").write_text('{"score": 0.25}')
    assert read_reward(tmp_path) == (0.25, None)
    (tmp_path / "reward.txt").write_text("passed\n")
    assert read_reward(tmp_path) == (0.0, "reward.txt holds 'passed', not a number")
    (tmp_path / "reward.txt").write_text(" 1 \n")
    assert read_reward(tmp_path) == (1.0, None)


def test_the_tasks_are_a_data_set_and_load_errors_name_the_task(tmp_path: Path) -> None:
    found = rows(str(SHIPPED / "held_out"))
    tasks = load_tasks(SHIPPED / "held_out")
    assert [r["id"] for r in found] == [t.name for t in tasks]
    assert found[0]["prompt"] == [{"role": "user", "content": tasks[0].instruction}]
    assert found[0]["metadata"]["task"] == str(tasks[0].path)
    assert len(rows(str(SHIPPED / "held_out"), repeat=2)) == 2 * len(tasks)
    with pytest.raises(TaskError, match="no task folders"):
        load_tasks(tmp_path)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "instruction.md").write_text("x")
    with pytest.raises(TaskError, match=r"task t: no tests/test.sh"):
        load_tasks(tmp_path)


def test_plain_processes_cannot_place_a_task(tmp_path: Path) -> None:
    with pytest.raises(
        RuntimeError, match="cannot see the run's folder at /app: a task needs the bubblewrap"
    ):
        LocalRuntime().launch(["true"], tmp_path, {}, view=View("/app"))


def agent_config(out: Path) -> dict[str, object]:
    """A harness on the shipped training tasks, its agent tests/harness_agents/task_agent.py."""
    return {
        "model": "tiny-qwen3",
        "env": {
            "kind": "harness",
            "command": ["python", str(REPO / "tests" / "harness_agents" / "task_agent.py"), "{prompt}"],
            "reward": "turnrl.tasks:reward",
            "keep_folders": True,
        },
        "data": {"generator": "turnrl.tasks:rows", "kwargs": {"path": str(SHIPPED / "train")}},
        "sampling": {"max_tokens": 4},
        "rollout": {"group_size": 1},
        "output_dir": str(out),
    }


def test_task_rows_need_the_sandbox(tmp_path: Path) -> None:
    config = agent_config(tmp_path / "out")
    config["env"]["sandbox"] = "none"  # type: ignore[index]
    (tmp_path / "tasks.yaml").write_text(json.dumps(config))
    done = turnrl("rollout", str(tmp_path / "tasks.yaml"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "is a task, which runs at its own path (/app) in a sandbox: drop env.sandbox: none" in done.stderr
    assert not (tmp_path / "out" / "trajectories.jsonl").exists()


def test_an_agent_on_task_rows_works_at_the_tasks_path_and_is_rewarded_by_its_tests(tmp_path: Path) -> None:
    """`turnrl rollout` with a harness on the shipped training tasks: each run's folder is its task's,
    shown at /app without the tests or the solution; the reward is the task's own tests, run after
    the agent in its sandbox. The test agent writes hello.txt whatever the model says, which solves
    create-file and nothing else."""
    out = tmp_path / "out"
    config = agent_config(out)
    (tmp_path / "tasks.yaml").write_text(json.dumps(config))
    done = turnrl("rollout", str(tmp_path / "tasks.yaml"))
    assert done.returncode == 0, done.stderr[-3000:]
    trajs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    rewards = {t["group_id"]: t["reward"] for t in trajs}
    assert rewards == {t.name: float(t.name == "create-file") for t in load_tasks(SHIPPED / "train")}
    for t in trajs:
        task = load_task(SHIPPED / "train" / t["group_id"])
        assert t["stop_reason"] == "agent_done" and [c["command"][-1] for c in t["run"]["commands"]] == [
            task.test_command
        ]
    [kept] = (out / "harness").glob("create-file-*")
    seen = json.loads((kept / "work" / "seen.json").read_text())
    assert seen == {"cwd": "/app", "files": ["README", "hello.txt"], "tests": False, "solution": False}
    assert (kept / "logs" / "verifier" / "output.txt").read_text().startswith("reward 1\n")


def test_an_agent_past_its_tasks_time_limit_is_stopped_there_and_told_so(tmp_path: Path) -> None:
    """A task's `[agent] timeout_sec` is the run's time limit (not env.timeout_s), and the stop
    reason's line names it."""
    root = tmp_path / "tasks"
    write_task(root, "quick", tests=PASS)
    slow = "FROM python:3.11-slim\nWORKDIR /app\nCOPY .slow /app/.slow\n"  # the agent sleeps where it is
    write_task(
        root, "slow", tests=PASS, dockerfile=slow, files={".slow": ""}, toml="[agent]\ntimeout_sec = 3\n"
    )
    out = tmp_path / "out"
    config = agent_config(out)
    config["data"] = {"generator": "turnrl.tasks:rows", "kwargs": {"path": str(root)}}
    config["env"]["command"] = [  # type: ignore[index]
        "bash",
        "-c",
        'TASK_AGENT_SLEEP=$([ -f /app/.slow ] && echo 60 || echo 0) exec python "$0" "$1"',
        str(REPO / "tests" / "harness_agents" / "task_agent.py"),
        "{prompt}",
    ]
    (tmp_path / "tasks.yaml").write_text(json.dumps(config))
    done = turnrl("rollout", str(tmp_path / "tasks.yaml"))
    assert done.returncode == 0, done.stderr[-3000:]
    trajs = {t["group_id"]: t for t in map(json.loads, (out / "trajectories.jsonl").read_text().splitlines())}
    assert trajs["quick"]["stop_reason"] == "agent_done" and trajs["quick"]["reward"] == 1.0
    late = trajs["slow"]
    assert late["stop_reason"] == "agent_timeout" and late["run"]["seconds"] < 30, late["run"]
    assert late["error"].startswith(
        "the agent ran past its row's time limit (a task's [agent] timeout_sec) 3 s and was killed"
    ), late["error"]


@pytest.mark.parametrize("agent", ["mini_swe", "codex"])
def test_the_family_recipes_agents_solve_the_held_out_tasks_with_their_demonstrations(
    agent: str, tmp_path: Path
) -> None:
    """The learning recipes' plumbing, with the real agents unchanged (mini-swe-agent's `mini` in its
    text mode; Codex from npm through codex.sh, hermes tool calls, turnrl's cache shown read-only):
    for a held-out task of each family, its solution as the recipe's warm start demonstrates it,
    replayed through the agent in the task's sandbox, passes the task's own tests, and the
    session's model tokens are the demonstration's."""
    import asyncio

    from turnrl.app.kinds import HarnessEnv
    from turnrl.app.parts import build_spec, load_samples
    from turnrl.models import load_tokenizer
    from turnrl.support.imports import import_object
    from turnrl.train.config import load_train_config
    from turnrl.train.sft import replay

    if agent == "codex":
        assert CODEX.exists(), f"no Codex CLI at {CODEX}: run bash scripts/install_agents.sh"
    recipe = REPO / "examples" / "task_families" / f"train_{agent}.yaml"
    config = load_train_config(recipe, [f"output_dir={tmp_path / 'out'}"], purpose="eval")
    assert config.eval is not None and config.warm_start is not None
    tokenizer = load_tokenizer(config.model)
    samples = load_samples(config.eval.data, None)[::2]  # one of each family
    assert len({sample.id.rsplit("-", 1)[0] for sample in samples}) == 5
    demos = import_object(config.warm_start.demos, "warm_start.demos")
    env = HarnessEnv(config.env)  # type: ignore[arg-type]
    spec = env.complete(build_spec(config, None, tokenizer, None), config.model, tmp_path / "out")  # type: ignore[arg-type]
    assert spec.runner is not None
    runner = spec.runner

    async def play() -> list[Any]:
        try:
            return await replay(samples, demos, spec)
        finally:
            await runner.close()

    played = asyncio.run(play())
    assert len(played) == len(samples)
    for sample, traj in zip(samples, played, strict=True):
        assert traj.reward == 1.0, (sample.id, traj.stop_reason, traj.error)
        model = tokenizer.decode([t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m])
        assert all(turn in model for turn in demos(sample))
        assert len(model) < sum(len(turn) + 20 for turn in demos(sample))  # nothing else is trained
