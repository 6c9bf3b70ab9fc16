"""A sandboxed Python runner and the code-interpreter tool built on it.

Each run is a fresh process in bubblewrap (``bwrap``): new user, PID, network, IPC and UTS
namespaces (no network at all: not even the host's loopback), the system's directories read-only,
nothing else of the host visible (no home, no project, no other temp files), and a temp working
directory as its only writable place, removed afterwards. Limits: CPU seconds, wall seconds,
address space, file size and process count (``setrlimit``; as root the run drops to ``nobody``
so the process count is its own), stdout and stderr capped. Whatever the code does (read or write
outside its folder, open a socket, fork or allocate without end, loop forever, print gigabytes,
kill its parent) ends in a ``SandboxResult`` that says why; the host and the caller go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shutil
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnrl.tools.base import BaseTool, ToolError, ToolOutput

NOBODY = 65534
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/alternatives")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/mime.types")


class SandboxUnavailable(RuntimeError):
    """This machine cannot run the sandbox; the message says what is missing."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use."""

    cpu_s: int = 5  # CPU seconds (SIGXCPU, then SIGKILL)
    wall_s: float = 10.0  # seconds of wall time, then the whole sandbox is killed
    memory_mb: int = 512  # address space of each process
    file_size_mb: int = 16  # largest file it may write
    max_processes: int = 16  # processes and threads at once
    output_chars: int = 8_000  # of stdout and of stderr each; past it the run is stopped


@dataclass
class SandboxResult:
    """How a run ended."""

    stdout: str
    stderr: str
    exit_code: int | None  # None: killed by the sandbox (see reason)
    reason: str | None = None  # None: it exited by itself; else the limit that ended it
    seconds: float = 0.0
    truncated: bool = False  # stdout or stderr was cut to output_chars

    @property
    def ok(self) -> bool:
        """Exited by itself with code 0."""
        return self.exit_code == 0 and self.reason is None


@dataclass
class Sandbox:
    """Runs Python code in bubblewrap with limits; see the module doc."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    python: str | None = None  # the interpreter inside (None: the system's python3 under /usr)
    read_only: Sequence[str] = ()  # more host paths to show read-only (a venv's site-packages...)

    def __post_init__(self) -> None:
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise SandboxUnavailable(
                "the code sandbox needs bubblewrap: apt-get install bubblewrap (scripts/install_sandbox.sh)"
            )
        interpreter = self.python or shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
        if interpreter is None:
            raise SandboxUnavailable("the code sandbox found no python3 under /usr/local/bin, /usr/bin, /bin")
        self.interpreter = interpreter

    async def run(self, code: str, stdin: str = "") -> SandboxResult:
        """Run ``code`` (as ``main.py`` in a fresh temp dir) and return how it ended."""
        workdir = Path(tempfile.mkdtemp(prefix="turnrl-sandbox-"))
        try:
            (workdir / "main.py").write_text(code)
            if os.geteuid() == 0:
                os.chown(workdir, NOBODY, NOBODY)
                os.chown(workdir / "main.py", NOBODY, NOBODY)
            return await self._run(workdir, stdin)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def command(self, workdir: Path) -> list[str]:
        """The bwrap command line of one run."""
        assert self.bwrap is not None
        cmd = [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        for path in (*SYSTEM_DIRS, *self._interpreter_dirs(), *self.read_only):
            cmd += ["--ro-bind-try", path, path]
        for path in SYSTEM_FILES:
            cmd += ["--ro-bind-try", path, path]
        cmd += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", str(workdir), "/sandbox"]
        cmd += ["--remount-ro", "/", "--chdir", "/sandbox", "--setenv", "HOME", "/sandbox"]  # / read-only
        cmd += ["--uid", str(NOBODY), "--gid", str(NOBODY)]
        return [*cmd, self.interpreter, "-I", "-B", "main.py"]  # -B: no bytecode files

    def _interpreter_dirs(self) -> list[str]:
        """The interpreter's own install prefix, when it lies outside the system dirs."""
        prefix = str(Path(os.path.realpath(self.interpreter)).parent.parent)
        return [] if prefix.startswith(SYSTEM_DIRS) else [prefix]

    async def _run(self, workdir: Path, stdin: str) -> SandboxResult:
        limits = self.limits
        as_root = os.geteuid() == 0
        uid = NOBODY if as_root else os.getuid()
        running = _processes_of(uid)
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *self.command(workdir),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            preexec_fn=lambda: _set_limits(limits, running),
            user=NOBODY if as_root else None,
            group=NOBODY if as_root else None,
            extra_groups=[] if as_root else None,
            env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
        )
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.write(stdin.encode())
            await proc.stdin.drain()
            proc.stdin.close()
        out, err = _Capped(limits.output_chars, proc), _Capped(limits.output_chars, proc)
        readers = {asyncio.ensure_future(out.read(proc.stdout)), asyncio.ensure_future(err.read(proc.stderr))}
        _, pending = await asyncio.wait(readers, timeout=limits.wall_s)  # the readers end at EOF
        reason = None
        if pending:
            reason = f"wall time limit ({limits.wall_s:g} s)"
            _kill(proc)
        elif out.cut or err.cut:
            reason = f"output limit ({limits.output_chars} characters)"
        await asyncio.wait(readers, timeout=10)  # killed: its pipes close with its PID namespace
        await proc.wait()
        code = None if reason else proc.returncode
        result = SandboxResult(
            out.text(), err.text(), code, reason, time.monotonic() - t0, out.cut or err.cut
        )
        said = _said_limit(result.stderr, limits)  # a limit the code was told of, in its errors
        if reason is None:
            result.reason = said or _signal_limit(proc.returncode or 0, limits)
        elif out.cut or err.cut:
            result.reason = said or reason  # a bomb whose own errors filled the output: name the bomb
        if result.reason is not None:
            result.exit_code = None
        return result


