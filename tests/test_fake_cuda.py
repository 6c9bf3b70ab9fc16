"""The GPU path, checked on the CPU: the embedded engine, a training step and a VLM request run with
the model on a stand-in CUDA device (``turnrl.support.fake_cuda``) that fails on host/device mix-ups as a
GPU does, and give what they give on the CPU."""

from __future__ import annotations

import io
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from turnrl.app.training import build_run
from turnrl.engines.hf import HFEngine
from turnrl.engines.hf import sampling as sampling_module
from turnrl.engines.hf.graphs import row_bucket
from turnrl.env import register_env
from turnrl.models import load_model
from turnrl.rollout.loop import run_trajectory
from turnrl.support.fake_cuda import FAKE_CUDA, MixedDeviceError, fake_cuda, on_fake_cuda
from turnrl.testing import ParityEnv
from turnrl.train.config import TrainConfig
from turnrl.train.trainer import train_step
from turnrl.types import EngineError, SamplingParams

QUIET = Console(file=io.StringIO())
register_env("test_fake_cuda_parity", ParityEnv, ParityEnv.dataset)


def test_the_fake_device_fails_where_cuda_fails_and_passes_where_it_passes() -> None:
    with fake_cuda():
        x = torch.randn(2, 3, device="cuda")
        assert x.device == FAKE_CUDA and x.is_cuda and on_fake_cuda(x)
        assert (x * torch.tensor(2.0)).device == FAKE_CUDA  # a 0-dim CPU tensor is a scalar
        assert x[torch.tensor([1, 0])].device == FAKE_CUDA  # CPU indices into a device tensor
        with pytest.raises(MixedDeviceError, match="same device"):
            x + torch.ones(3)
        with pytest.raises(MixedDeviceError, match="same device"):
            torch.cat([x, torch.zeros(1, 3)])
        with pytest.raises(MixedDeviceError, match="indices"):
            torch.zeros(4)[torch.tensor([1], device="cuda")]
        with pytest.raises(TypeError, match="numpy"):
            x.numpy()
        assert torch.arange(3, device=x.device).device == FAKE_CUDA
        back = x.cpu()
        assert back.device.type == "cpu" and x.device == FAKE_CUDA and torch.equal(back, x.cpu())
        cpu = torch.ones(2, 3)
        moved = cpu.to("cuda")
        assert moved.device == FAKE_CUDA and cpu.device.type == "cpu"  # .to copies across devices
        layer = torch.nn.Linear(3, 2)
        weight = layer.weight
        layer.to("cuda")
        assert layer.weight is weight and weight.device == FAKE_CUDA  # parameters move in place
        layer(x).sum().backward()
        assert weight.grad is not None and weight.grad.device == FAKE_CUDA
        errors: list[BaseException] = []

        def in_a_thread() -> None:
            try:
                x + torch.ones(3)
            except MixedDeviceError as err:
                errors.append(err)

        thread = threading.Thread(target=in_a_thread)
        thread.start()
        thread.join()
        assert len(errors) == 1  # threads started within run under the mode too
    assert torch.ones(2).device.type == "cpu" and not torch.cuda.is_available()


def _old_draw_rows(logprobs_B_V: torch.Tensor, generators: Sequence[torch.Generator]) -> list[int]:
    """``_draw_rows`` as it was when it failed every request on CUDA: uniforms from the CPU
    generators and ``torch.arange`` without a device, used with the logits' tensors."""
    block = sampling_module._BLOCK
    w_B_V = torch.exp(logprobs_B_V)
    rows, vocab = w_B_V.shape
    full = vocab - vocab % block
    sums_B_N = w_B_V[:, :full].reshape(rows, -1, block).sum(-1, dtype=torch.float64)
    cdf_B_N = torch.cumsum(sums_B_N, -1)
    u_B = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    target_B1 = (u_B * cdf_B_N[:, -1])[:, None]
    block_B1 = torch.searchsorted(cdf_B_N, target_B1, right=True).clamp_(max=cdf_B_N.shape[1] - 1)
    ids_B_K = block_B1 * block + torch.arange(block)
    return ids_B_K[:, 0].tolist()


def test_the_guard_catches_the_sampling_bug_that_broke_cuda() -> None:
    logprobs = torch.log_softmax(torch.randn(3, 1024), -1)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    _old_draw_rows(logprobs, gens)  # fine on the CPU: that is how it went unnoticed
    expected = sampling_module._draw_rows(logprobs, [torch.Generator().manual_seed(i) for i in range(3)])
    with fake_cuda():
        on_device = logprobs.to("cuda")
        with pytest.raises(MixedDeviceError):
            _old_draw_rows(on_device, [torch.Generator().manual_seed(i) for i in range(3)])
        drawn = sampling_module._draw_rows(on_device, [torch.Generator().manual_seed(i) for i in range(3)])
    assert drawn == expected  # the same draws: the generators stay on the CPU


