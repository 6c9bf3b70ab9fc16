"""What starting one harness run costs in CPU: a new ``python`` process against a run forked from
turnrl's fork server (``env.preload``), for an agent that imports the openai SDK and makes a client.

Each way runs ``--runs`` agents one after another and takes the CPU time of the processes it
started (user + system, from ``RUSAGE_CHILDREN``); the fork server's own start is measured alone
(no run) and taken off. No model is involved: the agent makes no call.

    .venv/bin/python bench/harness_start.py [--runs 20]
    .venv/bin/python bench/harness_start.py --sandbox   # wall per run, bubblewrap sandbox on and off,
                                                        # new processes and forked runs
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from turnrl.harness.forkserver import ForkServer

AGENT = """
import sys
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:9/v1", api_key="key", max_retries=0)
messages = [{"role": "user", "content": sys.argv[1]}]
_ = client.chat.completions
print("done")
"""
PRELOAD = ["openai", "turnrl.harness.warm:openai"]


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def forked(agent: Path, folder: Path, runs: int) -> float:
    """CPU seconds of the fork server and its ``runs`` runs (the server's are reported when it ends)."""
    server = ForkServer(PRELOAD)
    before = children_cpu()
    out, err = folder / "stdout", folder / "stderr"
    out.touch()
    err.touch()
    for _ in range(runs):
        pid = await server.spawn(
            [sys.executable, str(agent), "hi"], str(folder), dict(os.environ), str(out), str(err)
        )
        assert await server.wait(pid) == 0, err.read_text()
    if runs == 0:  # start it anyway: its own start is what is taken off
        await server._start()
    await server.close()
    return children_cpu() - before


def processes(agent: Path, runs: int) -> float:
    before = children_cpu()
    for _ in range(runs):
        subprocess.run([sys.executable, str(agent), "hi"], check=True, capture_output=True)
    return children_cpu() - before


def launched(agent: Path, folder: Path, runs: int, sandboxed: bool) -> float:
    """Wall seconds per run of ``agent`` as the harness launches it: under its keeper, in a bubblewrap
    sandbox (``env.sandbox``'s defaults, bridged to a gateway socket) or not (``sandbox: none``)."""
    from turnrl.config import SandboxConfig
    from turnrl.harness.process import run_command
    from turnrl.harness.runtime import LocalRuntime, Runtime
    from turnrl.harness.sandbox import BubblewrapRuntime

    work = folder / "work"
    work.mkdir(exist_ok=True)
    runtime: Runtime = LocalRuntime()
    if sandboxed:
        runtime = BubblewrapRuntime(SandboxConfig(), [folder], gateway=(8123, folder / "gateway.sock"))
        (folder / "gateway.sock").touch()
    t0 = time.perf_counter()
    for _ in range(runs):
        result = run_command(runtime.launch([sys.executable, str(agent), "hi"], work, {}), 60)
        assert result.ok, result.stderr
    return (time.perf_counter() - t0) / runs


def forked_launched(agent: Path, folder: Path, runs: int, sandboxed: bool) -> float:
    """Wall seconds per run of ``agent`` forked by the harness's fork server (``env.preload``), as
    ``run_agent`` starts it: each run in a sandbox of its own entered after the fork (the server in
    a sandbox too), or not (``sandbox: none``); the server's start is not counted."""
    from turnrl.config import SandboxConfig
    from turnrl.harness.process import run_agent
    from turnrl.harness.runtime import LocalRuntime, Runtime
    from turnrl.harness.sandbox import BubblewrapRuntime

    root = folder / "runs"
    root.mkdir(exist_ok=True)
    runtime: Runtime = LocalRuntime()
    server = ForkServer(PRELOAD)
    if sandboxed:
        box = BubblewrapRuntime(SandboxConfig(), [folder], hidden=[root], gateway=(8123, folder / "gw.sock"))
        (folder / "gw.sock").touch()
        variables = box.variables({})
        runtime, server = box, ForkServer(PRELOAD, env=variables, sandbox=lambda: box.server(root))

    async def go() -> float:
        await server._start()
        t0 = time.perf_counter()
        for i in range(runs):
            run = root / str(i)
            (run / "work").mkdir(parents=True)
            launch = runtime.launch([sys.executable, str(agent), "hi"], run / "work", {})
            exit = await run_agent(launch, run / "agent", 60, server)
            assert exit.code == 0, exit.stderr
        wall = (time.perf_counter() - t0) / runs
        await server.close()
        return wall

    try:
        return asyncio.run(go())
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sandbox", action="store_true", help="wall per run with the sandbox on and off")
    args = parser.parse_args()
    if args.sandbox:
        sandbox_rows(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        agent = folder / "agent.py"
        agent.write_text(AGENT)
        rows: dict[str, list[float]] = {"new process": [], "forked": []}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            rows["new process"].append(processes(agent, args.runs) / args.runs)
            start = asyncio.run(forked(agent, folder, 0))
            rows["forked"].append((asyncio.run(forked(agent, folder, args.runs)) - start) / args.runs)
            print(f"  round in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(f"CPU per run (user + system), median of {args.repeats} rounds of {args.runs} runs:")
    for name, values in rows.items():
        values.sort()
        every = ", ".join(f"{v * 1000:.0f}" for v in values)
        print(f"  {name:<12} {values[len(values) // 2] * 1000:7.1f} ms   (all: {every})")


def sandbox_rows(args: argparse.Namespace) -> None:
    """Wall time per run, sandbox on and off, side by side, for an empty agent and the SDK agent."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        agents = {"empty": folder / "empty.py", "openai SDK": folder / "agent.py"}
        agents["empty"].write_text("print('done')\n")
        agents["openai SDK"].write_text(AGENT)
        print(f"wall per run (ms), median of {args.repeats} rounds of {args.runs} runs, one at a time:")
        for name, agent in agents.items():
            rows: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.repeats):
                for sandboxed in (False, True):
                    rows[sandboxed].append(launched(agent, folder, args.runs, sandboxed))
            off, on = (sorted(rows[k])[len(rows[k]) // 2] * 1000 for k in (False, True))
            print(f"  {name:<11} sandbox off {off:7.1f}   on {on:7.1f}   cost {on - off:+6.1f} ms")
            for _ in range(args.repeats):
                for sandboxed in (False, True):
                    rows[sandboxed].append(forked_launched(agent, folder, args.runs, sandboxed))
            off, on = (sorted(rows[k][args.repeats :])[args.repeats // 2] * 1000 for k in (False, True))
            print(f"  {name:<11} forked: sandbox off {off:7.1f}   on {on:7.1f}   cost {on - off:+6.1f} ms")


if __name__ == "__main__":
    main()
