"""Server engines: request/response schemas, faults, and a real llama.cpp server on loopback.

vLLM and SGLang need a GPU, so their adapters are checked against the request and response
JSON their docs describe, through httpx.MockTransport. llama.cpp's ``llama-server`` runs
for real (built by scripts/install_server.sh): those tests skip when it is not installed,
and fail instead when ``CI`` is set.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from parts import await_part, missing
from reference import chat_prompt, max_diff, reference_logprobs

from turnrl.engines.http import RequestError, ServerError
from turnrl.engines.openai import OpenAIEngine, completion_payload
from turnrl.engines.sglang import SGLangEngine
from turnrl.rollout.spec import RolloutSpec
from turnrl.testing import until
from turnrl.types import SamplingParams

EOS = 151645  # <|im_end|>
EOT = 151643  # <|endoftext|>
PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]

Handler = Callable[[httpx.Request], httpx.Response]


def mock(handler: Handler) -> tuple[httpx.MockTransport, list[dict[str, Any]]]:
    """A transport answering with ``handler`` and the JSON bodies it received."""
    seen: list[dict[str, Any]] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append({"path": request.url.path, **(json.loads(request.content) if request.content else {})})
        return handler(request)

    return httpx.MockTransport(record), seen


def vllm_answer(**choice: Any) -> dict[str, Any]:
    """A vLLM /v1/completions answer (vLLM >= 0.10.2, return_token_ids)."""
    base = {
        "index": 0,
        "text": "Hi",
        "logprobs": {
            "text_offset": [0, 2],
            "token_logprobs": [-0.25, -0.5],
            "tokens": ["token_id:13048", f"token_id:{EOS}"],
            "top_logprobs": None,
        },
        "finish_reason": "stop",
        "stop_reason": None,
        "token_ids": [13048, EOS],
        "prompt_token_ids": PROMPT,
    }
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": "m",
        "choices": [base | choice],
        "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": 2, "total_tokens": len(PROMPT) + 2},
    }


def sglang_answer(finish: dict[str, Any], triples: list[list[Any]] | None = None) -> dict[str, Any]:
    """An SGLang native /generate answer with return_logprob."""
    triples = triples if triples is not None else [[-0.25, 13048, None], [-0.5, EOS, None]]
    return {
        "text": "Hi",
        "output_ids": [t[1] for t in triples],
        "meta_info": {
            "id": "rid-1",
            "finish_reason": finish,
            "prompt_tokens": len(PROMPT),
            "completion_tokens": len(triples),
            "cached_tokens": 0,
            "weight_version": "v3",
            "output_token_logprobs": triples,
            "e2e_latency": 0.01,
        },
    }


def answer_with(body: Any, status: int = 200) -> Handler:
    return lambda request: httpx.Response(status, json=body)


# ---- vLLM and SGLang's OpenAI endpoint (schema, MockTransport) ----


async def test_vllm_request_sends_ids_and_asks_for_ids_and_logprobs() -> None:
    transport, seen = mock(answer_with(vllm_answer()))
    engine = OpenAIEngine(
        "http://vllm:8000/v1", "qwen", dialect="vllm", eos_token_ids=[EOS], transport=transport
    )
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_tokens=5, stop_token_ids=(42,), seed=3)
    gen = await engine.generate(PROMPT, sampling)
    body = seen[0]
    assert body["path"] == "/v1/completions"
    assert body["prompt"] == PROMPT and body["model"] == "qwen"
    assert body["max_tokens"] == 5 and body["temperature"] == 0.7 and body["top_p"] == 0.9
    assert body["top_k"] == -1 and body["seed"] == 3 and body["stop_token_ids"] == [42]
    assert body["logprobs"] == 0 and body["return_token_ids"] is True
    assert body["return_tokens_as_token_ids"] is True and body["stream"] is False
    assert gen.token_ids == [13048, EOS] and gen.logprobs == [-0.25, -0.5]
    assert gen.finish_reason == "stop" and gen.info is not None and "stop_token_missing" not in gen.info
    await engine.close()


async def test_vllm_ids_from_token_id_strings_when_token_ids_are_absent() -> None:
    answer = vllm_answer(finish_reason="length")
    del answer["choices"][0]["token_ids"]
    transport, _ = mock(answer_with(answer))
    engine = OpenAIEngine("http://vllm:8000", dialect="vllm", transport=transport)
    gen = await engine.generate(PROMPT, SamplingParams(max_tokens=2))
    assert gen.token_ids == [13048, EOS] and gen.finish_reason == "length"
    await engine.close()


async def test_a_server_without_token_ids_is_a_clear_error() -> None:
    answer = vllm_answer()
    del answer["choices"][0]["token_ids"]
    answer["choices"][0]["logprobs"]["tokens"] = ["Hi", ""]
    transport, _ = mock(answer_with(answer))
    engine = OpenAIEngine("http://sglang:30000", dialect="sglang", transport=transport)
    with pytest.raises(RequestError, match="no token ids"):
        await engine.generate(PROMPT, SamplingParams())


async def test_sglang_openai_dialect() -> None:
    answer = vllm_answer(matched_stop=EOS) | {"metadata": {"weight_version": "v7"}}
    transport, seen = mock(answer_with(answer))
    engine = OpenAIEngine(
        "http://sglang:30000", "m", dialect="sglang", eos_token_ids=[EOS], transport=transport
    )
    gen = await engine.generate(PROMPT, SamplingParams(top_k=20, seed=1))
    body = seen[0]
    assert body["return_token_ids"] is True and body["logprobs"] == 1 and body["top_k"] == 20
    assert "return_tokens_as_token_ids" not in body and body["seed"] == 1
    assert gen.token_ids == [13048, EOS] and gen.info is not None
    assert gen.info["weight_versions"] == ["v7", "v7"] and gen.info["matched_stop"] == EOS


async def test_stop_without_a_stop_token_is_flagged() -> None:
    answer = vllm_answer(token_ids=[13048, 9707])
    transport, _ = mock(answer_with(answer))
    engine = OpenAIEngine("http://vllm:8000", dialect="vllm", eos_token_ids=[EOS], transport=transport)
    gen = await engine.generate(PROMPT, SamplingParams())
    assert gen.finish_reason == "stop" and gen.info is not None and gen.info["stop_token_missing"] is True


def test_llamacpp_payload_turns_off_hidden_samplers() -> None:
    body = completion_payload("llamacpp", PROMPT, SamplingParams(temperature=1.0, max_tokens=4), None)
    assert body["prompt"] == PROMPT and body["min_p"] == 0.0 and body["top_k"] == 0 and body["logprobs"] == 1
    assert body["post_sampling_probs"] is False and "model" not in body
    hot = completion_payload("llamacpp", PROMPT, SamplingParams(temperature=0.7), None)
    assert hot["post_sampling_probs"] is True
    greedy = completion_payload("llamacpp", PROMPT, SamplingParams(temperature=0.0), None)
    assert greedy["post_sampling_probs"] is False and greedy["temperature"] == 0.0


def llamacpp_answer(entries: list[dict[str, Any]], finish: str = "stop") -> dict[str, Any]:
    """A llama-server /v1/completions answer with logprobs.content."""
    choice = {"text": "", "index": 0, "logprobs": {"content": entries}, "finish_reason": finish}
    return {"choices": [choice], "object": "text_completion", "usage": {"prompt_tokens": 9}}


async def test_llamacpp_cuts_after_a_stop_token_the_server_does_not_know() -> None:
    entries = [
        {"id": t, "token": "x", "bytes": [], "logprob": -1.0 - i} for i, t in enumerate([5, 42, 6, EOS])
    ]
    transport, _ = mock(answer_with(llamacpp_answer(entries)))
    engine = OpenAIEngine("http://llama:8080", dialect="llamacpp", eos_token_ids=[EOS], transport=transport)
    gen = await engine.generate(PROMPT, SamplingParams(stop_token_ids=(42,)))
    assert gen.token_ids == [5, 42] and gen.logprobs == [-1.0, -2.0] and gen.finish_reason == "stop"


async def test_llamacpp_post_sampling_probabilities_become_logprobs() -> None:
    entries = [
        {"id": 5, "token": "x", "bytes": [], "prob": 0.25},
        {"id": 6, "token": "y", "bytes": [], "prob": 0.5},
    ]
    transport, _ = mock(answer_with(llamacpp_answer(entries, "length")))
    engine = OpenAIEngine("http://llama:8080", dialect="llamacpp", transport=transport)
    gen = await engine.generate(PROMPT, SamplingParams(temperature=0.5, top_k=10, max_tokens=2))
    assert gen.logprobs == [math.log(0.25), math.log(0.5)] and gen.finish_reason == "length"
    assert gen.info is not None and gen.info["logprobs_after_filter"] is True


@pytest.mark.parametrize(
    "body", [{"choices": []}, {"choices": [{"logprobs": {"content": [{"ids": 1}]}}]}, []]
)
async def test_a_malformed_answer_is_a_request_error(body: Any) -> None:
    transport, _ = mock(answer_with(body))
    engine = OpenAIEngine("http://llama:8080", dialect="llamacpp", transport=transport)
    with pytest.raises(RequestError, match=r"no choices|malformed"):
        await engine.generate(PROMPT, SamplingParams())


# ---- SGLang native /generate (schema, MockTransport) ----


class _HangingStream(httpx.AsyncByteStream):
    """Server-sent events, then a stream that stays open (a server still generating)."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self.events:
            yield f"data: {json.dumps(event)}\n\n".encode()
        await asyncio.Event().wait()  # until the client closes the stream


