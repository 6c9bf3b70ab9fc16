"""slime's side of the slime tests: its ``Sample`` (the real class when slime is importable), and a
loopback HTTP server speaking SGLang's native ``/generate`` whose generations come from a turnrl
engine (SGLang itself has no CPU build).

The server answers with SGLang's schema: ``output_ids``, ``meta_info.output_token_logprobs`` as
[logprob, id, text], ``meta_info.finish_reason`` as {"type": stop | length | abort},
``meta_info.weight_version``; ``/abort_request`` (by ``rid`` or ``abort_all``) aborts everything
in flight on its engine (a superset of what SGLang aborts for a rid: enough for these tests).
slime is not on PyPI: without it, ``ContractSample`` has the same fields and ``Status`` enum as
slime's ``slime/utils/types.py`` declares them.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from turnrl.types import SamplingParams


@dataclass
class ContractSample:
    """slime's Sample contract (``slime.utils.types.Sample``), for machines without slime."""

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    session_id: str | None = None


try:
    from slime.utils.types import Sample
except ImportError:
    Sample = ContractSample  # type: ignore[misc,assignment]


class _Server(http.server.ThreadingHTTPServer):
    request_queue_size = 64  # not 5: a burst of connections would wait out TCP's 1 s SYN retry


class SGLangServer:
    """SGLang's /generate and /abort_request on 127.0.0.1, served by a turnrl engine (the embedded
    one, or a real vLLM server through ``VLLMServerEngine``)."""

    def __init__(self, engine: Any, tokenizer: Any, weight_version: str = "7") -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.weight_version = weight_version
        self.requests: list[dict[str, Any]] = []
        self.received = threading.Event()  # set when a /generate arrives
        self.register_s = 0.0  # how long a request takes to reach the engine (SGLang tokenizes it)
        self.registered: set[str] = set()  # rids of the requests the engine has
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._loop_thread.start()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                answer = server.answer(self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self._http_thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._http_thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def answer(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if path == "/abort_request":
            if body.get("abort_all") or body.get("rid") in self.registered:  # SGLang drops others
                self.run(self.engine.abort_all())
            return {"success": True}
        assert path == "/generate" and body["return_logprob"] is True
        self.requests.append(body)
        self.received.set()
        p = body["sampling_params"]
        sampling = SamplingParams(
            temperature=p["temperature"],
            top_p=p["top_p"],
            top_k=max(p["top_k"], 0),
            max_tokens=p["max_new_tokens"],
            stop_token_ids=tuple(p.get("stop_token_ids") or ()),
            seed=p.get("sampling_seed"),
        )
        images = body.get("image_data") or []  # data URLs, what SGLang takes
        time.sleep(self.register_s)  # an abort meanwhile misses this request, as on SGLang
        self.registered.add(body["rid"])
        try:
            gen = self.run(self.engine.generate(body["input_ids"], sampling, images))
        finally:
            self.registered.discard(body["rid"])
        if gen.finish_reason == "stop":
            finish: dict[str, Any] = {"type": "stop", "matched": gen.token_ids[-1]}
        elif gen.finish_reason == "length":
            finish = {"type": "length", "length": len(gen.token_ids)}
        else:
            finish = {"type": "abort", "message": "Abort before prefill"}
        return {
            "text": self.tokenizer.decode(gen.token_ids),
            "output_ids": gen.token_ids,
            "meta_info": {
                "id": body["rid"],
                "finish_reason": finish,
                "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(gen.token_ids),
                "output_token_logprobs": [
                    [lp, t, None] for lp, t in zip(gen.logprobs, gen.token_ids, strict=True)
                ],
                "weight_version": self.weight_version,
            },
        }

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.run(self.engine.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join()
        self.loop.close()


def slime_sampling(
    max_new_tokens: int, seed: int | None = 11, stop: list[int] | None = None
) -> dict[str, Any]:
    """The sampling params slime's GenerateState hands to a generate function."""
    params: dict[str, Any] = {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": max_new_tokens,
        "stop": None,
        "stop_token_ids": stop,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    if seed is not None:
        params["sampling_seed"] = seed
    return params
