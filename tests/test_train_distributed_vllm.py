"""Data-parallel training under torchrun with vLLM servers shared by every rank: the first rank
starts them, every rank rolls out its share of the prompts through them, the first rank pushes the
weights (gathered whole under FSDP) and the others take up the version the servers report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from test_train_distributed import HERE, steps_at_ratio_one, torchrun
from vllm_helpers import need_vllm

from turnrl.record.codec import trajectory_from_json
from turnrl.train.metrics import read_metrics


def _config(model: Path, out: Path, **train: Any) -> dict[str, Any]:
    """Two GRPO steps of the tiny Qwen3 on the parity env, rolled out on one vLLM server."""
    return {
        "model": str(model),
        "env": {"name": "turnrl.testing:ParityEnv"},
        "sampling": {"temperature": 1.0, "max_tokens": 6},
        "limits": {"max_turns": 1, "max_context_tokens": 128},
        "engine": {"kind": "vllm", "servers": 1, "max_model_len": 512, "kv_cache_gib": 1},
        "optim": {"lr": 1e-3},
        "rollout": {"group_size": 4},
        "train": {"steps": 2, "prompts_per_step": 4, "plot": False, "save_every": 0, "save_rollouts": True}
        | train,
        "output_dir": str(out),
    }


def _trajectories(out: Path, step: int, rank: int) -> list[Any]:
    lines = (out / "rollouts" / f"step_{step:06d}.rank{rank}.jsonl").read_text().splitlines()
    return [trajectory_from_json(json.loads(line)) for line in lines]


def test_fsdp_ranks_share_the_vllm_server_the_first_rank_starts(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    """`train.fsdp` on 2 gloo ranks, `engine.kind: vllm`: after each push vLLM samples with exactly
    the weights the ranks hold (the importance ratio of every step is 1 within 1e-3), and rank 1
    stamps its tokens with the version the server reports."""
    need_vllm()
    config = _config(tiny_qwen3_dir, tmp_path / "run", fsdp=True)
    # recomputed old logprobs against vLLM's: the ratio says which weights vLLM sampled with; the KL
    # term keeps every sample (and so its ratio) when a group's rewards tie
    config["algorithm"] = {"recompute_old_logprobs": True, "kl_coef": 0.001}
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    torchrun(2, "-m", "turnrl.cli", "train", "train.yaml", cwd=tmp_path)
    out = tmp_path / "run"
    assert all(record["time/sync"] > 0 for record in steps_at_ratio_one(out, 2)[1:])
    for step in (1, 2):
        for rank in (0, 1):
            trajs = _trajectories(out, step, rank)
            assert len(trajs) == 8  # 2 prompts x 4 per rank
            versions = {v for t in trajs for v, m in zip(t.policy_versions, t.loss_mask, strict=True) if m}
            assert versions == {step - 1}, (step, rank, versions)
    assert list((out / "servers").glob("vllm-*.log"))  # the first rank started the server here


def test_overlapped_ranks_hold_their_turns_while_the_first_rank_updates_the_shared_server(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    """`train.overlap` on 2 ranks sharing one vLLM server: at each push every rank holds its turns,
    then the first rank aborts what is in flight on the server (every rank's requests) and reloads.
    No rank's trajectory ends as aborted: each goes on from its tokens under the new version. Each
    rank runs under ``PushGate`` (tests/gated_train.py), so the pushes meet turns in flight."""
    need_vllm()
    config = _config(tiny_qwen3_dir, tmp_path / "run", steps=3, overlap=True)
    config["env"]["name"] = "vllm_helpers:GatedParityEnv"
    config["sampling"]["max_tokens"] = 256  # the random model seldom stops: turns of 256 tokens
    config["limits"]["max_context_tokens"] = 512
    config["algorithm"] = {"max_staleness": 1, "kl_coef": 0.001}
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    torchrun(2, str(HERE / "gated_train.py"), "train", "train.yaml", cwd=tmp_path)
    out = tmp_path / "run"
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["async/staleness_max"] <= 1 and r["time/sync"] > 0 for r in records[1:])
    split = {0: 0, 1: 0}
    for step in (1, 2, 3):
        for rank in (0, 1):
            for traj in _trajectories(out, step, rank):
                assert traj.stop_reason != "aborted", (step, rank, traj.stop_reason)
                model = [v for v, m in zip(traj.policy_versions, traj.loss_mask, strict=True) if m]
                assert model == sorted(model) and traj.metrics.get("check/ok"), (model, traj.metrics)
                turns = [t for t in traj.turns if t.role == "assistant"]
                split[rank] += sum(len(set(traj.policy_versions[t.start : t.end])) > 1 for t in turns)
    assert all(json.loads((tmp_path / f"gate.rank{r}.json").read_text())["released"] > 0 for r in (0, 1))
    assert split[1] > 0, split  # rank 0's abort stopped rank 1's turns mid-way: they went on from there
