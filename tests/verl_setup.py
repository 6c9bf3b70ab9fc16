"""verl's own trainer config for the verl tests, composed by hydra from verl's files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import verl
from hydra import compose, initialize_config_dir


def trainer_config(model_dir: str | Path, loops: Path, prompt_len: int, response_len: int) -> Any:
    """verl's PPO trainer config for ``model_dir`` with the agent-loop file ``loops``, verl's
    prompt and response lengths, and rollout logprobs on."""
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(
            config_name="ppo_trainer",
            overrides=[
                f"actor_rollout_ref.model.path={model_dir}",
                "actor_rollout_ref.rollout.name=vllm",
                f"actor_rollout_ref.rollout.prompt_length={prompt_len}",
                f"actor_rollout_ref.rollout.response_length={response_len}",
                "actor_rollout_ref.rollout.calculate_log_probs=true",
                f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
            ],
        )
