"""Envs on Ray: a bounded pool of worker actors, and ``RemoteEnv`` proxies the turn loop drives.

``RayEnvPool`` starts ``num_workers`` actors (one process each); each hosts many envs keyed by an
episode id, placed on the least loaded worker when a trajectory resets. ``RemoteEnv`` is an
``Env`` whose every call (build, reset, step, format_observation, score, close) runs in that
worker, awaited on the driver as an ObjectRef: a slow or blocking env never stalls the event
loop that drives the model, and trajectories still stream back one by one.

Failures: an exception in the env reaches the loop as the original exception (type and
message), so retries and ``env_error`` work as for a local env. A worker that dies fails the
calls of its envs with ``ActorDiedError`` (those trajectories end with ``env_error``: their env
state is gone) and is replaced by a fresh worker for the episodes that come after; a reset
that hits a dead worker is retried on another one.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from turnrl.config import RayEnvConfig
from turnrl.distributed.worker import EnvSpec, EnvWorker, Tools
from turnrl.env.base import Env
from turnrl.types import Message, Observation, Sample, StepResult, Trajectory

try:
    import ray
    from ray.exceptions import ActorDiedError, RayTaskError
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("env workers on Ray need Ray: pip install 'turnrl[ray]'") from exc


def connect(config: RayEnvConfig) -> None:
    """Join Ray: the one this process already runs, else ``config.address`` (None: start a local one)."""
    if not ray.is_initialized():
        ray.init(address=config.address)


@dataclass
class _Worker:
    """A worker actor and the number of envs the driver placed on it."""

    handle: Any  # ray.actor.ActorHandle of an EnvWorker
    episodes: int = 0
    dead: bool = False


class RayEnvPool:
    """A fixed number of env worker actors; ``factory`` makes EnvFactories whose envs live in them.

    The pool runs whatever ``config.enabled`` says: that flag is the run config's switch.
    """

    def __init__(self, config: RayEnvConfig | None = None) -> None:
        self.config = config or RayEnvConfig(enabled=True)
        connect(self.config)
        self._workers = [self._start() for _ in range(self.config.num_workers)]
        self.replaced = 0  # workers found dead and replaced

    def _start(self) -> _Worker:
        options: dict[str, Any] = {"num_cpus": self.config.num_cpus_per_worker}
        if self.config.runtime_env:
            options["runtime_env"] = self.config.runtime_env
        actor = ray.remote(EnvWorker).options(**options)
        return _Worker(actor.remote(self.config.env_threads))

    def ready(self, timeout_s: float = 120.0) -> list[int]:
        """Block until every worker is up; return their pids. Raises if the cluster cannot place them."""
        refs = [w.handle.ready.remote() for w in self._workers]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(done) < len(refs):
            wanted = self.config.num_workers * self.config.num_cpus_per_worker
            raise RuntimeError(
                f"only {len(done)} of {len(refs)} env workers started within {timeout_s:g} s: they ask "
                f"for {wanted:g} CPUs, the cluster has {ray.cluster_resources().get('CPU', 0):g}"
            )
        return [int(pid) for pid in ray.get(done)]

    def factory(
        self, env: str | Callable[..., Env], kwargs: Mapping[str, Any] | None = None
    ) -> RayEnvFactory:
        """An EnvFactory building ``env(sample, **kwargs)`` in this pool's workers."""
        return RayEnvFactory(self, ray.put(EnvSpec(env, dict(kwargs or {}))))

    @property
    def loads(self) -> list[int]:
        """Envs currently placed on each worker, by the driver's count."""
        return [w.episodes for w in self._workers]

    async def live_envs(self) -> int:
        """Envs alive in the workers, counted by the workers themselves."""
        return sum(await asyncio.gather(*(w.handle.num_episodes.remote() for w in self._workers)))

    def actors(self) -> list[Any]:
        """The worker actor handles (to inspect or kill one)."""
        return [w.handle for w in self._workers]

    def shutdown(self) -> None:
        """Kill every worker; envs still open in them are lost."""
        for worker in self._workers:
            worker.dead = True
            ray.kill(worker.handle)

    def _acquire(self) -> _Worker:
        worker = min(self._workers, key=lambda w: w.episodes)
        worker.episodes += 1
        return worker

    def _release(self, worker: _Worker) -> None:
        worker.episodes -= 1

    def _replace(self, worker: _Worker) -> None:
        """Swap a dead worker for a fresh one (once, however many of its calls report the death)."""
        if worker.dead:
            return
        worker.dead = True
        self._workers[self._workers.index(worker)] = self._start()
        self.replaced += 1

    async def _call(self, worker: _Worker, method: str, *args: Any) -> Any:
        """Await ``method`` on ``worker``: cancellation reaches the worker, env errors come back as raised."""
        ref = getattr(worker.handle, method).remote(*args)
        try:
            return await ref
        except asyncio.CancelledError:
            ray.cancel(ref)
            raise
        except RayTaskError as exc:
            raise _original(exc) from exc
        except ActorDiedError:
            self._replace(worker)
            raise


