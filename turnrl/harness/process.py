"""One agent process: started as its runtime launches it (in a sandbox, or under a keeper), in a
session of its own in its folder, waited for within its timeout, stopped with everything it started
when it outruns it (and after it exits: nothing is left behind), its output kept in files beside the
folder and read back as tails. ``run_command`` runs a reward's command the same way."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from turnrl.harness.forkserver import ForkServer, forkable
from turnrl.harness.keeper import signal_process
from turnrl.harness.runtime import Launch
from turnrl.support.imports import search_path

TAIL = 4000  # characters of stdout and stderr kept in a result
STOP_GRACE_S = 3.0  # a keeper told to stop has this long to kill what the run started


@dataclass(frozen=True)
class CommandResult:
    """How a command run in a run's folder ended (``HarnessResult.run``)."""

    exit_code: int | None  # None: killed at its timeout
    stdout: str  # the last TAIL characters
    stderr: str
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        """It exited by itself with code 0."""
        return self.exit_code == 0


@dataclass(frozen=True)
class Exit:
    """How an agent process ended."""

    code: int | None  # its exit code (None: it did not start, or was killed at the timeout)
    timed_out: bool
    stdout: str  # the last TAIL characters
    stderr: str
    error: str | None = None  # why it did not start
    seconds: float = 0.0
    limit_s: float | None = None  # the time limit it ran under


SCRIPTS = (".py", ".sh", ".js", ".mjs", ".cjs", ".ts", ".rb", ".pl")  # an argument with these names a file


def argv_for(command: list[str] | str, prompt: str) -> list[str]:
    """The argv of ``command``: a list with ``{prompt}`` filled in, ``python`` as this interpreter
    and arguments naming an existing file (``find_file``) made absolute, since the agent runs in its
    own folder; or a "module:function" run by ``python -m turnrl.harness.function_agent``."""
    if isinstance(command, str):
        return [sys.executable, "-m", "turnrl.harness.function_agent", command]
    argv = [program_path(command[0])]
    for part in command[1:]:
        found = find_file(part)
        argv.append(str(found) if found is not None else part.replace("{prompt}", prompt))
    return argv


def find_file(part: str) -> Path | None:
    """The file an argument of ``env.command`` names, looked for as ``env.reward``'s module is: an
    absolute path, else one beside the config, else one from the working directory; None if none."""
    if not part or "{" in part or part.startswith("-"):
        return None
    path = Path(part)
    for folder in [] if path.is_absolute() else [*map(Path, search_path()), Path.cwd()]:
        if (folder / path).is_file():
            return (folder / path).resolve()
    return path.resolve() if path.is_absolute() and path.is_file() else None


def check_command(command: list[str] | str) -> str | None:
    """Why ``command`` cannot start (one line), or None: an argv's program must exist."""
    if isinstance(command, str):
        module, colon, function = command.partition(":")
        if not colon or not module or not function:
            return f"env.command {command!r}: a Python callable is 'module:function' (or give an argv list)"
        return _find_module(module, "env.command")
    if not command:
        return "env.command is empty"
    program = command[0]
    if os.sep in program:
        executable = os.access(program_path(program), os.X_OK)
        return None if executable else f"env.command: {program!r} is not an executable file"
    if not (os.sep in program_path(program) or shutil.which(program)):
        return f"env.command: {program!r} is not a program on PATH nor beside {sys.executable}"
    for part in command[1:]:  # a script it runs: python agent.py
        if part.endswith(SCRIPTS) and not part.startswith("-") and find_file(part) is None:
            where = ", ".join(dict.fromkeys([*search_path(), str(Path.cwd())]))
            return f"env.command: no file {part!r} (looked in {where})"
    return None


def check_preload(modules: list[str]) -> str | None:
    """Why a module of ``env.preload`` cannot be imported (one line), or None: it must be found."""
    for entry in modules:
        problem = _find_module(entry.partition(":")[0], "env.preload")  # "module:function": a warm-up
        if problem:
            return problem
    return None


def _find_module(name: str, what: str) -> str | None:
    """Why module ``name`` cannot be found (one line), or None; nothing is imported but its parents."""
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        return f"{what}: {name!r} cannot be imported: {exc}"
    if found is None:
        where = ", ".join(search_path()) or str(Path.cwd())
        return f"{what}: no module named {name!r} (searched {where} and {sys.executable}'s environment)"
    return None


