"""What a task run costs besides the agent: for each task of a set (default: the shipped
``examples/tasks``), the folder made from the task's files, an empty command in the run's bubblewrap
sandbox (its start), the task's tests, and its solution (a stand-in for an agent that knows the
answer), each the median of ``--repeat`` fresh runs; then the runs per minute of the whole set
done that way (prepare, solution, tests), one run after another. ``--podman CMD``: the same in
podman containers of each task's image (built before the clock starts; on a machine without a
registry, tag a local image as the tasks' ``FROM``: ``podman tag localhost/turnrl-debian:bookworm
python:3.11-slim``).

    .venv/bin/python bench/tasks.py [--tasks examples/tasks] [--repeat 5] [--podman podman]
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from turnrl.harness.container import PodmanRuntime
from turnrl.tasks import Workspace, load_tasks
from turnrl.tasks.check import task_runtime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="examples/tasks")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--podman", help="the podman command (with its options): in containers")
    parser.add_argument("--image", help="with --podman: the image of tasks that name none (SWE-style)")
    args = parser.parse_args()
    podman = shlex.split(args.podman) if args.podman else None
    tasks = load_tasks(args.tasks, container=podman is not None)
    root = Path(tempfile.mkdtemp(prefix="turnrl-bench-tasks-"))
    rows: dict[str, list[list[float]]] = {}
    try:
        for task in tasks:
            box = task_runtime(task, root, podman, args.image)
            if isinstance(box, PodmanRuntime):  # the build is once a task, not a run's cost
                box.image(Workspace(task, root).view())
            for i in range(args.repeat):
                space = Workspace.in_runtime(task, root / f"{task.name}-{i}", box)
                t0 = time.perf_counter()
                space.prepare()
                prepared = time.perf_counter() - t0
                empty = space.run("true", 30).seconds
                solved = space.solve().seconds
                tests = space.verify()
                assert tests.passed, (task.name, tests)
                rows.setdefault(task.name, []).append([prepared, empty, solved, tests.seconds])
        t0 = time.perf_counter()
        for task in tasks:
            box = task_runtime(task, root, podman, args.image)
            space = Workspace.in_runtime(task, root / f"{task.name}-set", box)
            space.prepare()
            space.solve()
            assert space.verify().passed
        per_minute = len(tasks) / (time.perf_counter() - t0) * 60
    finally:
        shutil.rmtree(root, ignore_errors=True)
    where = "container" if podman else "sandboxed"
    print(f"| task | folder (ms) | empty {where} command (ms) | solution (ms) | tests (ms) |")
    print("|---|---:|---:|---:|---:|")
    medians = []
    for name, runs in rows.items():
        median = [statistics.median(column) * 1000 for column in zip(*runs, strict=True)]
        medians.append(median)
        print(f"| {name} | " + " | ".join(f"{m:.1f}" for m in median) + " |")
    overall = [statistics.median(column) for column in zip(*medians, strict=True)]
    print("| median of the tasks | " + " | ".join(f"{m:.1f}" for m in overall) + " |")
    done = f"{len(tasks)} tasks, one after another (folder, solution, tests)"
    print(f"\n{done}: {per_minute:.0f} runs per minute")


if __name__ == "__main__":
    main()
