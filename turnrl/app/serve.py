"""Serve one node's engines into a registry: ``turnrl serve`` (or ``python -m turnrl.app.serve``).

::

    turnrl serve run.yaml [--set key=value ...] [--replicas N] [--address auto]
    turnrl serve --registry NAME --url http://host:8000 [--dialect vllm]

With a run config, embedded kinds (``hf``, ``vllm``) start ``engine.ray.replicas`` engine actors
pinned to this node (``engine.ray.num_cpus`` / ``num_gpus`` each) and register them in
``engine.ray.registry``; server kinds (``openai``, ``sglang``) register ``engine.urls``. Without
a config, ``--url`` registers servers. It runs until interrupted (Ctrl-C, SIGTERM), then
unregisters what it registered and stops its actors. If the process dies instead, its actors
die with it and the registry drops them at its next health check.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

from turnrl.app.engines import EngineBuild
from turnrl.config import (
    AnyEngineConfig,
    ConfigError,
    HFEngineConfig,
    OpenAIEngineConfig,
    RayEngineConfig,
    ScriptedEngineConfig,
    SGLangEngineConfig,
    load_config,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turnrl serve", description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", help="a run config: its model and engine sections")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--registry", help="registry name (default: engine.ray.registry)")
    parser.add_argument("--namespace", help="registry namespace (default: engine.ray.namespace)")
    parser.add_argument("--address", help="Ray address (default: engine.ray.address, else auto)")
    parser.add_argument("--replicas", type=int, help="engine actors to start (default: engine.ray.replicas)")
    parser.add_argument("--url", action="append", default=[], help="a server to register (repeatable)")
    parser.add_argument("--kind", choices=["openai", "sglang"], default="openai", help="--url servers' API")
    parser.add_argument("--dialect", choices=["vllm", "sglang", "llamacpp"], default="vllm")
    parser.add_argument("--served-model", help="--url servers' model name")
    return parser


Server = tuple[str, dict[str, Any]]
"""A server to register: its URL and register_server's keyword arguments."""


def _settings(args: argparse.Namespace) -> tuple[str | None, AnyEngineConfig, RayEngineConfig, list[Server]]:
    """The model (None without a config), the engine config, its ray section with the command
    line's overrides, and the servers to register."""
    model: str | None = None
    engine: AnyEngineConfig = HFEngineConfig()
    servers: list[Server] = []
    if args.config:
        config = load_config(args.config, args.set)
        if isinstance(config.engine, ScriptedEngineConfig):
            raise ConfigError("turnrl serve hosts model engines: engine.kind scripted has no model to serve")
        model, engine = config.model, config.engine
        if isinstance(engine, OpenAIEngineConfig):
            same = {"kind": "openai", "dialect": engine.dialect, "served_model": engine.served_model}
            servers += [(url, same) for url in engine.urls]
        elif isinstance(engine, SGLangEngineConfig):
            servers += [
                (url, {"kind": "sglang", "dialect": "sglang", "served_model": None}) for url in engine.urls
            ]
    given = {"kind": args.kind, "dialect": args.dialect, "served_model": args.served_model}
    servers += [(url, given) for url in args.url]
    updates: dict[str, Any] = {
        k: v for k, v in (("registry", args.registry), ("namespace", args.namespace)) if v
    }
    updates.update({"address": args.address or engine.ray.address or "auto"})
    if args.replicas is not None:
        updates["replicas"] = args.replicas
    return model, engine, engine.ray.model_copy(update=updates), servers


def serve(
    model: str | None,
    engine: AnyEngineConfig,
    rc: RayEngineConfig,
    servers: Sequence[Server],
    stop: threading.Event,
) -> int:
    """Start and register this node's engines, wait for ``stop``, then unregister and stop them."""
    import ray

    from turnrl.distributed.ray_engines import (
        connect,
        get_registry,
        register_actor,
        register_server,
        start_replica,
    )

    if not rc.registry:
        print("no registry: set engine.ray.registry or pass --registry", file=sys.stderr)
        return 2
    connect(rc.address)
    registry = get_registry(rc.registry, rc.namespace, health_interval_s=rc.health_interval_s)
    node = ray.get_runtime_context().get_node_id()
    handles: list[Any] = []
    if model is not None and not isinstance(engine, OpenAIEngineConfig | SGLangEngineConfig):
        handles = [start_replica(EngineBuild(model, engine), rc, node_id=node) for _ in range(rc.replicas)]
    names: list[str] = []
    try:
        names += [register_actor(registry, h) for h in handles]
        names += [register_server(registry, url, **kwargs) for url, kwargs in servers]
        if not names:
            print("nothing to serve: no replicas and no server URLs", file=sys.stderr)
            return 2
        for name in names:
            print(f"registered {name} in {rc.namespace}/{rc.registry}", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        for name in names:
            ray.get(registry.unregister.remote(name))
        for handle in handles:
            ray.kill(handle)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and serve until interrupted."""
    args = _parser().parse_args(argv)
    if not args.config and not args.url:
        _parser().error("give a run config or at least one --url")
    model, engine, rc, servers = _settings(args)
    from turnrl.distributed.ray_engines import connect

    connect(rc.address)  # first: joining Ray installs its own signal handlers, replaced below
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return serve(model, engine, rc, servers, stop)


if __name__ == "__main__":
    sys.exit(main())