def _original(exc: RayTaskError) -> BaseException:
    """The exception the env raised, when Ray could bring it back; else Ray's own error."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


@dataclass(frozen=True)
class RayEnvFactory:
    """An EnvFactory: ``factory(sample)`` is a RemoteEnv whose env is built in the pool on reset."""

    pool: RayEnvPool
    spec: Any  # ray.ObjectRef of the EnvSpec, shipped once to the object store

    def __call__(self, sample: Sample) -> RemoteEnv:
        """A proxy env for ``sample``; nothing runs until ``reset``."""
        return RemoteEnv(sample, self.pool, self.spec)

    def shutdown(self) -> None:
        """Kill the pool's workers."""
        self.pool.shutdown()


class RemoteEnv(Env):
    """An Env whose real env lives in a Ray worker; every call is awaited on the driver."""

    def __init__(self, sample: Sample, pool: RayEnvPool, spec: Any) -> None:
        super().__init__(sample)
        self._pool = pool
        self._spec = spec
        self._worker: _Worker | None = None
        self._eid = ""
        self._formatted: tuple[Observation, list[Message] | Exception | None] | None = None

    async def reset(self) -> list[Message]:
        """Build the env in the least loaded worker (first call), then reset it there."""
        if self._worker is None:
            await self._open()
        try:
            messages, self.tools = await self._call("reset")
        except ActorDiedError:
            self._drop()  # a reset holds no state yet: the retry opens on a live worker
            raise
        return list(messages)

    async def step(self, action: str) -> StepResult:
        """Step the env in its worker; the observation comes back formatted too."""
        result, formatted = await self._call("step", action)
        self._formatted = (result.observation, formatted)
        return result

    def format_observation(self, observation: Observation) -> list[Message]:
        """The observation as the env formatted it in its worker, right after the step."""
        if self._formatted is not None and self._formatted[0] is observation:
            formatted = self._formatted[1]
            if isinstance(formatted, Exception):
                raise formatted
            if formatted is not None:
                return formatted
        # Slow path, never taken by the turn loop: a blocking round trip to the worker.
        return ray.get(self._live().handle.format_observation.remote(self._eid, observation))

    async def score(self, trajectory: Trajectory) -> float | None:
        """The env's score, computed in its worker."""
        return await self._call("score", trajectory)

    async def close(self) -> None:
        """Close the env in its worker, within ``close_timeout_s``; the driver's slot is always freed."""
        worker = self._worker
        if worker is None:
            return
        try:
            close = self._pool._call(worker, "close", self._eid)
            async with asyncio.timeout(self._pool.config.close_timeout_s):
                await close
        finally:
            self._drop()

    async def _open(self) -> None:
        worker = self._pool._acquire()
        eid = f"{self.sample.id}/{uuid.uuid4().hex[:12]}"
        try:
            tools: Tools = await self._pool._call(worker, "open", eid, self._spec, self.sample)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):  # the open may still complete in the worker
                worker.handle.close.remote(eid)
            self._pool._release(worker)
            raise
        self._worker, self._eid, self.tools = worker, eid, tools

    def _drop(self) -> None:
        """Forget the worker and free its slot."""
        if self._worker is not None:
            self._pool._release(self._worker)
            self._worker = None

    def _live(self) -> _Worker:
        if self._worker is None:
            raise RuntimeError(f"env of sample {self.sample.id!r} is not open (call reset first)")
        return self._worker

    async def _call(self, method: str, *args: Any) -> Any:
        return await self._pool._call(self._live(), method, self._eid, *args)


def ray_env_factory(
    env: str | Callable[..., Env], kwargs: Mapping[str, Any] | None = None, config: RayEnvConfig | None = None
) -> RayEnvFactory:
    """An EnvFactory whose envs run in a new pool of Ray workers (started and ready on return)."""
    pool = RayEnvPool(config)
    pool.ready()
    return pool.factory(env, kwargs)
