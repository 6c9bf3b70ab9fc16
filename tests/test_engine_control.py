"""abort_all and update_weights across engines: SGLang and OpenAI schemas (MockTransport),
the balancer's fan-out, and HFEngine loading a checkpoint folder."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from turnrl.engines.balancer import BalancedEngine
from turnrl.engines.hf import HFEngine
from turnrl.engines.managed import ManagedEngine
from turnrl.engines.openai import OpenAIEngine
from turnrl.engines.sglang import SGLangEngine
from turnrl.models import load_model
from turnrl.testing import until
from turnrl.types import EngineError, Generation, SamplingParams, WeightUpdatable

EOS = 151645
PROMPT = [151644, 872, 198, 9707]


def recording(answer: dict[str, Any]) -> tuple[httpx.MockTransport, list[dict[str, Any]]]:
    """A transport that always answers ``answer`` and the JSON bodies it received."""
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append({"path": request.url.path, **json.loads(request.content)})
        return httpx.Response(200, json=answer)

    return httpx.MockTransport(handler), seen


# ---- SGLang ----


class _SGLangAborts:
    """A server's /generate that holds each request until ``/abort_request`` names its rid, then
    answers finish "abort" with one token sampled; records every abort body. As SGLang does, it
    drops an abort whose rid it has not registered, which it does ``register_s`` after the
    request arrives (tokenizing it)."""

    def __init__(self, register_s: float = 0.0) -> None:
        self.held: dict[str, asyncio.Event] = {}
        self.aborts: list[dict[str, Any]] = []
        self.register_s = register_s

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/abort_request":
            self.aborts.append(body)
            if body.get("rid") in self.held:
                self.held[body["rid"]].set()
            return httpx.Response(200, json={})
        await asyncio.sleep(self.register_s)
        self.held[body["rid"]] = asyncio.Event()
        await self.held[body["rid"]].wait()
        meta = {"id": body["rid"], "finish_reason": {"type": "abort"}}
        meta["output_token_logprobs"] = [[-0.5, 9, None]]
        return httpx.Response(200, json={"text": "", "output_ids": [9], "meta_info": meta})


async def test_sglang_abort_all_aborts_this_clients_requests_by_rid() -> None:
    """Two clients share one server: ``abort_all`` names its own requests' rids (not SGLang's
    ``abort_all: true``, which would end the other client's too), each ends "abort" with the token
    sampled; the other client's request runs on until it is aborted in turn."""
    server = _SGLangAborts()
    transport = httpx.MockTransport(server)
    ours, theirs = (SGLangEngine("http://sglang:30000", transport=transport) for _ in range(2))
    mine = [asyncio.create_task(ours.generate(PROMPT, SamplingParams(max_tokens=8))) for _ in range(2)]
    other = asyncio.create_task(theirs.generate(PROMPT, SamplingParams(max_tokens=8)))
    await until(lambda: len(server.held) == 3 and ours.in_flight == 2)
    await ours.abort_all()
    gens = await asyncio.wait_for(asyncio.gather(*mine), 5)
    assert all((g.token_ids, g.finish_reason) == ([9], "abort") for g in gens) and ours.in_flight == 0
    assert sorted(a["rid"] for a in server.aborts) == sorted(g.info["rid"] for g in gens)
    assert not other.done() and theirs.in_flight == 1
    await ours.abort_all()  # nothing of ours in flight: posts nothing
    assert len(server.aborts) == 2
    await theirs.abort_all()
    assert (await asyncio.wait_for(other, 5)).finish_reason == "abort"


async def test_sglang_abort_all_posts_again_an_abort_the_server_dropped() -> None:
    """An abort that reaches SGLang before the request is registered there is dropped: ``abort_all``
    posts it again until the request has returned, and returns only then."""
    server = _SGLangAborts(register_s=0.3)
    engine = SGLangEngine("http://sglang:30000", transport=httpx.MockTransport(server))
    task = asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_tokens=8)))
    await until(lambda: engine.in_flight == 1)
    await asyncio.wait_for(engine.abort_all(), 5)
    assert task.done() and task.result().finish_reason == "abort" and engine.in_flight == 0
    assert 2 <= len(server.aborts) <= 10  # the first ones dropped, about every 0.1 s after