def _event(ids: list[int], finish: str | None) -> dict[str, Any]:
    """One streamed /v1/completions event."""
    logprobs = {"token_logprobs": [-0.5] * len(ids)}
    return {"choices": [{"index": 0, "token_ids": ids, "logprobs": logprobs, "finish_reason": finish}]}


async def test_vllm_abort_closes_this_clients_streams_keeping_what_arrived() -> None:
    """``abort_all`` ends a turn mid-way with the tokens received (finish "abort"); a turn whose
    final event came before the abort (its stream not yet closed) keeps its finish ("length": an
    abort would have the rollout sample past ``max_tokens``)."""
    from turnrl.engines.vllm import VLLMServerEngine

    def handler(request: httpx.Request) -> httpx.Response:
        done = json.loads(request.content)["max_tokens"] == 2
        events = [_event([13048], None), _event([12], "length")] if done else [_event([13048, 11], None)]
        return httpx.Response(200, stream=_HangingStream(events))

    engine = VLLMServerEngine("http://vllm", eos_token_ids=[EOS], transport=httpx.MockTransport(handler))
    cut = asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_tokens=50)))
    whole = asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_tokens=2)))
    await until(lambda: engine.tokens_received == 4, 10, "both streams under way")
    await engine.abort_all()
    partial, finished = await asyncio.wait_for(asyncio.gather(cut, whole), 10)
    assert (partial.token_ids, partial.finish_reason) == ([13048, 11], "abort")
    assert partial.logprobs == [-0.5, -0.5]
    assert (finished.token_ids, finished.finish_reason) == ([13048, 12], "length")
    assert engine.in_flight == 0
    await engine.close()


