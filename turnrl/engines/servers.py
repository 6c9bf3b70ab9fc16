"""Start and stop a local llama.cpp ``llama-server`` (for tests, and for users without a GPU server).

``scripts/install_server.sh`` builds ``llama-server`` from the llama.cpp sources vendored in
the ``llama-cpp-python`` sdist (pinned below) into ``<turnrl cache>/llama.cpp/`` (default
``~/.cache/turnrl/llama.cpp``), next to that source's ``convert_hf_to_gguf.py``. Servers
listen on 127.0.0.1 only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from turnrl.engines.process import ServerProcess, free_port
from turnrl.support.cache import cache_dir
from turnrl.types import EngineError

__all__ = [
    "LlamaServer",
    "convert_to_gguf",
    "find_convert_script",
    "find_llama_server",
    "free_port",
    "llama_cpp_home",
]

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


class LlamaServer(ServerProcess):
    """One ``llama-server`` process on 127.0.0.1 serving one GGUF model."""

    name = "llama-server"

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
        super().__init__(port=port, log_path=log_path)
        self.binary = found
        self.model = Path(model)
        self.parallel = parallel
        self.ctx_size = ctx_size
        self.threads = threads
        self.kv_cache_type = kv_cache_type
        self.flash_attn = flash_attn
        self.extra_args = list(extra_args)

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
