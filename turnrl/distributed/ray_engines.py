"""Engines as Ray actors, the driver's proxy for one, and the engine registry's helpers.

``start_engine_actor`` starts an ``EngineHost`` actor (``num_cpus`` / ``num_gpus`` on whatever
node has them, or pinned to one node) that builds and serves any turnrl engine. ``RayEngine`` is
the driver's Engine for one such actor: ``generate``, ``abort_all``, ``update_weights`` and
``close`` are actor calls, awaited as ObjectRefs, so the driver's event loop stays free.

``get_registry`` finds or creates a named, detached ``EngineRegistry`` actor; nodes register
their engine actors (``register_actor``) or inference servers (``register_server``) there, and
drivers balance over its list (``turnrl.distributed.registry_engine``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from turnrl.config import RayEngineConfig
from turnrl.distributed.engine_host import EngineHost
from turnrl.distributed.registry import EngineEntry, EngineRegistry
from turnrl.types import Engine, Generation, SamplingParams, Weights

try:
    import ray
    from ray.exceptions import RayTaskError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("engines on Ray need Ray: pip install 'turnrl[ray]'") from exc


def connect(address: str | None = None) -> None:
    """Join Ray: the one this process already runs, else ``address`` (None: start a local one)."""
    if not ray.is_initialized():
        ray.init(address=address)


def kill(handle: Any) -> None:
    """Kill an actor (its in-flight calls fail with ActorDiedError)."""
    ray.kill(handle)


def _original(exc: RayTaskError) -> BaseException:
    """The exception the engine raised, when Ray could bring it back; else Ray's own error."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


async def await_call(ref: Any) -> Any:
    """Await an actor call: cancelling the caller cancels the call, engine errors come back as raised.

    A dead actor raises Ray's ``ActorDiedError``, which is not an ``EngineError``: the balancer
    takes it as a server failure and moves the call.
    """
    try:
        return await ref
    except asyncio.CancelledError:
        ray.cancel(ref)
        raise
    except RayTaskError as exc:
        raise _original(exc) from exc


def start_engine_actor(
    build: Callable[[], Engine],
    *,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    runtime_env: dict[str, Any] | None = None,
    node_id: str | None = None,
) -> Any:
    """Start an EngineHost actor that builds its engine with ``build()``; its handle (not yet ready).

    ``node_id`` pins it to one node (``ray.get_runtime_context().get_node_id()`` is this one);
    else Ray places it wherever ``num_cpus`` and ``num_gpus`` are free.
    """
    options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    if runtime_env:
        options["runtime_env"] = runtime_env
    if node_id is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return ray.remote(EngineHost).options(**options).remote(build)


