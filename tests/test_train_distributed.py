"""Data-parallel training on torch.distributed: ranks started by torchrun on the gloo backend (CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from turnrl.data import to_samples
from turnrl.record.codec import trajectory_from_json
from turnrl.testing import ParityEnv
from turnrl.train.batch import step_prompts
from turnrl.train.metrics import read_metrics

HERE = Path(__file__).parent


def steps_at_ratio_one(out: Path, steps: int) -> list[dict[str, Any]]:
    """The run's metrics records, after checking it made ``steps`` steps, each training, with the
    importance ratio between the trainer's recomputed logprobs and the engine's 1 within 1e-3 (the
    engine sampled with exactly the trainer's weights)."""
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(steps + 1))
    for record in records[1:]:
        assert record["train/samples"] > 0, record
        assert 0.999 < record["is/ratio_min"] <= record["is/ratio_max"] < 1.001, record
    return records


def torchrun(ranks: int, *args: str, cwd: Path | None = None) -> str:
    """Run ``args`` under torchrun with ``ranks`` processes; what they printed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        *args,
    ]
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.mark.parametrize(
    ("mode", "alone_mode"),
    [("replicated", "replicated"), ("fsdp", "replicated"), ("fsdp-lora", "lora"), ("fsdp-shared", "grouped")],
)
def test_two_gloo_ranks_make_the_one_process_update(
    tmp_path: Path, tiny_qwen3_dir: Path, mode: str, alone_mode: str
) -> None:
    """A fixed batch of 8 samples: one process trains on all of them; two ranks on 4 each, with
    the loss normalized by the whole batch's tokens and the gradients summed across ranks. Both
    ranks end with identical weights, equal to the one-process update; the losses are equal.
    ``fsdp``: the policy sharded across the two ranks (FSDP2), rank 1 with fewer micro-batches
    than rank 0 (it runs empty ones so the collectives meet): the same update, gathered whole.
    ``fsdp-lora``: the same with LoRA adapters (trained) beside frozen weights in every unit.
    ``fsdp-shared``: sharded, on GRPO groups whose prompt runs once where both ranks' micro-batches
    at a place share one (rank 0: three such, rank 1: one, then plain rows): the first place
    shares, the second is outvoted, the third shares beside rank 1's empty batch; the update is
    the one process's on plain rows."""
    worker = str(HERE / "dp_worker.py")
    torchrun(1, worker, str(tiny_qwen3_dir), str(tmp_path), alone_mode)
    torchrun(2, worker, str(tiny_qwen3_dir), str(tmp_path), mode)
    alone = torch.load(tmp_path / f"weights.{alone_mode}.1.0.pt")
    first, second = (torch.load(tmp_path / f"weights.{mode}.2.{r}.pt") for r in (0, 1))
    assert alone.keys() == first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)  # identical on every rank
    for name in alone:
        torch.testing.assert_close(first[name], alone[name], atol=1e-7, rtol=1e-6)
    # the summed gradients are the one-process gradients (rounding only: sums in another order)
    grads = torch.load(tmp_path / f"grads.{alone_mode}.1.0.pt"), torch.load(tmp_path / f"grads.{mode}.2.0.pt")
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert all(("lora_" in name) == ("lora" in mode) for name in grads[1])  # LoRA: only adapters train
    for name, grad in grads[0].items():
        # float32 sums over other micro-batches and paddings: within 1e-4 of the largest entry
        torch.testing.assert_close(grads[1][name], grad, atol=1e-4 * float(grad.abs().max()), rtol=0)
    one = json.loads((tmp_path / f"metrics.{alone_mode}.1.0.json").read_text())
    two = [json.loads((tmp_path / f"metrics.{mode}.2.{r}.json").read_text()) for r in (0, 1)]
    assert two[0].pop("micro_batches") > two[1].pop("micro_batches")  # rank 1 ran empty ones
    shared = [two[0].pop("shared"), two[1].pop("shared")]
    if mode == "fsdp-shared":  # 10-token prompts; outvoted at the second place, for good
        assert shared == [[10, 0, 10], [10, 0]], shared
    else:
        assert not any(shared[0] + shared[1])
    assert two[0] == two[1]  # every rank reports the step's totals
    assert abs(two[0]["loss/value"] - one["loss/value"]) < 1e-5
    assert abs(two[0]["grad_norm"] - one["grad_norm"]) < 1e-4 * max(1.0, one["grad_norm"])