class _Capped:
    """Reads a stream to its end, keeping at most ``limit`` characters; past it the run is killed
    (and the rest read and dropped, so the pipe closes)."""

    def __init__(self, limit: int, proc: asyncio.subprocess.Process) -> None:
        self.limit = limit
        self.proc = proc
        self.data = bytearray()
        self.cut = False

    async def read(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            if self.cut:
                continue
            self.data += chunk[: max(self.limit * 4 - len(self.data), 0)]  # up to 4 bytes a character
            if len(self.data) > self.limit and len(self.text(cap=False)) > self.limit:
                self.cut = True
                _kill(self.proc)

    def text(self, cap: bool = True) -> str:
        text = self.data.decode("utf-8", errors="replace")
        return text[: self.limit] if cap else text


def _said_limit(stderr: str, limits: SandboxLimits) -> str | None:
    """The limit a run's own errors name: memory, file size or processes."""
    if "MemoryError" in stderr:
        return f"memory limit ({limits.memory_mb} MiB)"
    if "File too large" in stderr:
        return f"file size limit ({limits.file_size_mb} MiB)"
    if "Resource temporarily unavailable" in stderr or "can't start new thread" in stderr:
        return f"process limit ({limits.max_processes})"
    return None


def _signal_limit(code: int, limits: SandboxLimits) -> str | None:
    """The limit behind a run that a signal ended (bwrap reports a signal as 128 + its number)."""
    signo = -code if code < 0 else code - 128 if code > 128 else 0
    if signo in (signal.SIGXCPU, signal.SIGKILL):
        return f"CPU time limit ({limits.cpu_s} s)"
    if signo == signal.SIGXFSZ:
        return f"file size limit ({limits.file_size_mb} MiB)"
    return f"killed by signal {signal.Signals(signo).name}" if signo else None


def _processes_of(uid: int) -> int:
    """How many processes ``uid`` runs now (RLIMIT_NPROC counts them all, not only this run's)."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                count += entry.stat().st_uid == uid
    return count


def _set_limits(limits: SandboxLimits, running: int) -> None:
    """In the child, before bwrap starts: the resource limits every process of the run inherits.
    (It runs as the run's user, after the fork: nothing may be imported here.)"""
    mib = 1 << 20
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mib, limits.memory_mb * mib))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size_mb * mib, limits.file_size_mb * mib))
    nproc = running + limits.max_processes + 4  # + bwrap's own processes
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _kill(proc: asyncio.subprocess.Process) -> None:
    """Kill the whole run: bwrap's session (its PID namespace goes with it)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def sandbox_report(result: SandboxResult) -> str:
    """What the model is told: the output, then why it ended when it did not end well."""
    parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
    if result.stderr.strip():
        parts.append(f"stderr:\n{result.stderr.rstrip()}")
    if result.truncated:
        parts.append("(output cut)")
    if result.reason is not None:
        parts.append(f"stopped: {result.reason}")
    elif result.exit_code:
        parts.append(f"exit code {result.exit_code}")
    return "\n".join(parts) or "(no output)"


CODE_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run Python code in a sandbox (no network, no files kept) and see what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python program to run."}},
            "required": ["code"],
        },
    },
}


class CodeInterpreter(BaseTool):
    """Runs the model's Python code in a ``Sandbox`` (seed 003's code interpreter). Output comes
    back as the tool message; a failing run (an exception, a limit) is a tool error whose message
    says why. Config: the ``SandboxLimits`` fields, ``python``, ``read_only``."""

    def __init__(
        self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None
    ) -> None:
        super().__init__(config=config, tool_schema=tool_schema or CODE_SCHEMA)
        options = dict(config or {})
        python, read_only = options.pop("python", None), options.pop("read_only", ())
        self.sandbox = Sandbox(SandboxLimits(**options), python, tuple(read_only))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> ToolOutput:
        """Run ``parameters["code"]``."""
        code = parameters.get("code")
        if not isinstance(code, str):
            raise ToolError("code_interpreter needs 'code': the program as a string")
        result = await self.sandbox.run(code)
        text = sandbox_report(result)
        if not result.ok:
            raise ToolError(text)
        metrics = {"sandbox_seconds": round(result.seconds, 3)}
        return ToolOutput(text, metrics=metrics)