def _generate_all(engine: HFEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[Any]:
    """Every prompt at once (prefilled together, decoded together), then a second turn of the first
    over its kept KV."""
    import asyncio

    async def run() -> list[Any]:
        first = await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params, strict=True)))
        again = prompts[0] + list(first[0].token_ids) + prompts[1][:5]
        second = await engine.generate(again, params[0])
        await engine.close()
        return [*first, second]

    return asyncio.run(run())


def test_the_engine_on_cuda_generates_what_it_generates_on_cpu(
    tiny_qwen3_dir: Path, qwen3_tokenizer: Any
) -> None:
    prompts = [qwen3_tokenizer.encode(t) for t in ("Hello there, how are you?", "Count: 1 2 3", "Why?")]
    params = [
        SamplingParams(temperature=1.0, max_tokens=12, seed=1),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_tokens=12, seed=2),
        SamplingParams(temperature=0.0, max_tokens=12),
    ]
    on_cpu = _generate_all(HFEngine(load_model(str(tiny_qwen3_dir)), packed_weights=False), prompts, params)
    with fake_cuda():
        model = load_model(str(tiny_qwen3_dir), device="cuda")
        assert model.device == FAKE_CUDA
        on_cuda = _generate_all(HFEngine(model), prompts, params)  # packing is CPU-only: off by itself
    for a, b in zip(on_cpu, on_cuda, strict=True):
        assert b.finish_reason == a.finish_reason
        assert list(b.token_ids) == list(a.token_ids)
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)


def _join_leave_grow(engine: HFEngine, prompts: list[list[int]]) -> list[Any]:
    """Rows that leave early, rows that join while others decode, one that outgrows 256 KV columns,
    and a session's second turn over its kept KV."""
    import asyncio

    async def run() -> list[Any]:
        greedy = [SamplingParams(temperature=0.0, max_tokens=n) for n in (3, 40, 290, 12)]
        first = [
            asyncio.ensure_future(engine.generate(p, s, session=f"s{i}"))
            for i, (p, s) in enumerate(zip(prompts, greedy, strict=True))
        ]
        done = [await first[0]]
        late = [  # they join the running batch
            asyncio.ensure_future(engine.generate(p, SamplingParams(temperature=1.0, max_tokens=30, seed=i)))
            for i, p in enumerate(prompts[:2])
        ]
        done += await asyncio.gather(*first[1:], *late)
        again = prompts[3] + list(done[3].token_ids) + prompts[0][:4]
        done.append(await engine.generate(again, greedy[1], session="s3"))
        await engine.close()
        return done

    return asyncio.run(run())


def test_decode_steps_over_the_kv_pool_generate_what_the_plain_path_generates(
    tiny_qwen3_dir: Path, qwen3_tokenizer: Any
) -> None:
    texts = ("Hello there, how are you?", "Count: 1 2 3", "Why?", "Name three colours, then stop.")
    prompts = [qwen3_tokenizer.encode(t) for t in texts]
    on_cpu = _join_leave_grow(HFEngine(load_model(str(tiny_qwen3_dir)), packed_weights=False), prompts)
    with fake_cuda():
        engine = HFEngine(load_model(str(tiny_qwen3_dir), device="cuda"))
        graphs = engine._scheduler.graphs
        assert graphs is not None  # a Qwen3 text model on "cuda": decode steps over the KV pool
        on_cuda = _join_leave_grow(engine, prompts)
    assert graphs.captured == 0 and graphs.pool.generation >= 3  # the long row grew the pool
    assert graphs.pool.columns == 0 and not graphs.pool.keys  # closing the engine freed it
    assert engine.prefix_stats["hits"] == 1
    for a, b in zip(on_cpu, on_cuda, strict=True):
        assert (b.finish_reason, list(b.token_ids)) == (a.finish_reason, list(a.token_ids))
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)


def test_row_buckets_and_a_refused_cuda_graphs_request(tiny_qwen3_dir: Path) -> None:
    assert [row_bucket(n, 64) for n in (1, 2, 3, 5, 8, 9, 17, 63, 64)] == [1, 2, 4, 8, 8, 16, 24, 64, 64]
    assert row_bucket(30, 20) == 20
    with pytest.raises(EngineError, match=r"cuda_graphs needs .* on a CUDA device"):
        HFEngine(load_model(str(tiny_qwen3_dir)), cuda_graphs=True)
    assert HFEngine(load_model(str(tiny_qwen3_dir)))._scheduler.graphs is None  # on the CPU: off


