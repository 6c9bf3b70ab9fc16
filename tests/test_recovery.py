"""What a crash leaves behind is read back exactly: a torn last line, a corrupt middle line, the turn
log of cut-off trajectories, a damaged last checkpoint."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from turnrl.app.run import run
from turnrl.app.training import train
from turnrl.config import RunConfig
from turnrl.env import register_env
from turnrl.testing import EchoEnv, ParityEnv
from turnrl.train.config import TrainConfig
from turnrl.train.metrics import read_metrics
from turnrl.viewer import write_viewer

register_env("test_recovery_parity", ParityEnv, ParityEnv.dataset)


def quiet() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=200), out


def rollout_config(tmp_path: Path, tiny_qwen3_dir: Path) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": str(tiny_qwen3_dir),
            "engine": {"kind": "scripted", "policy": "test_recovery:policy"},
            "env": {"name": "turnrl.testing:EchoEnv", "kwargs": {"done_after": 2}},
            "data": {"generator": "test_recovery:rows"},
            "sampling": {"max_tokens": 8},
            "limits": {"max_turns": 3, "max_context_tokens": 512},
            "rollout": {"group_size": 2, "log_turns": True},
            "output_dir": str(tmp_path / "run"),
        }
    )


def policy(messages: Any, images: Any, sample: Any) -> str:
    return "fine"


def rows(size: int = 4) -> list[dict[str, Any]]:
    return [{"id": f"r{i}", "prompt": "Say hi."} for i in range(size)]


def turn_keys(path: Path) -> list[tuple[str, int]]:
    return [(r["trajectory"], r["turn"]) for r in map(json.loads, path.read_text().splitlines())]


def test_resume_after_a_crash_keeps_every_trajectory_and_turn_exactly_once(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    assert EchoEnv  # the env the config names
    config = rollout_config(tmp_path, tiny_qwen3_dir)
    console, said = quiet()
    run(config, console=console)
    out = Path(config.output_dir)
    lines = (out / "trajectories.jsonl").read_text().splitlines(keepends=True)
    full_turns = sorted(turn_keys(out / "turns.jsonl"))
    assert len(lines) == 8 and len(full_turns) == len(set(full_turns))
    # as after kill -9: the last two trajectories never finished (their turns were logged), the
    # third from the end was cut mid-line, and one in the middle is corrupt
    corrupt = lines[2][: len(lines[2]) // 2] + "\n"
    (out / "trajectories.jsonl").write_text("".join([*lines[:2], corrupt, *lines[3:5], lines[5][:40]]))
    run(config, resume=True, console=console)
    assert ":3: a corrupt record" in said.getvalue() and "runs again" in said.getvalue()
    assert (out / "trajectories.jsonl.corrupt").read_text() == corrupt
    records = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    keys = [(r["group_id"], r["sample_index"]) for r in records]
    assert len(keys) == len(set(keys)) == 8
    assert sorted(turn_keys(out / "turns.jsonl")) == full_turns  # exactly once, none missing


def test_the_viewer_reads_a_run_whose_last_line_is_torn(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    config = rollout_config(tmp_path, tiny_qwen3_dir)
    run(config, console=quiet()[0])
    out = Path(config.output_dir)
    text = (out / "trajectories.jsonl").read_text()
    (out / "trajectories.jsonl").write_text(text + text.splitlines()[0][:50])  # a record being written
    from turnrl.viewer.page import read_run

    assert len(read_run(out).trajectories) == 8  # the torn record left out, as --resume drops it
    assert write_viewer(out).is_file()


def test_train_resume_falls_back_to_the_newest_intact_checkpoint(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    config = TrainConfig.model_validate(
        {
            "model": str(tiny_qwen3_dir),
            "env": {"name": "test_recovery_parity"},
            "sampling": {"temperature": 1.0, "max_tokens": 6},
            "limits": {"max_turns": 1, "max_context_tokens": 128},
            "rollout": {"group_size": 4},
            "train": {"steps": 2, "prompts_per_step": 2, "plot": False, "save_every": 1},
            "output_dir": str(tmp_path / "train"),
        }
    )
    train(config, console=quiet()[0])
    out = Path(config.output_dir)
    weights = out / "checkpoints" / "step_000002" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # the disk filled while it was written
    console, said = quiet()
    longer = config.model_copy(update={"train": config.train.model_copy(update={"steps": 3})})
    train(longer, resume=True, console=console)
    text = said.getvalue()
    assert "step_000002 is damaged" in text and "resuming from" in text and "step_000001" in text
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3]


def test_train_resume_of_a_missing_run_refuses(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    config = TrainConfig.model_validate(
        {
            "model": str(tiny_qwen3_dir),
            "env": {"name": "test_recovery_parity"},
            "rollout": {"group_size": 2},
            "output_dir": str(tmp_path / "nothing-here"),
        }
    )
    with pytest.raises(ValueError, match=r"cannot resume: .* holds no training run"):
        train(config, resume=True, console=quiet()[0])
    assert not (tmp_path / "nothing-here").exists()
    shutil.rmtree(tmp_path / "nothing-here", ignore_errors=True)


FUZZ_EXAMPLES = int(os.environ.get("TURNRL_FUZZ_EXAMPLES", "150"))


@settings(
    max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    count=st.integers(1, 12),
    corrupt=st.sets(st.integers(0, 11), max_size=4),
    garbage=st.sampled_from(["{", "not json", '{"id": 1}', "\x00\x01", '["a list"]', "{}"]),
    duplicate=st.one_of(st.none(), st.integers(0, 11)),
    cut=st.one_of(st.none(), st.integers(1, 200)),
)
def test_recover_keeps_every_intact_record_once_whatever_the_damage(
    tmp_path: Path, count: int, corrupt: set[int], garbage: str, duplicate: int | None, cut: int | None
) -> None:
    """Fuzzed damage to trajectories.jsonl (corrupt middle lines, a duplicated line, a cut tail):
    recover never raises, keeps exactly the intact records once each, reports each corrupt line
    with its number, and leaves a file that recovers to the same again."""
    from turnrl.record.codec import json_line, trajectory_to_json
    from turnrl.rollout.collector import recover
    from turnrl.types import StopReason, Trajectory

    path = tmp_path / f"fuzz-{count}-{len(corrupt)}-{duplicate}-{cut}.jsonl"
    lines = [
        json_line(trajectory_to_json(Trajectory(f"p{i}/0", f"p{i}", "d", StopReason.ENV_DONE, [1, 2], [3])))
        for i in range(count)
    ]
    bad = {i for i in corrupt if i < count}
    damaged = [garbage + "\n" if i in bad else line for i, line in enumerate(lines)]
    if duplicate is not None and duplicate < count and duplicate not in bad:
        damaged.append(lines[duplicate])
    text = "".join(damaged)
    torn = None
    if cut is not None and count - 1 not in bad and (duplicate is None or duplicate >= count):
        torn = count - 1
        text = text[: len(text) - min(cut, len(lines[-1]) - 1)]  # the last record cut mid-line
    path.write_text(text)
    said: list[str] = []
    trajs, _ = recover(path, say=said.append)
    intact = {f"p{i}" for i in range(count) if i not in bad and i != torn}
    assert sorted(t.group_id for t in trajs) == sorted(intact)  # each once
    assert len(said) == len(bad) and all(
        f":{i + 1}: a corrupt record" in s for i, s in zip(sorted(bad), said, strict=True)
    )
    again, dropped = recover(path)
    assert sorted(t.group_id for t in again) == sorted(intact) and dropped == 0
    path.unlink()
    path.with_name(path.name + ".corrupt").unlink(missing_ok=True)