async def test_vllm_in_flight_updates_freeze_turns_and_stamp_tokens_by_the_servers_spans(
    tmp_path: Any,
) -> None:
    """``keep_in_flight``: turns stream the token-in generate endpoint; an update pauses with
    ``mode=keep`` and leaves the prefix cache alone; each token's version comes from the server's
    spans, where a label this engine did not set (the start-up weights') is the version the turn
    began under; an aborted turn (no spans) keeps that version for all its tokens."""
    from turnrl.engines.vllm import VLLMServerEngine

    posted: list[str] = []
    spans = [{"version": "default", "start": 0, "end": 1}, {"version": "1", "start": 1, "end": 3}]

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/inference/v1/generate":
            posted.append(str(request.url.raw_path.decode()))
            return httpx.Response(200, json={})
        body = json.loads(request.content)
        assert body["token_ids"] == PROMPT and "content_parts" not in body and body["stream"] is True
        if body["sampling_params"]["max_tokens"] == 50:  # a turn still generating when aborted
            return httpx.Response(200, stream=_HangingStream([_event([5, 6], None)]))
        last = _event([7], "length")
        last["choices"][0]["weight_versions"] = spans  # the server's last event of a turn
        events = "".join(f"data: {json.dumps(e)}\n\n" for e in (_event([5, 6], None), last))
        return httpx.Response(200, content=events.encode(), headers={"content-type": "text/event-stream"})

    engine = VLLMServerEngine("http://vllm", keep_in_flight=True, transport=httpx.MockTransport(handler))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert await engine.update_weights(tmp_path) == 1
    assert posted[0] == "/pause?mode=keep" and "/reset_prefix_cache" not in posted and posted[-1] == "/resume"
    gen = await engine.generate(PROMPT, SamplingParams(max_tokens=3))
    assert gen.token_ids == [5, 6, 7] and gen.finish_reason == "length" and gen.versions == [1, 1, 1]
    engine._version = 0  # as if the turn had begun before the update: "default" is then version 0
    gen = await engine.generate(PROMPT, SamplingParams(max_tokens=3))
    assert gen.versions == [0, 1, 1]
    engine._version = 1
    cut = asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_tokens=50)))
    await until(lambda: engine.in_flight == 1 and engine.tokens_received == 8, 10, "the turn under way")
    await engine.abort_all()
    partial = await asyncio.wait_for(cut, 10)
    assert partial.finish_reason == "abort" and partial.versions == [1, 1]
    await engine.close()


