"""A small JSON-over-HTTP client for inference servers: timeouts, retries with backoff, clear errors.

Connection errors, timeouts, 5xx and 429 answers are retried with exponential backoff within
a budget (a number of retries and a total number of seconds); other 4xx answers are not
retried. Every attempt has a hard deadline, so a server that accepts a connection and then
never answers cannot hang a caller.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from turnrl.support.errors import describe
from turnrl.types import EngineError, FinishReason, Generation

T = TypeVar("T")

_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
_MAX_ERROR_CHARS = 300


class ServerError(EngineError):
    """The server could not be reached, timed out or kept failing (5xx) through every retry."""


class RequestError(EngineError):
    """The server refused the request (4xx) or sent an answer that cannot be used; not retried."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry a request that failed for a transient reason."""

    max_retries: int = 3  # retries after the first attempt
    budget_s: float = 600.0  # total seconds for all attempts and waits of one request
    backoff_s: float = 0.25  # wait before the first retry; doubled after each retry
    max_backoff_s: float = 8.0  # cap on one wait
    jitter: float = 0.1  # each wait is stretched by up to this fraction at random

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (0-based)."""
        base = min(self.backoff_s * (2**retry), self.max_backoff_s)
        return base * (1.0 + self.jitter * random.random())


def error_message(response: httpx.Response) -> str:
    """The server's own error message, from the JSON shapes servers use, else the body text."""
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    for key in ("error", "message", "detail"):
        if isinstance(body, dict) and key in body:
            body = body[key]
    if isinstance(body, dict) and "message" in body:
        body = body["message"]
    text = body if isinstance(body, str) else json.dumps(body)
    text = " ".join(text.split()) or response.reason_phrase
    return text[:_MAX_ERROR_CHARS]


class _Retryable(Exception):
    """One failed attempt that may succeed when tried again."""


class JsonClient:
    """Posts JSON to one server with per-attempt deadlines and the retry policy."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = 256,
    ) -> None:
        """``timeout_s`` bounds one attempt from connect to the last byte; ``transport`` is for tests."""
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            limits=limits,
            transport=transport,
            trust_env=False,  # never route a local server through a proxy from the environment
        )

    async def post(self, path: str, payload: Mapping[str, Any], *, timeout_s: float | None = None) -> Any:
        """POST ``payload`` and return the decoded JSON answer, retrying transient failures."""
        return await self._request("POST", path, payload, timeout_s)

    async def get(self, path: str) -> Any:
        """GET ``path`` and return the decoded JSON answer, retrying transient failures."""
        return await self._request("GET", path, None, None)

    async def events(self, path: str, payload: Mapping[str, Any]) -> AsyncIterator[Any]:
        """POST ``payload`` and yield the decoded ``data:`` events of the server-sent stream.

        Failures before the first event are retried like :meth:`post`; a stream cut after
        events arrived raises ServerError (what was yielded stays with the caller). The
        timeout bounds the wait for each event, not the whole stream.
        """
        response = await self._request("STREAM", path, payload, None)
        try:
            async with asyncio.timeout(None) as deadline:
                lines = response.aiter_lines()
                while True:
                    deadline.reschedule(asyncio.get_running_loop().time() + self.timeout_s)
                    try:
                        line = await anext(lines)
                    except StopAsyncIteration:
                        return
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    yield json.loads(data)
        except (TimeoutError, httpx.TimeoutException):
            raise ServerError(f"POST {self.base_url}{path}: no event for {self.timeout_s:g}s") from None
        except httpx.TransportError as exc:
            raise ServerError(f"POST {self.base_url}{path}: stream cut ({describe(exc)})") from None
        except ValueError:
            raise RequestError(f"POST {self.base_url}{path}: invalid JSON in an event") from None
        finally:
            await response.aclose()

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()

    async def _request(
        self, method: str, path: str, payload: Mapping[str, Any] | None, timeout_s: float | None
    ) -> Any:
        """Attempt the request until it succeeds, fails for good, or the budget is spent."""
        policy = self.retry
        deadline = time.monotonic() + policy.budget_s
        errors: list[str] = []
        for attempt in range(policy.max_retries + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                return await self._attempt(method, path, payload, min(timeout_s or self.timeout_s, left))
            except _Retryable as exc:
                errors.append(str(exc))
            if attempt < policy.max_retries:
                wait = min(policy.delay(attempt), deadline - time.monotonic())
                if wait <= 0:
                    break
                await asyncio.sleep(wait)
        last = errors[-1] if errors else "no time left"
        raise ServerError(f"{method} {self.base_url}{path} failed {len(errors)} time(s); last: {last}")

    async def _attempt(
        self, method: str, path: str, payload: Mapping[str, Any] | None, timeout_s: float
    ) -> Any:
        """One attempt under a hard deadline; transient failures become ``_Retryable``."""
        try:
            async with asyncio.timeout(timeout_s):
                if method == "STREAM":  # headers only; the caller reads the body
                    request = self._client.build_request("POST", path, json=payload, timeout=timeout_s)
                    response = await self._client.send(request, stream=True)
                    if response.status_code < 400:
                        return response
                    await response.aread()
                else:
                    response = await self._client.request(method, path, json=payload, timeout=timeout_s)
        except (TimeoutError, httpx.TimeoutException):
            raise _Retryable(f"timed out after {timeout_s:.3g}s") from None
        except httpx.TransportError as exc:
            raise _Retryable(f"{type(exc).__name__}: {str(exc) or 'connection failed'}") from None
        if response.status_code in _RETRY_STATUS:
            raise _Retryable(f"HTTP {response.status_code}: {error_message(response)}")
        if response.status_code >= 400:
            raise RequestError(
                f"{method} {self.base_url}{path}: HTTP {response.status_code}: {error_message(response)}"
            )
        try:
            return response.json()
        except ValueError:
            if response.headers.get("content-type", "").startswith("application/json"):
                raise RequestError(f"{method} {self.base_url}{path}: invalid JSON in the answer") from None
            return response.text


def present(value: T | None, message: str) -> T:
    """``value`` if the server sent it, else RequestError(message)."""
    if value is None:
        raise RequestError(message)
    return value


def require(condition: bool, message: str) -> None:
    """Raise RequestError(message) when a server's answer lacks what the engine needs."""
    if not condition:
        raise RequestError(message)


def finish(
    token_ids: list[int],
    logprobs: list[float],
    reason: str | None,
    stop_ids: frozenset[int],
    info: dict[str, Any],
    *,
    eos_known: bool = True,
) -> Generation:
    """A Generation from parsed server output: cut after the first stop id, map the finish reason.

    A server that ignores per-request stop ids may sample past one; everything after the
    first stop id is dropped (what follows it was never part of the sample the caller asked
    for). ``info["stop_token_missing"]`` is set when the server says it stopped but the last
    token is not a known stop id (a stop string, or a server that drops eos from its output);
    only when ``eos_known``, i.e. ``stop_ids`` holds the model's eos ids.
    """
    require(len(token_ids) == len(logprobs), f"{len(token_ids)} token ids but {len(logprobs)} logprobs")
    cut = next((i + 1 for i, t in enumerate(token_ids) if t in stop_ids), None)
    if cut is not None:
        return Generation(token_ids[:cut], logprobs[:cut], "stop", info)
    mapped: FinishReason = "length" if reason == "length" else "stop" if reason == "stop" else "abort"
    if mapped == "stop" and eos_known:
        info["stop_token_missing"] = True
    return Generation(token_ids, logprobs, mapped, info)