async def test_a_training_step_on_cuda_trains_and_pushes_the_weights(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    config = TrainConfig.model_validate(
        {
            "model": str(tiny_qwen3_dir),
            "engine": {"device": "cuda"},
            "env": {"name": "test_fake_cuda_parity"},
            "sampling": {"temperature": 1.0, "max_tokens": 6},
            "limits": {"max_turns": 1, "max_context_tokens": 128},
            "optim": {"lr": 1e-3},
            "rollout": {"group_size": 4},
            "train": {"steps": 1, "prompts_per_step": 2, "plot": False, "save_every": 1},
            "output_dir": str(tmp_path / "run"),
        }
    )
    with fake_cuda():
        run = build_run(config, overwrite=False, resume=False, console=QUIET)
        try:
            assert run.policy.device == FAKE_CUDA
            before = {k: v.clone() for k, v in run.policy.state_dict().items()}
            metrics = await train_step(run, 1)
        finally:
            await run.engine.close()
        after = run.policy.state_dict()
        engine_weights = run.engine.model.state_dict()
        assert [k for k, v in after.items() if v.device != FAKE_CUDA] == []
        assert [k for k, v in engine_weights.items() if v.device != FAKE_CUDA] == []
        assert any(not torch.equal(before[k], after[k]) for k in before)
        assert all(torch.equal(engine_weights[k], after[k]) for k in after)
    assert metrics.get("stop/engine_error", 0.0) == 0.0 and metrics["train/samples"] > 0
    assert metrics["is/ratio_min"] > 0.99 and metrics["is/ratio_max"] < 1.01


@pytest.mark.parametrize("kind", ["tiny-qwen2-vl", "tiny-qwen3-vl"])
async def test_a_vlm_rollout_on_cuda_samples_what_it_samples_on_cpu(kind: str) -> None:
    from test_vision import PictureEnv, spec_for

    from turnrl.app import hf_engine
    from turnrl.chat.encoder import ChatEncoder
    from turnrl.config import HFEngineConfig
    from turnrl.types import Sample

    async def rollout(device: str) -> Any:
        engine = hf_engine(kind, HFEngineConfig(device=device, packed_weights=False), seed=0)
        try:
            assert engine.vision is not None and engine.model.device.type == device
            encoder = ChatEncoder(engine.tokenizer, vision=engine.vision)
            return await run_trajectory(Sample("p", []), spec_for(PictureEnv, engine, encoder))
        finally:
            await engine.close()

    on_cpu = await rollout("cpu")
    with fake_cuda():
        on_cuda = await rollout("cuda")
    assert on_cuda.error is None and on_cuda.num_turns == on_cpu.num_turns >= 3
    assert len(on_cuda.images) == len(on_cpu.images) and on_cuda.response_ids == on_cpu.response_ids
    torch.testing.assert_close(
        torch.tensor(on_cuda.rollout_logprobs), torch.tensor(on_cpu.rollout_logprobs), atol=1e-4, rtol=0
    )


def test_every_collective_of_the_trainer_reduces_tensors_nccl_can_take(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NCCL reduces CUDA tensors only: a CPU tensor handed to it fails on a multi-GPU run. With the
    backend reported as NCCL, every all-reduce of the trainer gets a tensor on the device."""
    import torch.distributed as dist

    from turnrl.train.batch import TrainSample, collate
    from turnrl.train.data_parallel import Ranks, sum_across, sum_gradients
    from turnrl.train.fsdp import agree_on_sharing, most_across

    reduced: list[torch.Tensor] = []

    def all_reduce(tensor: torch.Tensor, op: Any = None) -> None:
        if not on_fake_cuda(tensor):
            raise MixedDeviceError(f"NCCL got a CPU tensor of shape {tuple(tensor.shape)}")
        reduced.append(tensor)

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    two = Ranks(0, 2)
    with fake_cuda():
        assert sum_across([1.0, 2.0], two) == [1.0, 2.0]
        assert most_across(3, two) == 3
        batch = collate([TrainSample([1, 2], [0, 1], [0.0, 0.0], [0.0, 0.0])], 0).to("cuda")
        assert len(agree_on_sharing([(batch, True)], two)) == 1
        layer = torch.nn.Linear(2, 2).to("cuda")
        layer(torch.ones(1, 2, device="cuda")).sum().backward()
        sum_gradients(list(layer.parameters()), two)
    assert len(reduced) == 4