@pytest.mark.parametrize("logprobs_field", [True, False])
async def test_sglang_aborted_generate_keeps_the_partial_tokens(logprobs_field: bool) -> None:
    triples = [[-0.25, 13048, None], [-0.5, 9707, None]] if logprobs_field else None
    meta: dict[str, Any] = {"id": "r", "finish_reason": {"type": "abort", "message": "Abort before prefill"}}
    if triples is not None:
        meta["output_token_logprobs"] = triples
    answer = {"text": "", "output_ids": [t[1] for t in triples or []], "meta_info": meta}
    transport, _ = recording(answer)
    engine = SGLangEngine("http://sglang:30000", eos_token_ids=[EOS], transport=transport)
    gen = await engine.generate(PROMPT, SamplingParams(max_tokens=8))
    assert gen.finish_reason == "abort"
    if logprobs_field:
        assert gen.token_ids == [13048, 9707] and gen.logprobs == [-0.25, -0.5]
    else:
        assert gen.token_ids == [] and gen.logprobs == []


async def test_sglang_update_weights_from_a_path() -> None:
    transport, seen = recording({"success": True, "message": "ok"})
    engine = SGLangEngine("http://sglang:30000", transport=transport)
    assert isinstance(engine, WeightUpdatable)
    assert await engine.update_weights(Path("/ckpt/step-1")) == 1
    assert await engine.update_weights("/ckpt/step-7", version=7) == 7
    assert engine.weight_version == 7
    assert seen == [
        {"path": "/update_weights_from_disk", "model_path": "/ckpt/step-1", "weight_version": "1"},
        {"path": "/update_weights_from_disk", "model_path": "/ckpt/step-7", "weight_version": "7"},
    ]
    with pytest.raises(EngineError, match="checkpoint path on the server's disk, not a state dict"):
        await engine.update_weights({"w": torch.zeros(1)})
    assert len(seen) == 2


# ---- OpenAI-compatible ----


async def test_openai_sglang_dialect_updates_weights() -> None:
    transport, seen = recording({"success": True, "message": "ok"})
    engine = OpenAIEngine("http://sglang:30000/v1", dialect="sglang", transport=transport)
    assert await engine.update_weights("/ckpt/step-3", version=3) == 3
    assert seen == [
        {"path": "/update_weights_from_disk", "model_path": "/ckpt/step-3", "weight_version": "3"}
    ]


@pytest.mark.parametrize("dialect", ["vllm", "llamacpp"])
async def test_servers_without_a_weight_endpoint_refuse(dialect: Any) -> None:
    transport, seen = recording({})
    engine = OpenAIEngine("http://srv:8000", dialect=dialect, transport=transport)
    with pytest.raises(EngineError, match=f"the {dialect} server .* has no weight-update endpoint: restart"):
        await engine.update_weights("/ckpt/step-1")
    assert seen == [] and engine.weight_version == 0


async def test_openai_abort_all_cancels_requests_in_flight() -> None:
    arrived: list[httpx.Request] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        arrived.append(request)
        await asyncio.Event().wait()  # never answers: only cancellation ends it
        raise AssertionError("unreachable")

    engine = OpenAIEngine("http://srv:8000", transport=httpx.MockTransport(handler), timeout_s=60)
    calls = [asyncio.create_task(engine.generate(PROMPT, SamplingParams())) for _ in range(3)]
    await until(lambda: len(arrived) == 3, what="three requests at the server")
    await engine.abort_all()
    gens = await asyncio.wait_for(asyncio.gather(*calls), 10)  # the abort ends them, not the 60 s timeout
    assert all((g.token_ids, g.logprobs, g.finish_reason) == ([], [], "abort") for g in gens)
    await engine.abort_all()  # nothing in flight: a no-op
    await engine.close()


async def test_openai_cancelling_the_caller_still_cancels() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    engine = OpenAIEngine("http://srv:8000", transport=httpx.MockTransport(handler), timeout_s=60)
    call = asyncio.create_task(engine.generate(PROMPT, SamplingParams()))
    await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await engine.close()


# ---- BalancedEngine fan-out ----