def program_path(program: str) -> str:
    """``python`` as this interpreter; a program of this environment (a console script beside the
    interpreter, such as an agent's CLI installed with turnrl) by its path when PATH lacks it; a
    relative path (``agents/run.sh``) found as the arguments are, made absolute."""
    if program == "python":
        return sys.executable
    if os.sep in program and (found := find_file(program)) is not None:
        return str(found)
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
    signal_process(pid, signal.SIGKILL, group=True)


async def run_agent(
    launch: Launch,
    logs: Path,
    timeout: float,
    forks: ForkServer | None = None,
) -> Exit:
    """Run ``launch`` (stdout and stderr to ``logs``.stdout/.stderr) for at most ``timeout``
    seconds, forked by ``forks`` when it is a Python script or module it can run (sandboxed by
    ``forks``'s sandbox and ``launch.forked`` when ``launch`` is); when
    it ends either way, everything it started is killed and its launch closed."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    out, err = logs.with_suffix(".stdout"), logs.with_suffix(".stderr")
    waited: Callable[[int], Awaitable[int]]
    # a forked run's pid is of its server's PID namespace: the server signals it
    signal_run: Callable[[int, int, bool], None] = signal_process
    # forked only into the same kind of place: a sandbox the fork server can enter, or none
    same = forks is not None and launch.sandboxed == (forks.sandbox is not None)
    python = forkable(launch.command) if same and (launch.forked or not launch.sandboxed) else None
    try:
        if forks is not None and python is not None:
            out.write_bytes(b"")
            err.write_bytes(b"")
            inside = launch.forked if launch.sandboxed else None
            pid = await forks.spawn(python, str(launch.cwd), launch.env, str(out), str(err), inside)
            waited, signal_run = forks.wait, forks.kill
        else:
            pid, waited = await _start(launch, out, err)
    except OSError as exc:
        launch.close()
        return Exit(None, False, "", "", f"cannot start {launch.argv[0]!r}: {exc.strerror or exc}")
    timed_out, code, error = False, None, None
    try:
        async with asyncio.timeout(timeout):
            code = await waited(pid)
    except TimeoutError:
        timed_out = True
    except OSError as exc:  # the fork server went away
        error = str(exc)
    finally:
        if code is None and error is None:
            await _stop(pid, waited, signal_run)
        signal_run(pid, signal.SIGKILL, True)  # the agent's group too, also when it exited on its own
        launch.close()
    return Exit(code, timed_out, tail(out), tail(err), error, seconds=loop.time() - t0, limit_s=timeout)


async def _stop(
    pid: int, waited: Callable[[int], Awaitable[int]], signal_run: Callable[[int, int, bool], None]
) -> None:
    """End a run still going: its keeper is told (SIGTERM: it kills everything the run started,
    wherever it went), then, past a grace period, the whole group is killed."""
    signal_run(pid, signal.SIGTERM, False)
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(STOP_GRACE_S):
            await waited(pid)
            return
    signal_run(pid, signal.SIGKILL, True)
    with contextlib.suppress(OSError):
        await waited(pid)


def run_command(launch: Launch, timeout: float) -> CommandResult:
    """Run ``launch`` to its end or ``timeout`` (blocking: a reward runs in a thread of its own);
    everything it started is killed either way."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        launch.argv,
        cwd=launch.cwd,
        env=launch.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    timed_out, closed = False, False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc.pid)
        launch.close()  # before reading to the end: what holds the output open (a container) goes too
        closed = True
        out, err = proc.communicate()
    finally:
        kill_group(proc.pid)
        if not closed:
            launch.close()
    code = None if timed_out else proc.returncode
    text = [data.decode("utf-8", "replace")[-TAIL:] for data in (out, err)]
    return CommandResult(code, text[0], text[1], timed_out, time.monotonic() - t0)


async def _start(launch: Launch, out: Path, err: Path) -> tuple[int, Callable[[int], Awaitable[int]]]:
    """A new process for ``launch``: its pid and how to wait for its exit code."""
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            *launch.argv,
            cwd=launch.cwd,
            env=launch.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,  # its own process group: killed whole
        )

    async def wait(_: int) -> int:
        return await proc.wait()

    return proc.pid, wait
