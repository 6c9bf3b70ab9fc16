"""A bad config key is named as the user wrote it: one line, no pydantic internals (a union's tag
such as ``harness`` or member such as ``list[str]``), the right choices for a ``kind``, and a count
of the other keys that are wrong, not of a union's members."""

from __future__ import annotations

from pathlib import Path

import pytest

from turnrl.config import ConfigError, RunConfig, load_model_config
from turnrl.train.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "examples" / "harness" / "train_lookup.yaml"
ROLLOUT = REPO / "examples" / "guess_number.yaml"


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["env.command=[true]"], "config key 'env.command[0]': Input should be a valid string"),
        (["env.command=5"], "config key 'env.command': Input should be a valid list, or a valid string"),
        (["env.env={A: 1}"], "config key 'env.env.A': Input should be a valid string"),
        (["env.kind=bogus"], "config key 'env.kind': must be one of env, harness"),
        (["env.commandz=1"], "unknown config key 'env.commandz'"),
        (["engine.kind=bogus"], "config key 'engine.kind': must be one of hf, openai, sglang, vllm, scr"),
        (["optim.lr=x", "train.steps=y"], "config key 'optim.lr': Input should be a valid number"),
    ],
)
def test_a_bad_harness_config_key_is_named_as_written(overrides: list[str], said: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_model_config(HARNESS, TrainConfig, overrides, {"purpose": "train"})
    message = str(raised.value)
    assert message.startswith(said) and "\n" not in message, message
    others = len(overrides) - 1
    assert message.endswith(f"(+{others} more)") == bool(others), message


def test_engine_and_missing_keys_keep_their_names() -> None:
    with pytest.raises(ConfigError, match=r"^unknown config key 'engine\.port'$"):
        load_model_config(ROLLOUT, RunConfig, ["engine.kind=vllm", "engine.port=x"])
    with pytest.raises(ConfigError, match=r"^missing config key 'engine\.urls'$"):
        load_model_config(ROLLOUT, RunConfig, ["engine.kind=openai"])