def wait_ready(handles: Sequence[Any], timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Block until every engine actor has built its engine; their ``ready`` info (pid, host).

    TimeoutError when the cluster cannot place them in time; an engine that fails to build
    raises its error here.
    """
    refs = [h.ready.remote() for h in handles]
    if not refs:
        return []
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if len(done) < len(refs):
        free = ray.available_resources()
        raise TimeoutError(
            f"only {len(done)} of {len(refs)} engine actors started within {timeout_s:g} s (free now: "
            f"{free.get('CPU', 0):g} CPUs, {free.get('GPU', 0):g} GPUs)"
        )
    try:
        return list(ray.get(refs))
    except RayTaskError as exc:
        raise _original(exc) from exc


def actor_name(info: dict[str, Any]) -> str:
    """A registry name for an engine actor: ``host:pid``."""
    return f"{info['host']}:{info['pid']}"


class RayEngine:
    """An Engine whose engine runs in an EngineHost actor; ``owned``: close kills the actor."""

    def __init__(self, handle: Any, name: str = "", *, owned: bool = False) -> None:
        self.handle = handle
        self.name = name
        self.owned = owned
        self._version: int | None = None

    @property
    def weight_version(self) -> int | None:
        """The version the last ``update_weights`` through this proxy set (None before any)."""
        return self._version

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[Any] = (),
        *,
        session: str | None = None,
    ) -> Generation:
        """The actor's generation (prompt ids are copied into the call)."""
        gen: Generation = await await_call(
            self.handle.generate.remote(list(prompt_ids), sampling, tuple(images), session)
        )
        return gen

    async def abort_all(self) -> None:
        """Abort every generation in flight in the actor's engine."""
        await await_call(self.handle.abort_all.remote())

    async def update_weights(self, weights: Weights, *, version: int | None = None) -> int:
        """Update the actor's engine: a state dict (CPU tensors travel best) or a folder on its node."""
        self._version = int(await await_call(self.handle.update_weights.remote(weights, version)))
        return self._version

    async def close(self) -> None:
        """Owned: close the engine and kill the actor. Not owned (a registered engine): nothing."""
        if not self.owned:
            return
        with contextlib.suppress(Exception):
            async with asyncio.timeout(30.0):
                await await_call(self.handle.close.remote())
        ray.kill(self.handle)
        await _until_dead(self.handle, 30.0)  # ray.kill returns before the actor is gone


async def _until_dead(handle: Any, timeout_s: float) -> None:
    """Wait until calls to ``handle`` fail because the actor died (or ``timeout_s`` passes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with asyncio.timeout(1.0):
                await await_call(handle.ping.remote())
        except ray.exceptions.RayActorError:
            return
        except Exception:  # a timeout while it dies: ask again
            pass
        await asyncio.sleep(0.05)


def get_registry(
    name: str, namespace: str = "turnrl", *, create: bool = True, health_interval_s: float = 5.0
) -> Any:
    """The named registry actor; created (detached, no CPU) when missing and ``create`` is set.

    ``health_interval_s`` only applies when this call creates it. ValueError when it is missing
    and ``create`` is off.
    """
    if not create:
        return ray.get_actor(name, namespace=namespace)
    actor = ray.remote(EngineRegistry).options(
        name=name, namespace=namespace, lifetime="detached", get_if_exists=True, num_cpus=0
    )
    return actor.remote(health_interval_s)


def register_actor(registry: Any, handle: Any, name: str | None = None) -> str:
    """Register an engine actor (waiting until it is ready); its registry name (default ``host:pid``)."""
    [info] = wait_ready([handle])
    entry = EngineEntry(name or actor_name(info), handle=handle, node=str(info.get("host", "")))
    ray.get(registry.register.remote(entry))
    return entry.name


def register_server(
    registry: Any,
    url: str,
    *,
    kind: str = "openai",
    dialect: str = "vllm",
    served_model: str | None = None,
    name: str | None = None,
) -> str:
    """Register an inference server by URL; its registry name (default: the URL)."""
    entry = EngineEntry(
        name or url,
        url=url,
        kind=kind,  # type: ignore[arg-type]  # checked by the caller's config or CLI choices
        dialect=dialect,  # type: ignore[arg-type]
        served_model=served_model,
        node=url,
    )
    ray.get(registry.register.remote(entry))
    return entry.name


def wait_for_entries(registry: Any, min_engines: int = 1, timeout_s: float = 300.0) -> list[EngineEntry]:
    """Block until the registry lists at least ``min_engines``; the entries. TimeoutError if not."""
    deadline = time.monotonic() + timeout_s
    while True:
        _, entries = ray.get(registry.entries.remote())
        if len(entries) >= min_engines:
            return list(entries)
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"the engine registry lists {len(entries)} engine(s) after {timeout_s:g} s; "
                f"waiting for {min_engines} (start them with turnrl serve)"
            )
        time.sleep(0.2)


def start_replica(build: Callable[[], Engine], rc: RayEngineConfig, node_id: str | None = None) -> Any:
    """An engine actor with the resources ``rc`` asks for."""
    return start_engine_actor(
        build, num_cpus=rc.num_cpus, num_gpus=rc.num_gpus, runtime_env=rc.runtime_env, node_id=node_id
    )
