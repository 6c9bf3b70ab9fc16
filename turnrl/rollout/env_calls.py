"""Calling env code so that it cannot hang, stall or kill the run.

Every env coroutine the loop awaits (``reset``, ``step``, ``score``, ``close``) runs under
``call``, which

- bounds it by the timeout (``limits.env_timeout_s``);
- times each stretch it runs without yielding to the event loop. A stretch that waits
  ``BLOCKING_S`` or more without computing is a synchronous call inside ``async def``
  (``time.sleep``, ``requests.get``, ``subprocess.run``) that stalls every other trajectory
  meanwhile: it is reported once per env class (a warning on the ``turnrl`` logger, and
  ``env_failures/by_kind``), and from then on every call of that class's envs runs in a worker
  thread with its own event loop, one per env, where a blocking call stalls only its own
  trajectory and the timeout bounds it. A call that held the
  loop past the timeout fails as a timeout, although it returned;
- turns ``SystemExit`` and ``KeyboardInterrupt`` raised by env code into an ordinary failure
  (``EnvExit``), which ends that trajectory as ``env_error`` instead of the whole run. (Ctrl-C
  still stops the run: asyncio turns it into a cancellation, not a KeyboardInterrupt here.)
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any

logger = logging.getLogger("turnrl")

BLOCKING_S = 1.0
"""A stretch of env code that spends this long without yielding to the event loop *and* without
computing (asleep in ``time.sleep``, waiting on a socket) marks its class as blocking. Time spent
computing (a first import, a tokenizer) does not count: a thread would not help it."""

_blocking: dict[type, str] = {}  # env class -> how it was seen blocking (its calls run in threads)
_loops: dict[int, _EnvLoop] = {}  # id(env) -> the worker loop of an env of a blocking class


class EnvExit(Exception):
    """Env code raised SystemExit or KeyboardInterrupt."""


class BlockedLoop(Exception):
    """Env code held the event loop past its timeout."""


class _Timed:
    """Awaits a coroutine, timing each stretch it runs between two yields to the event loop."""

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.coro = coro
        self.longest = 0.0  # wall seconds of the longest stretch
        self.idle = 0.0  # the most wall seconds a stretch spent not computing (asleep, waiting on I/O)

    def _clock(self, t0: float, c0: float) -> None:
        wall = time.perf_counter() - t0
        self.longest = max(self.longest, wall)
        self.idle = max(self.idle, wall - (time.thread_time() - c0))

    def __await__(self) -> Generator[Any, Any, Any]:
        step: Callable[[Any], Any] = self.coro.send
        value: Any = None
        while True:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                yielded = step(value)
            except StopIteration as stop:
                self._clock(t0, c0)
                return stop.value
            except (SystemExit, KeyboardInterrupt) as exc:
                raise EnvExit(f"env code raised {type(exc).__name__}({exc})") from None
            self._clock(t0, c0)
            try:
                value, step = (yield yielded), self.coro.send
            except GeneratorExit:
                self.coro.close()
                raise
            except BaseException as exc:  # a cancellation or error thrown in: pass it on
                value, step = exc, self.coro.throw


class _EnvLoop:
    """A thread running its own event loop, where one env's calls run."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self._serve, name="turnrl-env", daemon=True).start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        try:  # stopped: start what was queued before the stop, then cancel what is left, then close
            self.loop.run_until_complete(asyncio.sleep(0))
            left = asyncio.all_tasks(self.loop)
            for task in left:
                task.cancel()
            if left:
                self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        finally:
            self.loop.close()

    async def run(self, coro: Awaitable[Any]) -> Any:
        async def inside() -> Any:
            return await coro

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(inside(), self.loop))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)  # after the call in progress, if any


def blocking(env: Any) -> str | None:
    """How ``env``'s class was seen blocking the event loop (its calls run in threads), or None."""
    return _blocking.get(type(env))


async def call(
    env: Any, name: str, make: Callable[[], Coroutine[Any, Any, Any]], timeout: float | None
) -> Any:
    """``make()`` (a coroutine of ``env``'s ``name`` method) awaited under the rules above."""
    async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it drops a cancel that meets the result
        return await _dispatch(env, name, make, timeout)


async def _dispatch(
    env: Any, name: str, make: Callable[[], Coroutine[Any, Any, Any]], timeout: float | None
) -> Any:
    """Run the call where it belongs, decided when it starts (calls queued behind the one that
    blocked see the verdict): a worker thread for a blocking class, else this loop, timed."""
    if type(env) in _blocking:
        loop = _loops.get(id(env))
        if loop is None:
            loop = _loops[id(env)] = _EnvLoop()
        return await loop.run(_Timed(make()))
    timed = _Timed(make())
    result = await timed
    if timed.idle >= BLOCKING_S and type(env) not in _blocking:  # asleep, not computing (an import)
        kind = type(env).__name__
        _blocking[type(env)] = f"{kind}.{name} held the event loop for {timed.longest:.1f}s"
        logger.warning(
            "%s.%s held the event loop for %.1fs (a synchronous call inside async def?): every call of "
            "%s envs now runs in a worker thread",
            kind,
            name,
            timed.longest,
            kind,
        )
    if timeout is not None and timed.longest > timeout:
        raise BlockedLoop(f"held the event loop for {timed.longest:.1f}s, past the {timeout}s timeout")
    return result


def release(env: Any) -> None:
    """Stop ``env``'s worker loop, if it has one (after its close)."""
    loop = _loops.pop(id(env), None)
    if loop is not None:
        loop.stop()