def test_a_push_file_reads_back_exactly_and_the_next_push_rewrites_it_in_place(tmp_path: Path) -> None:
    """A push's weights file is what ``safetensors`` reads back exactly, as long as its own writer's
    (every dtype a policy has, a scalar, an empty tensor, a transposed one), each tensor aligned;
    the next push rewrites the same file (same inode: the pages stay) and a smaller one cuts it to
    its length; a dtype the format lacks is refused by name."""
    import torch
    from safetensors.torch import load_file, save_file

    from turnrl.engines.vllm import WEIGHTS_FILE, save_weights
    from turnrl.engines.weights import write_safetensors

    tensors = {
        "w": torch.randn(3, 5),
        "h": torch.randn(7).to(torch.bfloat16),
        "f": torch.randn(2, 2).to(torch.float16),
        "ids": torch.arange(4),
        "scale": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "mask": torch.tensor([True, False, True]),
        "t": torch.randn(4, 6).T,  # not contiguous
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "theirs.safetensors"))
    ours = write_safetensors(tensors, tmp_path / "ours.safetensors")
    back = load_file(str(ours))
    assert set(back) == set(tensors)
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in tensors.items())
    assert ours.stat().st_size == (tmp_path / "theirs.safetensors").stat().st_size
    raw = ours.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert all(header[k]["data_offsets"][0] % v.element_size() == 0 for k, v in tensors.items())  # aligned

    file = save_weights({"a": torch.zeros(64, 64), "b": torch.ones(8)}, tmp_path / "push") / WEIGHTS_FILE
    inode = file.stat().st_ino
    new = {"a": torch.randn(64, 64), "b": torch.randn(8)}
    save_weights(new, tmp_path / "push")
    assert file.stat().st_ino == inode and list(file.parent.iterdir()) == [file]
    assert all(torch.equal(load_file(str(file))[k], v) for k, v in new.items())
    save_weights({"b": torch.randn(8)}, tmp_path / "push")
    assert set(load_file(str(file))) == {"b"} and file.stat().st_size < 64 * 64 * 4
    with pytest.raises(ValueError, match=r"x: dtype torch\.complex64 has no safetensors name"):
        write_safetensors({"x": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "c.safetensors")


async def test_sglang_generate_request_and_response() -> None:
    transport, seen = mock(answer_with(sglang_answer({"type": "stop", "matched": EOS})))
    engine = SGLangEngine("http://sglang:30000", eos_token_ids=[EOS, EOT], transport=transport)
    sampling = SamplingParams(
        temperature=0.6, top_p=0.95, top_k=0, max_tokens=7, stop_token_ids=(42,), seed=9
    )
    images = ["data:image/png;base64,iVBORw0KGgo=", "https://example.invalid/cat.png"]
    gen = await engine.generate(PROMPT, sampling, images, rid="r1")
    body = seen[0]
    assert body["path"] == "/generate" and body["input_ids"] == PROMPT and body["rid"] == "r1"
    assert body["return_logprob"] is True and body["image_data"] == images and body["stream"] is False
    assert body["sampling_params"] == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": -1,
        "max_new_tokens": 7,
        "stop_token_ids": [42],
        "sampling_seed": 9,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    assert gen.token_ids == [13048, EOS] and gen.logprobs == [-0.25, -0.5] and gen.finish_reason == "stop"
    assert gen.info is not None and gen.info["weight_versions"] == ["v3", "v3"] and gen.info["rid"] == "r1"


@pytest.mark.parametrize(
    ("finish", "expected"),
    [({"type": "length", "length": 2}, "length"), ({"type": "abort", "message": "aborted by user"}, "abort")],
)
async def test_sglang_finish_reasons(finish: dict[str, Any], expected: str) -> None:
    triples = [[-0.25, 13048, None], [-0.5, 9707, None]]
    transport, _ = mock(answer_with(sglang_answer(finish, triples)))
    engine = SGLangEngine("http://sglang:30000", eos_token_ids=[EOS], transport=transport)
    gen = await engine.generate(PROMPT, SamplingParams(max_tokens=2))
    assert gen.finish_reason == expected and gen.token_ids == [13048, 9707]


async def test_sglang_abort_and_weight_update() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/abort_request":
            return httpx.Response(200, json={})
        ok = body["model_path"] == "/ckpt/step-10"
        return httpx.Response(200, json={"success": ok, "message": "ok" if ok else "no such path"})

    transport, seen = mock(handler)
    engine = SGLangEngine("http://sglang:30000", transport=transport)
    await engine.abort("r1")
    assert (await engine.update_weights_from_disk("/ckpt/step-10", weight_version="10"))["success"] is True
    with pytest.raises(RequestError, match="update_weights_from_disk failed: no such path"):
        await engine.update_weights_from_disk("/nope")
    assert seen[0] == {"path": "/abort_request", "rid": "r1"}
    assert seen[1] == {
        "path": "/update_weights_from_disk",
        "model_path": "/ckpt/step-10",
        "weight_version": "10",
    }


# ---- vLLM in-process (parsing without vllm; the engine itself needs vllm and a GPU) ----


def test_vllm_request_output_becomes_a_generation() -> None:
    from types import SimpleNamespace

    from turnrl.engines.vllm_inproc import to_generation

    step = [
        {13048: SimpleNamespace(logprob=-0.25)},
        {EOS: SimpleNamespace(logprob=-0.5), 9: SimpleNamespace(logprob=-3)},
    ]
    completion = SimpleNamespace(
        token_ids=[13048, EOS], logprobs=step, finish_reason="stop", stop_reason=None
    )
    gen = to_generation(SimpleNamespace(outputs=[completion]))
    assert gen.token_ids == [13048, EOS] and gen.logprobs == [-0.25, -0.5] and gen.finish_reason == "stop"


def test_vllm_engine_needs_vllm() -> None:
    import importlib.util

    from turnrl.engines.vllm_inproc import VLLMEngine
    from turnrl.types import EngineError

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed: this checks the error without it")
    with pytest.raises(EngineError, match="VLLMEngine needs vllm"):
        VLLMEngine("any-model")


def test_unknown_dialect_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown dialect 'tgi'"):
        OpenAIEngine("http://x", dialect="tgi")  # type: ignore[arg-type]


# ---- faults: retries, budgets, timeouts (MockTransport) ----


def fast_engine(transport: httpx.MockTransport, **kwargs: Any) -> OpenAIEngine:
    options: dict[str, Any] = {"timeout_s": 5.0, "max_retries": 3, "backoff_s": 0.01} | kwargs
    return OpenAIEngine("http://vllm:8000", dialect="vllm", transport=transport, **options)


async def test_5xx_and_connection_errors_are_retried() -> None:
    script: list[Any] = [httpx.ConnectError("refused"), httpx.Response(503, json={"error": "warming up"})]

    def handler(request: httpx.Request) -> httpx.Response:
        if script:
            step = script.pop(0)
            if isinstance(step, Exception):
                raise step
            return step
        return httpx.Response(200, json=vllm_answer())

    transport, seen = mock(handler)
    gen = await fast_engine(transport).generate(PROMPT, SamplingParams())
    assert len(seen) == 3 and gen.token_ids == [13048, EOS]


async def test_4xx_is_not_retried_and_carries_the_server_message() -> None:
    body = {"object": "error", "message": "This model's maximum context length is 4096 tokens", "code": 400}
    transport, seen = mock(answer_with(body, status=400))
    with pytest.raises(RequestError, match=r"HTTP 400: This model's maximum context length is 4096 tokens"):
        await fast_engine(transport).generate(PROMPT, SamplingParams())
    assert len(seen) == 1


async def test_retries_stop_at_the_count() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    transport, seen = mock(refuse)
    with pytest.raises(ServerError, match=r"failed 3 time\(s\); last: ConnectError: connection refused"):
        await fast_engine(transport, max_retries=2).generate(PROMPT, SamplingParams())
    assert len(seen) == 3


async def test_a_hanging_server_times_out_within_the_budget() -> None:
    async def hang(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)
        return httpx.Response(200, json=vllm_answer())

    seen: list[float] = []

    async def record(request: httpx.Request) -> httpx.Response:
        seen.append(time.monotonic())
        return await hang(request)

    engine = fast_engine(httpx.MockTransport(record), timeout_s=0.2, max_retries=10, retry_budget_s=0.5)
    start = time.monotonic()
    with pytest.raises(ServerError, match="timed out"):
        await engine.generate(PROMPT, SamplingParams())
    assert time.monotonic() - start < 1.5 and 2 <= len(seen) <= 4  # the budget, not the count, ended it


# ---- a real llama.cpp server on loopback ----


@pytest.fixture(scope="module")
def tiny_gguf() -> Path:
    """The tiny Qwen3 (the same weights as ``tiny_qwen3_dir``) as an f32 GGUF, cached with the model."""
    from turnrl.engines.servers import convert_to_gguf, find_convert_script, find_llama_server
    from turnrl.models import resolve_model

    await_part("install_server")
    if find_llama_server() is None or find_convert_script() is None:
        missing("llama-server not installed: run scripts/install_server.sh")
    return convert_to_gguf(resolve_model("tiny-qwen3").path)


@pytest.fixture(scope="module")
def llama_servers(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Any]]:
    """Two llama-server processes serving the tiny Qwen3 on 127.0.0.1."""
    from turnrl.engines.servers import LlamaServer

    logs = tmp_path_factory.mktemp("llama-logs")
    servers = [LlamaServer(tiny_gguf, parallel=8, log_path=logs / f"server{i}.log") for i in range(2)]
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
async def closing() -> AsyncIterator[list[Any]]:
    """Engines appended here are closed after the test, pass or fail."""
    engines: list[Any] = []
    yield engines
    for engine in engines:
        await engine.close()


