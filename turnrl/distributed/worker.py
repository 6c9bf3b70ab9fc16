"""The env worker: one process hosting many envs, each keyed by an episode id.

Plain Python, no Ray: the pool wraps ``EnvWorker`` in ``ray.remote``. Every method is async,
so Ray runs it as an async actor and many episodes progress at once. With ``threads`` on,
each env lives on its own thread with its own event loop, so an env that blocks (``time.sleep``,
a sync client inside ``async def step``) stalls only itself, never its neighbours.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from turnrl.env.base import Env
from turnrl.env.registry import resolve_env
from turnrl.types import Message, Sample, StepResult, Trajectory

T = TypeVar("T")
Tools = list[dict[str, Any]] | None


@dataclass(frozen=True)
class EnvSpec:
    """How a worker builds an env: a registered name, ``module:Class``, or a picklable callable."""

    factory: str | Callable[..., Env]  # names are resolved in the worker with ``resolve_env``
    kwargs: dict[str, Any] = field(default_factory=dict)  # the env's constructor kwargs

    def build(self, sample: Sample) -> Env:
        """A fresh env for ``sample``."""
        factory = resolve_env(self.factory).factory if isinstance(self.factory, str) else self.factory
        return factory(sample, **self.kwargs)


class EnvThread:
    """A daemon thread running its own event loop; coroutines submitted to it run there."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.close()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on this thread's loop; cancelling the caller cancels it there."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self) -> None:
        """Stop the loop once it is free; the thread then ends."""
        self.loop.call_soon_threadsafe(self.loop.stop)


@dataclass
class Episode:
    """One live env in a worker."""

    env: Env | None = None  # None while it is being built
    thread: EnvThread | None = None  # where its calls run (None: the worker's own loop)
    closed: bool = False  # close arrived (possibly before the build finished)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run an env coroutine where this env lives."""
        return await (self.thread.run(coro) if self.thread else coro)


async def _build(spec: EnvSpec, sample: Sample) -> Env:
    return spec.build(sample)


async def _step_and_format(env: Env, action: str) -> tuple[StepResult, list[Message] | Exception | None]:
    """Step, then format the observation for the next turn (None when done; the error if it failed)."""
    result = await env.step(action)
    if result.done:
        return result, None
    try:
        return result, env.format_observation(result.observation)
    except Exception as exc:  # raised on the driver where the loop formats, as it would be locally
        return result, exc


class EnvWorker:
    """Hosts many envs keyed by episode id; every Env call of a RemoteEnv runs here."""

    def __init__(self, threads: bool = True) -> None:
        self.threads = threads
        self.episodes: dict[str, Episode] = {}

    async def ready(self) -> int:
        """The worker's pid, once it is up."""
        return os.getpid()

    async def num_episodes(self) -> int:
        """Envs alive in this worker."""
        return len(self.episodes)

    async def open(self, eid: str, spec: EnvSpec, sample: Sample) -> Tools:
        """Build the env of episode ``eid``; return its tools."""
        episode = Episode(thread=EnvThread(f"env-{eid}") if self.threads else None)
        self.episodes[eid] = episode
        try:
            env = await episode.run(_build(spec, sample))
        except BaseException:
            self._forget(eid, episode)
            raise
        episode.env = env
        if episode.closed:  # the driver gave up on this open while the env was being built
            await episode.run(env.close())
            self._forget(eid, episode)
            raise RuntimeError(f"episode {eid} was closed while it opened")
        return env.tools

    async def reset(self, eid: str) -> tuple[list[Message], Tools]:
        """Reset the env; return the prompt messages and its tools."""
        episode, env = self._live(eid)
        messages = await episode.run(env.reset())
        return messages, env.tools

    async def step(self, eid: str, action: str) -> tuple[StepResult, list[Message] | Exception | None]:
        """Step the env; return the result and the formatted observation."""
        episode, env = self._live(eid)
        return await episode.run(_step_and_format(env, action))

    async def format_observation(self, eid: str, observation: Any) -> list[Message]:
        """Format an observation (the driver's slow path; ``step`` already formats)."""
        _, env = self._live(eid)
        return env.format_observation(observation)

    async def score(self, eid: str, trajectory: Trajectory) -> float | None:
        """The env's final score of ``trajectory``."""
        episode, env = self._live(eid)
        return await episode.run(env.score(trajectory))

    async def close(self, eid: str) -> None:
        """Close and forget the env; unknown ids are ignored. The env is gone even if close raises."""
        episode = self.episodes.get(eid)
        if episode is None:
            return
        episode.closed = True
        if episode.env is None:  # still being built: ``open`` closes it when the build returns
            return
        try:
            await episode.run(episode.env.close())
        finally:
            self._forget(eid, episode)

    def _live(self, eid: str) -> tuple[Episode, Env]:
        episode = self.episodes.get(eid)
        if episode is None or episode.env is None or episode.closed:
            raise KeyError(f"no open env for episode {eid} in worker {os.getpid()}")
        return episode, episode.env

    def _forget(self, eid: str, episode: Episode) -> None:
        if self.episodes.get(eid) is episode:
            del self.episodes[eid]
        if episode.thread:
            episode.thread.stop()
