"""Weights broadcast over a real gloo group, from ``WeightGroup`` (the trainer's end) to turnrl's vLLM
worker extension (a worker's end), in buckets: every tensor arrives exactly, in order, named.
``tests/test_vllm.py`` does the same into real vLLM servers."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

from turnrl.engines.vllm_worker.turnrl_vllm_worker import TurnrlWorker
from turnrl.engines.weight_group import WeightGroup, buckets_of, layout


class Worker(TurnrlWorker):
    """A vLLM worker's stand-in: its rank, its device, and the in-place reload it feeds."""

    rank = 0
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def reload_weights(self, weights_iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.loaded += [(name, tensor.clone()) for name, tensor in weights_iterator]


def beside(work: Callable[[], Any]) -> threading.Thread:
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g),
        "model.norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(16, 32, generator=g)[:, ::2],  # not contiguous
        "model.layers.0.input_layernorm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(16, generator=g),
    }


def test_buckets_hold_one_dtype_in_order_within_their_size() -> None:
    state = weights()
    buckets = buckets_of(state, bucket_bytes=4096)
    assert [name for bucket in buckets for name, _ in bucket] != list(state)  # dtypes apart
    assert sorted(name for bucket in buckets for name, _ in bucket) == sorted(state)
    for bucket in buckets:
        assert len({t.dtype for _, t in bucket}) == 1
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= 4096 or len(bucket) == 1  # a tensor larger than a bucket goes alone
    for dtype in (torch.float32, torch.bfloat16):
        names = [name for bucket in buckets for name, t in bucket if t.dtype == dtype]
        assert names == [name for name, t in state.items() if t.dtype == dtype]
    assert len(buckets) == 3  # 4 KiB: the embedding (4 KiB); up, down and the bias; the two norms
    assert buckets_of({}) == []


@pytest.mark.parametrize("bucket_bytes", [4096, 1 << 20])
def test_a_worker_receives_every_tensor_exactly_over_gloo(bucket_bytes: int) -> None:
    state = weights()
    group, worker = WeightGroup(1, timeout_s=60), Worker()
    assert worker.weight_group_id() is None
    ranks: list[int] = []
    joining = beside(lambda: ranks.append(worker.init_weight_group(json.dumps(group.spec()))))
    group.connect()
    joining.join(60)
    assert ranks == [1] and worker.weight_group_id() == group.id
    for round_ in range(2):  # the group carries every push, not only the first
        sent = {name: tensor * (round_ + 1) for name, tensor in state.items()}
        buckets = buckets_of(sent, bucket_bytes)
        counts: list[int] = []
        sent_layout = json.dumps(layout(buckets))
        receiving = beside(lambda s=sent_layout, c=counts: c.append(worker.receive_weights(s)))
        group.send(buckets)
        receiving.join(60)
        got = dict(worker.loaded)
        assert counts == [len(state)] and sorted(got) == sorted(sent)
        for name, tensor in sent.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
        worker.loaded.clear()
    group.close()


def test_a_worker_without_a_group_says_so() -> None:
    with pytest.raises(RuntimeError, match="no weight group"):
        Worker().receive_weights(json.dumps([]))


def test_auto_is_a_collective_for_started_servers_with_weights_on_a_gpu() -> None:
    """``engine.weight_sync: auto``: NCCL where it pays (servers turnrl started, weights on a GPU); on a
    CPU the file in /dev/shm, which is faster than gloo (BENCHMARKS.md); ``urls``: the file."""
    from turnrl.config import VLLMEngineConfig

    started, running = VLLMEngineConfig(kind="vllm"), VLLMEngineConfig(kind="vllm", urls=["http://h:1"])
    assert started.sync_way(on_gpu=True) == "collective" and started.sync_way(on_gpu=False) == "file"
    assert running.sync_way(on_gpu=True) == "file"
    chosen = VLLMEngineConfig(kind="vllm", urls=["http://h:1"], weight_sync="collective")
    assert chosen.sync_way(on_gpu=False) == "collective"