def llama_engine(server: Any, closing: list[Any], **kwargs: Any) -> OpenAIEngine:
    """An OpenAIEngine in the llama.cpp dialect for one server, with the Qwen3 eos ids."""
    from turnrl.models import QWEN3_EOS_IDS

    options: dict[str, Any] = {"timeout_s": 60.0, "max_retries": 2, "backoff_s": 0.05} | kwargs
    engine = OpenAIEngine(server.url, dialect="llamacpp", eos_token_ids=QWEN3_EOS_IDS, **options)
    closing.append(engine)
    return engine


async def test_llamacpp_generates_ids_with_the_logprobs_of_a_forward_pass(
    llama_servers: list[Any], tiny_qwen3_model: Any, qwen3_tokenizer: Any, closing: list[Any]
) -> None:
    engine = llama_engine(llama_servers[0], closing)
    prompt = chat_prompt(qwen3_tokenizer, "Count to five.")
    greedy = await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8))
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == len(greedy.logprobs) == 8
    assert max_diff(greedy.logprobs, reference_logprobs(tiny_qwen3_model, prompt, greedy.token_ids)) < 5e-4
    hot = await engine.generate(prompt, SamplingParams(temperature=0.7, max_tokens=8, seed=5))
    expected = reference_logprobs(tiny_qwen3_model, prompt, hot.token_ids, temperature=0.7)
    assert max_diff(hot.logprobs, expected) < 5e-4  # post-sampling probabilities: softmax(logits / T)
    again = await engine.generate(prompt, SamplingParams(temperature=0.7, max_tokens=8, seed=5))
    assert again.token_ids == hot.token_ids  # a seeded request repeats