class ControlledEngine:
    """Records abort_all and update_weights calls; ``fail`` makes update_weights raise."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.aborts = 0
        self.updates: list[tuple[Any, int | None]] = []

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[Any] = (),
        *,
        session: str | None = None,
    ) -> Generation:
        return Generation([1], [-0.1], "stop")

    async def abort_all(self) -> None:
        self.aborts += 1

    async def update_weights(self, weights: Any, *, version: int | None = None) -> int:
        if self.fail:
            raise EngineError("disk full")
        self.updates.append((weights, version))
        return version or 0

    async def follow_weights(self, version: int) -> None:
        if self.fail:
            raise EngineError(f"serves weight version 0, not {version}")
        self.updates.append((None, version))

    async def close(self) -> None:
        pass


async def test_balancer_fans_out_abort_all_and_update_weights() -> None:
    engines = [ControlledEngine(), ControlledEngine(), ControlledEngine()]
    balancer = BalancedEngine(engines, names=["a", "b", "c"])
    await balancer.abort_all()
    assert [e.aborts for e in engines] == [1, 1, 1]
    balancer.stats[2].down_until = time.monotonic() + 60  # down: left out of the update
    assert await balancer.update_weights("/ckpt/1") == 1
    assert await balancer.update_weights("/ckpt/5", version=5) == 5
    assert [e.updates for e in engines] == [[("/ckpt/1", 1), ("/ckpt/5", 5)]] * 2 + [[]]
    assert [s.weight_version for s in balancer.stats] == [5, 5, None]
    assert balancer.weight_version == 5


async def test_balancer_reports_a_failed_update_and_needs_abort_all() -> None:
    good, bad = ControlledEngine(), ControlledEngine(fail=True)
    balancer = BalancedEngine([good, bad], names=["good", "bad"])
    with pytest.raises(EngineError, match=r"update_weights failed on 1 engine.*bad: EngineError: disk full"):
        await balancer.update_weights("/ckpt/1")
    assert good.updates == [("/ckpt/1", 1)] and balancer.weight_version == 0

    plain = ControlledEngine()
    plain.abort_all = None  # type: ignore[assignment,method-assign]
    with pytest.raises(TypeError, match="cannot abort generations in flight on y"):
        await BalancedEngine([ControlledEngine(), plain], names=["x", "y"]).abort_all()


async def test_balancer_follows_a_version_another_process_loaded_on_every_healthy_engine() -> None:
    """Another training rank updated the shared servers: every healthy engine takes up the version
    (each checks its server reports it); one that does not is named, the version stays put."""
    engines = [ControlledEngine(), ControlledEngine(), ControlledEngine()]
    balancer = BalancedEngine(engines, names=["a", "b", "c"])
    balancer.stats[2].down_until = time.monotonic() + 60
    await ManagedEngine(balancer, []).follow_weights(3)  # what a server-managing wrapper forwards
    assert [e.updates for e in engines] == [[(None, 3)]] * 2 + [[]]
    assert balancer.weight_version == 3 and [s.weight_version for s in balancer.stats] == [3, 3, None]
    lagging = BalancedEngine([ControlledEngine(), ControlledEngine(fail=True)], names=["x", "y"])
    with pytest.raises(
        EngineError, match=r"follow_weights failed on 1 engine.*y: EngineError: serves weight"
    ):
        await lagging.follow_weights(4)
    assert lagging.weight_version == 0
    plain = ControlledEngine()
    plain.follow_weights = None  # type: ignore[assignment,method-assign]
    with pytest.raises(TypeError, match="ControlledEngine cannot take up weights another process loaded"):
        await BalancedEngine([plain]).follow_weights(1)


# ---- HFEngine from a checkpoint folder ----


async def test_hf_update_weights_from_a_checkpoint_folder(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    model = load_model(str(tiny_qwen3_dir))
    perturbed = load_model(str(tiny_qwen3_dir))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    perturbed.save_pretrained(tmp_path / "ckpt")
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompt = list(range(400, 430))
    async with HFEngine(model) as eng, HFEngine(perturbed) as ref:
        before = await eng.generate(prompt, greedy)
        assert await eng.update_weights(tmp_path / "ckpt") == 1
        assert await eng.update_weights(str(tmp_path / "ckpt"), version=4) == 4
        after = await eng.generate(prompt, greedy)
        expected = await ref.generate(prompt, greedy)
    assert eng.weight_version == 4 and after.info is not None and after.info["weight_versions"] == [4, 4]
    assert after.token_ids != before.token_ids and after.token_ids == expected.token_ids
    torch.testing.assert_close(
        torch.tensor(after.logprobs), torch.tensor(expected.logprobs), atol=1e-5, rtol=0
    )
    head: Any = model.get_output_embeddings()
    embed: Any = model.get_input_embeddings()
    assert head.weight.data_ptr() == embed.weight.data_ptr()  # still tied


async def test_hf_update_weights_from_a_folder_without_weights(tiny_qwen3_model: Any, tmp_path: Path) -> None:
    async with HFEngine(tiny_qwen3_model) as eng:
        with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
            await eng.update_weights(tmp_path)
        assert eng.weight_version == 0
