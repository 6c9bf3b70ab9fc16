"""A loopback OpenAI-compatible ``/v1/completions`` server that fails on purpose.

It answers in vLLM's dialect (``choices[0].token_ids``, ``logprobs.token_logprobs``) with the
token ids a reply function gives for each prompt, and injects one kind of fault into a share of
the requests: HTTP 5xx, a hang, a closed connection, malformed JSON, token ids outside the
vocabulary, or the whole server dying after some requests. A plain asyncio server, so every
fault is exact (no framework in between retries, buffers or repairs anything)::

    async with FaultServer(reply, Fault("5xx", rate=0.3)) as server:
        engine = OpenAIEngine(server.url, max_retries=3)
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

FaultKind = Literal["none", "5xx", "hang", "close", "malformed", "oov", "die"]
FAULT_KINDS: tuple[FaultKind, ...] = ("none", "5xx", "hang", "close", "malformed", "oov", "die")

ReplyFn = Callable[[list[int]], list[int]]
"""The sampled token ids for a prompt (eos included when the reply should stop)."""


@dataclass(frozen=True)
class Fault:
    """Which fault, on which requests.

    ``rate``: the share of requests hit (drawn with ``seed``, the same on every run); ``after``:
    requests answered normally first. ``die`` ignores ``rate``: after ``after`` requests the
    server closes its socket and every open connection, and accepts none again.
    """

    kind: FaultKind = "none"
    rate: float = 1.0
    after: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {self.kind!r} (known: {', '.join(FAULT_KINDS)})")
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"fault rate must be within [0, 1], got {self.rate}")


class FaultServer:
    """Serves ``POST /v1/completions`` on 127.0.0.1 with ``fault`` injected; counts what it did."""

    def __init__(
        self,
        reply: ReplyFn,
        fault: Fault = Fault(),
        *,
        logprob: float = -0.5,
        oov_id: int = 10**9,
        delay_s: float = 0.0,
    ) -> None:
        """``delay_s``: seconds before each answer (a model that takes time)."""
        self._reply = reply
        self._delay_s = delay_s
        self.fault = fault
        self._logprob = logprob
        self._oov_id = oov_id
        self._rng = random.Random(fault.seed)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._stop = asyncio.Event()
        self.holding = False  # True: no answer at all (a server that stopped responding) until False
        self.requests = 0  # completion requests received
        self.faults = 0  # of them, answered with the fault
        self.port = 0

    @property
    def url(self) -> str:
        """The server root, for an engine's ``base_url``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def dead(self) -> bool:
        """Whether the server died (``die``) or was stopped."""
        return self._server is None

    async def start(self) -> FaultServer:
        """Listen on a free loopback port."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Stop listening, release hung requests, close every connection."""
        self._stop.set()
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._writers):
            writer.close()
        if server is not None:
            await server.wait_closed()

    async def __aenter__(self) -> FaultServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: requests until the client or the server closes it."""
        self._writers.add(writer)
        try:
            while not self._stop.is_set():
                request = await _read_request(reader)
                if request is None:
                    return
                if not await self._answer(request, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(self, request: tuple[str, bytes], writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection must close."""
        path, body = request
        if path != "/v1/completions":
            await _send(writer, 404, {"error": {"message": f"no route {path}"}})
            return True
        self.requests += 1
        kind = self._fault_now()
        if kind == "die":
            asyncio.get_running_loop().create_task(self.stop())
            return False
        if kind != "none":
            self.faults += 1
        if kind == "5xx":
            await _send(writer, 503, {"error": {"message": "injected: service unavailable"}})
            return True
        if kind == "hang":
            await self._stop.wait()
            return False
        if kind == "close":
            return False
        if kind == "malformed":
            await _send_raw(writer, 200, b'{"choices": [{"token_ids": [1, 2,')
            return True
        if self._delay_s:
            await asyncio.sleep(self._delay_s)
        if self.holding:  # what was asked while holding is never answered
            await self._stop.wait()
            return False
        payload = json.loads(body or b"{}")
        prompt = [int(t) for t in payload.get("prompt") or []]
        full = self._reply(prompt)
        ids = full[: int(payload.get("max_tokens") or len(full))]
        cut = len(ids) < len(full)
        if kind == "oov":
            ids = [*ids[:-1], self._oov_id]
        await _send(writer, 200, _completion(ids, self._logprob, cut))
        return True

    def _fault_now(self) -> FaultKind:
        """The fault for the request just counted ("none" when it is spared)."""
        fault = self.fault
        if fault.kind == "none" or self.requests <= fault.after:
            return "none"
        if fault.kind == "die":
            return "die"
        return fault.kind if self._rng.random() < fault.rate else "none"


def _completion(ids: Sequence[int], logprob: float, cut: bool) -> dict[str, Any]:
    return {
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "token_ids": list(ids),
                "logprobs": {"token_logprobs": [logprob] * len(ids)},
                "finish_reason": "length" if cut else "stop",
            }
        ],
        "usage": {"completion_tokens": len(ids)},
    }


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, bytes] | None:
    """(path, body) of the next HTTP/1.1 request, or None at end of stream."""
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return None
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    body = await reader.readexactly(length) if length else b""
    return (parts[1] if len(parts) > 1 else "/"), body


async def _send(writer: asyncio.StreamWriter, status: int, payload: dict[str, Any]) -> None:
    await _send_raw(writer, status, json.dumps(payload).encode())


async def _send_raw(writer: asyncio.StreamWriter, status: int, body: bytes) -> None:
    reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}.get(status, "Error")
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: keep-alive\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