async def test_llamacpp_includes_the_eos_token_and_cuts_at_stop_ids(
    llama_servers: list[Any], tiny_qwen3_model: Any, qwen3_tokenizer: Any, closing: list[Any]
) -> None:
    prompt = chat_prompt(qwen3_tokenizer, "Say nothing.")
    forced = llama_engine(llama_servers[0], closing, extra_body={"logit_bias": [[EOS, 1000.0]]})
    gen = await forced.generate(prompt, SamplingParams(max_tokens=8))
    assert gen.token_ids == [EOS] and gen.finish_reason == "stop"  # the eos token is in the output
    assert gen.info is not None and "stop_token_missing" not in gen.info
    assert max_diff(gen.logprobs, reference_logprobs(tiny_qwen3_model, prompt, [EOS])) < 5e-4  # unbiased
    engine = llama_engine(llama_servers[0], closing)
    free = await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6))
    stop = free.token_ids[2]
    cut = await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(stop,)))
    assert cut.token_ids == free.token_ids[: free.token_ids.index(stop) + 1] and cut.finish_reason == "stop"


async def test_llamacpp_rejects_a_bad_request_without_retrying(
    llama_servers: list[Any], closing: list[Any]
) -> None:
    engine = llama_engine(llama_servers[0], closing)
    with pytest.raises(RequestError, match="HTTP 400"):
        await engine.generate([10**7], SamplingParams(max_tokens=2))


