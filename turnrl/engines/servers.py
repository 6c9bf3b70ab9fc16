"""Start and stop a local llama.cpp ``llama-server`` (for tests, and for users without a GPU server).

``scripts/install_server.sh`` builds ``llama-server`` from the llama.cpp sources vendored in
the ``llama-cpp-python`` sdist (pinned below) into ``<turnrl cache>/llama.cpp/`` (default
``~/.cache/turnrl/llama.cpp``), next to that source's ``convert_hf_to_gguf.py``. Servers
listen on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

import httpx

from turnrl.cache import cache_dir
from turnrl.types import EngineError

# The sdist whose vendored llama.cpp install_server.sh builds; keep the two in step.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"


def llama_cpp_home() -> Path:
    """Where install_server.sh puts llama.cpp: ``$TURNRL_LLAMA_CPP_HOME`` or ``<cache>/llama.cpp``."""
    if home := os.environ.get("TURNRL_LLAMA_CPP_HOME"):
        return Path(home).expanduser()
    return cache_dir() / "llama.cpp"


def find_llama_server() -> Path | None:
    """The llama-server binary: ``$TURNRL_LLAMA_SERVER``, the installed one, or one on PATH."""
    if explicit := os.environ.get("TURNRL_LLAMA_SERVER"):
        return Path(explicit) if Path(explicit).is_file() else None
    installed = llama_cpp_home() / "bin" / "llama-server"
    if installed.is_file():
        return installed
    found = shutil.which("llama-server")
    return Path(found) if found else None


def find_convert_script() -> Path | None:
    """llama.cpp's ``convert_hf_to_gguf.py`` from the installed sources, if present."""
    script = llama_cpp_home() / "src" / "convert_hf_to_gguf.py"
    return script if script.is_file() else None


def convert_to_gguf(model_dir: str | Path, out_file: str | Path | None = None, outtype: str = "f32") -> Path:
    """Convert a Hugging Face model folder to GGUF (kept next to it by default; reused when newer)."""
    model_dir = Path(model_dir)
    out = Path(out_file) if out_file else model_dir / f"model-{outtype}.gguf"
    weights = [p.stat().st_mtime for p in model_dir.glob("*.safetensors")]
    if out.is_file() and weights and out.stat().st_mtime >= max(weights):
        return out
    script = find_convert_script()
    if script is None:
        raise EngineError(
            f"convert_hf_to_gguf.py not found under {llama_cpp_home()}: run scripts/install_server.sh"
        )
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    cmd = [sys.executable, str(script), str(model_dir), "--outfile", str(tmp), "--outtype", outtype]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = " ".join(done.stderr.strip().splitlines()[-1:])
        raise EngineError(f"GGUF conversion of {model_dir} failed: {tail}")
    os.replace(tmp, out)
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LlamaServer:
    """One ``llama-server`` process on 127.0.0.1 serving one GGUF model."""

    def __init__(
        self,
        model: str | Path,
        *,
        binary: str | Path | None = None,
        port: int | None = None,
        parallel: int = 4,
        ctx_size: int = 8192,
        threads: int = 1,
        kv_cache_type: str = "f32",
        flash_attn: bool = False,
        extra_args: Sequence[str] = (),
        log_path: str | Path | None = None,
    ) -> None:
        """Describe the server; nothing runs until :meth:`start`. ``ctx_size`` is shared by all slots.

        ``kv_cache_type`` f32 and no flash attention keep logprobs within ~1e-4 of a float32
        forward pass; llama.cpp's CPU flash attention computes in f16 and is off by up to ~1e-2
        nats. Trade exactness for memory and speed on big models with f16 / ``flash_attn``.
        """
        found = Path(binary) if binary else find_llama_server()
        if found is None:
            raise EngineError(
                "llama-server not found: run scripts/install_server.sh or set TURNRL_LLAMA_SERVER"
            )
        self.binary = found
        self.model = Path(model)
        self.port = port or free_port()
        self.parallel = parallel
        self.ctx_size = ctx_size
        self.threads = threads
        self.kv_cache_type = kv_cache_type
        self.flash_attn = flash_attn
        self.extra_args = list(extra_args)
        self.log_path = Path(log_path) if log_path else None
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        """The server root, ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The command line that starts the server."""
        return [
            str(self.binary),
            *("-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port)),
            *("-c", str(self.ctx_size), "-np", str(self.parallel), "-kvu"),
            *("-t", str(self.threads), "-tb", str(self.threads), "--threads-http", "2"),
            *(
                "-ctk",
                self.kv_cache_type,
                "-ctv",
                self.kv_cache_type,
                "-fa",
                "on" if self.flash_attn else "off",
            ),
            *("--no-webui", "--no-warmup"),
            *self.extra_args,
        ]

    def start(self, timeout_s: float = 60.0) -> LlamaServer:
        """Start the process and wait until ``/health`` answers 200."""
        if self.alive():
            return self
        self._close_log()
        self._log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 (closed in stop)
        out = self._log or subprocess.DEVNULL
        self.process = subprocess.Popen(
            self.command(), stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
        )
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def alive(self) -> bool:
        """Whether the process is running."""
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """Kill the process at once (SIGKILL), as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
        self._close_log()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the process to end (SIGTERM), kill it if it does not; close the log."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_log()

    def _close_log(self) -> None:
        """Close the log file, if one is open."""
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _wait_ready(self, timeout_s: float) -> None:
        """Poll ``/health`` until 200; fail early if the process exits."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if not self.alive():
                    code = self.process.returncode if self.process else None
                    raise EngineError(
                        f"llama-server exited with code {code} while starting ({self._log_hint()})"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                time.sleep(0.1)
        raise EngineError(f"llama-server not ready after {timeout_s}s ({self._log_hint()})")

    def _log_hint(self) -> str:
        """Where to look for the server's own messages."""
        return f"log: {self.log_path}" if self.log_path else "pass log_path to keep its log"
