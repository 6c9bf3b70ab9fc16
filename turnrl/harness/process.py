"""One agent process: started in a session of its own in its folder, waited for within its timeout,
killed with its whole process group when it outruns it (and after it exits: nothing is left behind),
its output kept in files beside the folder and read back as tails."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from turnrl.harness.forkserver import ForkServer, forkable

TAIL = 4000  # characters of stdout and stderr kept in a result


@dataclass(frozen=True)
class Exit:
    """How an agent process ended."""

    code: int | None  # its exit code (None: it did not start, or was killed at the timeout)
    timed_out: bool
    stdout: str  # the last TAIL characters
    stderr: str
    error: str | None = None  # why it did not start
    seconds: float = 0.0


def argv_for(command: list[str] | str, prompt: str) -> list[str]:
    """The argv of ``command``: a list with ``{prompt}`` filled in, ``python`` as this interpreter
    and arguments naming an existing file (from here) made absolute, since the agent runs in its own
    folder; or a "module:function" run by ``python -m turnrl.harness.call``."""
    if isinstance(command, str):
        return [sys.executable, "-m", "turnrl.harness.call", command]
    argv = [program_path(command[0])]
    for part in command[1:]:
        argv.append(str(Path(part).resolve()) if Path(part).is_file() else part.replace("{prompt}", prompt))
    return argv


def check_command(command: list[str] | str) -> str | None:
    """Why ``command`` cannot start (one line), or None: an argv's program must exist."""
    if isinstance(command, str):
        if ":" not in command:
            return f"env.command {command!r}: a Python callable is 'module:function' (or give an argv list)"
        return None
    if not command:
        return "env.command is empty"
    program = command[0]
    if os.sep in program:
        return None if os.access(program, os.X_OK) else f"env.command: {program!r} is not an executable file"
    if os.sep in program_path(program) or shutil.which(program):
        return None
    return f"env.command: {program!r} is not a program on PATH nor beside {sys.executable}"


def check_preload(modules: list[str]) -> str | None:
    """Why a module of ``env.preload`` cannot be imported (one line), or None: it must be found."""
    for entry in modules:
        name = entry.partition(":")[0]  # "module:function": a warm-up in that module
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError) as exc:
            return f"env.preload: {name!r} cannot be imported: {exc}"
        if found is None:
            return f"env.preload: no module named {name!r} in {sys.executable}'s environment"
    return None


def program_path(program: str) -> str:
    """``python`` as this interpreter; a program of this environment (a console script beside the
    interpreter, such as an agent's CLI installed with turnrl) by its path when PATH lacks it."""
    if program == "python":
        return sys.executable
    beside = Path(sys.executable).parent / program
    if os.sep not in program and not shutil.which(program) and os.access(beside, os.X_OK):
        return str(beside)
    return program


def tail(path: Path) -> str:
    """The last TAIL characters of a file (empty when it is missing)."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4 * TAIL))
            return f.read().decode("utf-8", "replace")[-TAIL:]
    except OSError:
        return ""


def kill_group(pid: int) -> None:
    """SIGKILL every process of the group ``pid`` leads (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def run_agent(
    argv: list[str],
    folder: Path,
    logs: Path,
    env: dict[str, str],
    timeout: float,
    forks: ForkServer | None = None,
) -> Exit:
    """Run ``argv`` in ``folder`` (stdout and stderr to ``logs``.stdout/.stderr) for at most
    ``timeout`` seconds, forked by ``forks`` when it is a Python script or module it can run; its
    process group is killed when it ends either way."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    out, err = logs.with_suffix(".stdout"), logs.with_suffix(".stderr")
    waited: Callable[[int], Awaitable[int]]
    try:
        if forks is not None and (python := forkable(argv)) is not None:
            out.write_bytes(b"")
            err.write_bytes(b"")
            pid = await forks.spawn(python, str(folder), env, str(out), str(err))
            waited = forks.wait
        else:
            pid, waited = await _start(argv, folder, env, out, err)
    except OSError as exc:
        return Exit(None, False, "", "", f"cannot start {argv[0]!r}: {exc.strerror or exc}")
    timed_out, code, error = False, None, None
    try:
        async with asyncio.timeout(timeout):
            code = await waited(pid)
    except TimeoutError:
        timed_out = True
    except OSError as exc:  # the fork server went away
        error = str(exc)
    finally:
        kill_group(pid)  # the agent's children too, also when it exited on its own
        if code is None and error is None:
            with contextlib.suppress(OSError):
                await waited(pid)
    return Exit(code, timed_out, tail(out), tail(err), error, seconds=loop.time() - t0)


async def _start(
    argv: list[str], folder: Path, env: dict[str, str], out: Path, err: Path
) -> tuple[int, Callable[[int], Awaitable[int]]]:
    """A new process for ``argv``: its pid and how to wait for its exit code."""
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=folder,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,  # its own process group: killed whole
        )

    async def wait(_: int) -> int:
        return await proc.wait()

    return proc.pid, wait