async def test_balancer_over_two_servers_places_by_load_and_sticks(
    llama_servers: list[Any], qwen3_tokenizer: Any, closing: list[Any]
) -> None:
    from turnrl.engines.balancer import BalancedEngine

    bal = BalancedEngine([llama_engine(s, closing) for s in llama_servers])
    prompt = chat_prompt(qwen3_tokenizer, "Hello")
    sampling = SamplingParams(max_tokens=3, seed=1)

    async def turn(session: str) -> str:
        gen = await bal.generate(prompt, sampling, session=session)
        assert gen.info is not None
        return str(gen.info["engine"])

    first = await asyncio.gather(*(turn(f"s{i}") for i in range(8)))
    assert sorted(first) == sorted([llama_servers[0].url] * 4 + [llama_servers[1].url] * 4)
    second = await asyncio.gather(*(turn(f"s{i}") for i in range(8)))
    assert second == first  # every session stayed on its server


async def test_killing_a_server_mid_rollout_loses_no_trajectory(
    llama_servers: list[Any], qwen3_tokenizer: Any, closing: list[Any]
) -> None:
    from turnrl.chat.encoder import ChatEncoder
    from turnrl.engines.balancer import BalancedEngine
    from turnrl.rollout.collector import collect
    from turnrl.testing import EchoEnv
    from turnrl.types import Limits, Sample, StopReason

    eos_likely = {"logit_bias": [[EOS, 14.0]]}  # short turns that end on eos (the logprobs stay unbiased)
    options: dict[str, Any] = {"timeout_s": 20.0, "retry_budget_s": 10.0, "extra_body": eos_likely}
    bal = BalancedEngine([llama_engine(s, closing, **options) for s in llama_servers], cooloff_s=600.0)
    spec = RolloutSpec(
        env_factory=functools.partial(EchoEnv, done_after=3),
        engine=bal,
        encoder=ChatEncoder(qwen3_tokenizer),
        sampling=SamplingParams(max_tokens=16, seed=0),
        limits=Limits(max_turns=4, env_timeout_s=5.0),
    )
    samples = [Sample(f"echo-{i}", [{"role": "user", "content": f"Story {i}, please."}]) for i in range(32)]
    run = asyncio.create_task(collect(samples, spec, concurrency=32))
    deadline = time.monotonic() + 60
    while (bal.stats[1].served < 8 or not bal.stats[1].in_flight) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    llama_servers[1].kill()
    killed_at, unfinished = sum(s.served for s in bal.stats), not run.done()
    try:
        trajs = await asyncio.wait_for(run, timeout=90)
    finally:
        llama_servers[1].start()  # back for any later test
    assert unfinished and killed_at < 32 * 2  # it died with work left
    assert sorted(t.id for t in trajs) == sorted(f"echo-{i}/0" for i in range(32))
    assert bal.stats[1].failures >= 1 and bal.healthy() == [True, False], bal.stats
    assert [t.error for t in trajs if t.stop_reason == StopReason.ENGINE_ERROR] == []  # retried on server 0
    assert {t.stop_reason for t in trajs} <= {StopReason.ENV_DONE, StopReason.LENGTH}  # LENGTH: no eos in 16
    assert sum(t.num_turns for t in trajs) > killed_at  # turns were generated after the kill
    assert all(len(t.response_ids) == len(t.loss_mask) == len(t.rollout_logprobs) for t in trajs)
