"""A task folder as data, in one of two forms.

**Harbor** (terminal-bench 2 and most agentic RL sets)::

    task/instruction.md          the prompt
    task/task.toml               [agent] timeout_sec, [verifier] timeout_sec and env,
                                 [environment] cpus, memory_mb, storage_mb
    task/environment/Dockerfile  FROM, WORKDIR, COPY, ENV (``turnrl.tasks.dockerfile``)
    task/tests/test.sh           the verifier: writes /logs/verifier/reward.txt (or reward.json)
    task/solution/solve.sh       the reference solution (``turnrl check-tasks`` runs it)

**SWE-style**: ``instruction.md``, a repository folder and a test command, in ``task.toml``::

    [swe]
    repo = "repo"                      # copied as the working directory
    test_command = "python -m pytest -q"   # the reward: 1 when it exits 0
    workdir = "/app"                   # where the repository appears (default /app)

and optionally ``solution/solve.sh``. Both read into a ``Task``; ``load_tasks`` reads a folder of
them (any depth), ``rows`` makes them a data set (``data: {generator: "turnrl.tasks:rows"}``).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnrl.tasks.dockerfile import DEFAULT_WORKDIR, NEEDS_CONTAINER, Copy, Dockerfile, TaskError

TESTS, SOLUTION, LOGS = "/tests", "/solution", "/logs"
REWARD_FILES = ("reward.txt", "reward.json")  # what a Harbor verifier writes in /logs/verifier
COMPOSE = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")


@dataclass(frozen=True)
class Task:
    """One task: its prompt, where its files go, how its tests run and how long each part may take."""

    name: str
    path: Path
    instruction: str
    workdir: str = DEFAULT_WORKDIR  # where the run's folder appears inside its sandbox
    copies: tuple[Copy, ...] = ()  # what the run's folder starts with
    env: dict[str, str] = field(default_factory=dict)  # the Dockerfile's ENV and ARG
    test_command: str = f"bash {TESTS}/test.sh"
    tests: Path | None = None  # shown read-only at /tests to the test command (Harbor)
    solution: Path | None = None  # solution/solve.sh
    agent_timeout_s: float = 600.0
    verifier_timeout_s: float = 600.0
    verifier_env: dict[str, str] = field(default_factory=dict)
    cpus: float | None = None
    memory_mb: int | None = None
    base_image: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    dockerfile: Path | None = None  # environment/Dockerfile: what a container runtime builds
    image: str | None = None  # task.toml's prebuilt [environment] docker_image (no Dockerfile)
    needs_container: str | None = None  # why only a container runtime runs it (one line), or None

    @property
    def reward_file(self) -> bool:
        """Whether the tests report by a reward file (Harbor), not by their exit code (SWE-style)."""
        return self.tests is not None


def load_task(path: str | Path, container: bool = False) -> Task:
    """The task in folder ``path``; ``TaskError`` (one line, naming the task) when it is not a
    task of either form, or needs more than the local sandbox and ``container`` is False (True: a
    container runtime will build it; ``Task.needs_container`` says why it needs one)."""
    folder = Path(path)
    name = folder.name
    instruction = _read(folder / "instruction.md", name)
    config = _toml(folder / "task.toml", name)
    agent, verifier = config.get("agent", {}), config.get("verifier", {})
    environment = config.get("environment", {})
    common: dict[str, Any] = {
        "name": name,
        "path": folder.resolve(),
        "instruction": instruction.strip(),
        "solution": (folder / "solution" / "solve.sh").resolve()
        if (folder / "solution" / "solve.sh").is_file()
        else None,
        "agent_timeout_s": float(agent.get("timeout_sec", 600.0)),
        "verifier_timeout_s": float(verifier.get("timeout_sec", 600.0)),
        "verifier_env": {str(k): str(v) for k, v in verifier.get("env", {}).items()},
        "cpus": environment.get("cpus"),
        "memory_mb": environment.get("memory_mb"),
        "metadata": dict(config.get("metadata", {})),
    }
    if "swe" in config:
        return _swe(folder, config["swe"], common)
    task = _harbor(folder, environment, common)
    if task.needs_container and not container:
        raise TaskError(task.needs_container)
    return task


def _harbor(folder: Path, environment: dict[str, Any], common: dict[str, Any]) -> Task:
    name = common["name"]
    if not (folder / "tests" / "test.sh").is_file():
        raise TaskError(f"task {name}: no tests/test.sh (a Harbor task's verifier) and no [swe] test_command")
    env_dir = folder / "environment"
    compose = [f for f in COMPOSE if (env_dir / f).is_file()]
    if compose:  # a container runtime here runs one container a run, not services beside it
        raise TaskError(
            f"task {name}: environment/{compose[0]} (services beside the task) {NEEDS_CONTAINER}"
            " that runs compose files (turnrl's runtimes run one container a run)"
        )
    dockerfile = env_dir / "Dockerfile"
    image = environment.get("docker_image")
    if dockerfile.is_file():
        built = Dockerfile.read(dockerfile, name)
    elif image:
        built = Dockerfile(needs=f"task {name}: the prebuilt image {image} {NEEDS_CONTAINER}")
    else:
        built = Dockerfile()
    return Task(
        **common,
        workdir=built.workdir,
        copies=built.copies,
        env=built.env,
        tests=(folder / "tests").resolve(),
        base_image=built.base or image,
        dockerfile=dockerfile.resolve() if dockerfile.is_file() else None,
        image=None if dockerfile.is_file() else image,
        needs_container=built.needs,
    )


def _swe(folder: Path, swe: dict[str, Any], common: dict[str, Any]) -> Task:
    name = common["name"]
    command = swe.get("test_command")
    if not isinstance(command, str) or not command.strip():
        raise TaskError(
            f"task {name}: task.toml [swe] needs test_command, the command whose exit code is the reward"
        )
    repo = folder / str(swe.get("repo", "repo"))
    if not repo.is_dir():
        raise TaskError(f"task {name}: [swe] repo {swe.get('repo', 'repo')!r} is not a folder of the task")
    workdir = str(swe.get("workdir", DEFAULT_WORKDIR))
    if not workdir.startswith("/"):
        raise TaskError(f"task {name}: [swe] workdir must be an absolute path, not {workdir!r}")
    return Task(**common, workdir=workdir, copies=(Copy(repo.resolve(), "."),), test_command=command)


def load_tasks(path: str | Path, container: bool = False) -> list[Task]:
    """Every task under ``path`` (a task folder, or a folder of them at any depth), sorted by name;
    ``TaskError`` for the first that cannot run here (``container``: as ``load_task``)."""
    root = Path(path)
    if not root.is_dir():
        raise TaskError(f"{path}: no such folder of tasks")
    if (root / "instruction.md").is_file():
        return [load_task(root, container)]
    folders = sorted({p.parent for p in root.rglob("instruction.md")})
    if not folders:
        raise TaskError(f"{path}: no task folders (each has an instruction.md)")
    tasks = [load_task(folder, container) for folder in folders]
    seen: dict[str, Path] = {}
    for task in tasks:
        if task.name in seen:
            raise TaskError(f"{path}: two tasks named {task.name} ({seen[task.name]} and {task.path})")
        seen[task.name] = task.path
    return tasks


def rows(path: str, repeat: int = 1) -> list[dict[str, Any]]:
    """The tasks under ``path`` as data rows (``data: {generator: "turnrl.tasks:rows", kwargs:
    {path: ...}}``): the instruction as the prompt, the task's folder in ``metadata.task``. A task
    that needs a container runtime is a row too: the run's checks refuse it on the local sandbox."""
    tasks = load_tasks(path, container=True)
    return [
        {
            "id": task.name if repeat == 1 else f"{task.name}/{i}",
            "prompt": [{"role": "user", "content": task.instruction}],
            "metadata": {"task": str(task.path)},
        }
        for i in range(repeat)
        for task in tasks
    ]


def _read(path: Path, name: str) -> str:
    if not path.is_file():
        raise TaskError(f"task {name}: no {path.name}")
    return path.read_text(encoding="utf-8")


def _toml(path: Path, name: str) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise TaskError(f"task {name}: task.toml: {exc}") from None