def test_turnrl_train_under_torchrun_splits_the_prompts_and_keeps_the_ranks_identical(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    """`torchrun --nproc-per-node 2 -m turnrl.cli train CONFIG`: each rank rolls out its half of a
    step's prompts; rank 0 alone writes metrics, evaluations and checkpoints; the weights stay
    identical on both ranks (``dist/param_spread`` 0)."""
    config = {
        "model": str(tiny_qwen3_dir),
        "env": {"name": "turnrl.testing:ParityEnv"},
        "sampling": {"temperature": 1.0, "max_tokens": 6},
        "limits": {"max_turns": 1, "max_context_tokens": 128},
        "optim": {"lr": 1e-3},
        "rollout": {"group_size": 4},
        "train": {"steps": 2, "prompts_per_step": 4, "plot": False, "save_every": 2, "save_rollouts": True},
        "eval": {"data": {"kwargs": {"size": 2}}, "every": 2},
        "output_dir": str(tmp_path / "run"),
    }
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    printed = torchrun(2, "-m", "turnrl.cli", "train", "train.yaml", cwd=tmp_path)
    assert printed.count("wrote") == 1, printed  # rank 0 reports for all
    out = tmp_path / "run"
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]  # written once, by rank 0
    assert all(r["dist/param_spread"] == 0.0 for r in records[1:])
    assert any(r["train/samples"] > 0 for r in records[1:]) and "eval/reward/mean" in records[2]
    samples = to_samples(ParityEnv.dataset(), "the env's data", None)
    for step in (1, 2):
        ids = [
            {
                trajectory_from_json(json.loads(line)).group_id
                for line in (out / "rollouts" / name).read_text().splitlines()
            }
            for name in (f"step_{step:06d}.rank0.jsonl", f"step_{step:06d}.rank1.jsonl")
        ]
        assert len(ids[0]) == len(ids[1]) == 2 and not ids[0] & ids[1]
        assert ids[0] | ids[1] == {s.id for s in step_prompts(samples, 4, step - 1, seed=0)}
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000002"]


def test_fsdp_under_torchrun_trains_part_of_the_model_checkpoints_it_whole_and_resumes(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    """`train.fsdp: true` under torchrun, training one layer and the final norm (frozen and trained
    weights in one sharded unit): each step's update reaches the engines (rollouts go on), rank 0
    writes whole checkpoints (weights and AdamW moments gathered), and `--resume` continues."""
    from turnrl.models import load_model

    config = {
        "model": str(tiny_qwen3_dir),
        "env": {"name": "turnrl.testing:ParityEnv"},
        "sampling": {"temperature": 1.0, "max_tokens": 6},
        "limits": {"max_turns": 1, "max_context_tokens": 128},
        "optim": {"lr": 1e-2, "trainable": [r"layers\.1\.", r"model\.norm"]},
        "rollout": {"group_size": 4},
        "train": {
            "steps": 2,
            "prompts_per_step": 4,
            "plot": False,
            "save_every": 1,
            "fsdp": True,
            "share_prefix_tokens": 8,  # the prompts are short
        },
        "output_dir": str(tmp_path / "run"),
    }
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    torchrun(2, "-m", "turnrl.cli", "train", "train.yaml", cwd=tmp_path)
    out = tmp_path / "run"
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2] and "dist/param_spread" not in records[1]
    assert all(r["train/samples"] > 0 and r["grad_norm"] > 0 for r in records[1:])
    assert sum(r["train/prefix_tokens_shared"] for r in records[1:]) > 0  # groups' prompts ran once
    base = load_model(str(tiny_qwen3_dir)).state_dict()
    saved = load_model(str(out / "checkpoints" / "step_000002" / "model")).state_dict()
    moved = {k for k in base if not torch.equal(base[k], saved[k])}
    assert moved and all(k.startswith(("model.layers.1.", "model.norm")) for k in moved), moved
    moments = torch.load(out / "checkpoints" / "step_000002" / "optimizer.pt", weights_only=False)
    sizes = sorted(s["exp_avg"].numel() for s in moments["optimizer"]["state"].values())
    expected = sorted(v.numel() for k, v in base.items() if k.startswith(("model.layers.1.", "model.norm")))
    assert sizes == expected  # every trained weight's moments, whole
    config["train"]["steps"] = 3
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    torchrun(2, "-m", "turnrl.cli", "train", "train.yaml", "--resume", cwd=tmp_path)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3]


def test_fsdp_with_lora_under_torchrun_serves_merged_weights_and_checkpoints_adapters(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    """`train.fsdp` with `optim.lora` under torchrun: the adapters train sharded beside the frozen
    base; after each update every rank's engine gets the base with the adapters merged in (the
    rollouts' logprobs equal the trainer's recomputed ones: ratio 1 within 1e-3), and rank 0 writes
    the adapters alone as the checkpoint's model."""
    from safetensors.torch import load_file

    config = {
        "model": str(tiny_qwen3_dir),
        "env": {"name": "turnrl.testing:ParityEnv"},
        "sampling": {"temperature": 1.0, "max_tokens": 6},
        "limits": {"max_turns": 1, "max_context_tokens": 128},
        "algorithm": {"recompute_old_logprobs": True, "kl_coef": 0.001},
        "optim": {"lr": 1e-2, "lora": {"r": 4}},
        "rollout": {"group_size": 4},
        "train": {
            "steps": 2,
            "prompts_per_step": 4,
            "plot": False,
            "save_every": 2,
            "fsdp": True,
            "share_prefix_tokens": 8,  # the prompts are short: recomputed logprobs on shared prefixes
        },
        "output_dir": str(tmp_path / "run"),
    }
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    torchrun(2, "-m", "turnrl.cli", "train", "train.yaml", cwd=tmp_path)
    out = tmp_path / "run"
    records = steps_at_ratio_one(out, 2)
    assert all(record["grad_norm"] > 0 and record["train/prefix_tokens_shared"] > 0 for record in records[1:])
    model = out / "checkpoints" / "step_000002" / "model"
    assert (model / "adapter_config.json").is_file() and not (model / "model.safetensors").exists()
    adapters = load_file(str(model / "adapter_model.safetensors"))
    assert adapters and all("lora_" in name for name in adapters)
    assert any(float(v.abs().max()) > 0 for k, v in adapters.items() if "lora_B" in k)  # B left zero: trained
