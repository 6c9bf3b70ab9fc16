"""The verl integration inside verl's own agent-loop machinery, generating on the tiny Qwen3.

verl's ``AgentLoopWorker`` (built from verl's real trainer config) instantiates the ``"turnrl"``
agent loop through its registry and hydra, runs it per row and pads the outputs into its batch.
Behind it, instead of a vLLM/SGLang server (they need a GPU), an object with verl's server-manager
interface generates with turnrl's embedded engine on the tiny Qwen3 and records every call, so the
tokens, masks and logprobs verl receives can be checked against what the server actually sampled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from turnrl.models import load_model
from turnrl.types import Generation, SamplingParams, StopReason

try:  # the real verl package (scripts/setup.sh installs it)
    import hydra
    import numpy as np
    import torch
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopBase,
        AgentLoopOutput,
        AgentLoopWorker,
        DictConfigWrap,
        ToolListWrap,
        _agent_loop_registry,
    )
    from verl.protocol import DataProto
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.workers.rollout.replica import TokenOutput
    from verl_setup import trainer_config
except ImportError as exc:  # pragma: no cover - depends on the machine
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        raise
    pytest.skip(f"verl is not installed ({exc}): run scripts/setup.sh", allow_module_level=True)

from turnrl.engines.hf import HFEngine
from turnrl.integrations.verl import NAME, TurnRLAgentLoop, VerlServerEngine, finish_reason

PROMPT_LEN, RESPONSE_LEN = 256, 96
ODD = list(range(1, 151_700, 2))  # the fake server's stop ids: generations end after a few tokens


@dataclass
class Call:
    """One generate call the server manager served."""

    request_id: str
    prompt_ids: list[int]
    params: dict[str, Any]
    gen: Generation
    images: int = 0  # images sent with the prompt


class HFServerManager:
    """verl's server-manager interface served by turnrl's embedded engine.

    ``style="vllm"`` reports stop reasons as verl's vLLM server does (``completed`` / ``aborted``),
    ``"sglang"`` as its SGLang server does (``stop`` / ``length`` / ``abort``).
    """

    def __init__(self, engine: HFEngine, style: str = "vllm", global_steps: int | None = 3) -> None:
        self.engine = engine
        self.style = style
        self.global_steps = global_steps
        self.calls: list[Call] = []

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: Any = None,
        **kwargs: Any,
    ) -> TokenOutput:
        p = sampling_params
        sampling = SamplingParams(
            temperature=float(p["temperature"]),
            top_p=float(p["top_p"]),
            top_k=max(int(p["top_k"]), 0),
            max_tokens=int(p["max_tokens"]),
        )
        gen = await self.engine.generate(prompt_ids, sampling, image_data or [])
        self.calls.append(Call(request_id, list(prompt_ids), dict(p), gen, len(image_data or [])))
        if gen.finish_reason == "abort":
            reason = "aborted" if self.style == "vllm" else "abort"
        else:
            reason = "completed" if self.style == "vllm" else gen.finish_reason
        return TokenOutput(
            token_ids=list(gen.token_ids),
            log_probs=list(gen.logprobs) if p.get("logprobs") else None,
            stop_reason=reason,
            extra_fields={"global_steps": self.global_steps},
        )


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir: Path) -> Any:
    """The tiny Qwen3 stopping at every odd token id, so turns are short and trajectories multi-turn."""
    eng = HFEngine(load_model(str(tiny_qwen3_dir)), eos_token_ids=ODD, max_batch_size=8, seed=0)
    yield eng


@pytest.fixture(scope="module")
def turnrl_yaml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A whole turnrl rollout config: model, data, engine and rollout belong to the trainer."""
    path = tmp_path_factory.mktemp("turnrl") / "echo.yaml"
    path.write_text(
        "model: smollm2-135m\n"
        "env: {name: 'turnrl.testing:EchoEnv', kwargs: {done_after: 3, reward: 1.0}}\n"
        "data: {path: nowhere.jsonl}\n"
        "engine: {kind: hf}\n"
        "chat: {template_kwargs: {enable_thinking: false}}\n"
        "sampling: {temperature: 0.3, max_tokens: 24}\n"
        "limits: {max_turns: 2}\n"
        "rollout: {n: 4}\n"
    )
    return path


@pytest.fixture(scope="module")
def verl_config(tiny_qwen3_dir: Path, turnrl_yaml: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """verl's PPO trainer config (composed by hydra from verl's own files) for the tiny Qwen3, with an
    agent-loop config file naming the turnrl agent loop with a turnrl config and an override."""
    loops = tmp_path_factory.mktemp("verl") / "agent_loops.yaml"
    loops.write_text(
        "- name: turnrl_echo\n"
        "  _target_: turnrl.integrations.verl.TurnRLAgentLoop\n"
        f"  turnrl_config: {turnrl_yaml}\n"
        "  turnrl: {limits: {max_turns: 5}}\n"
    )
    return trainer_config(tiny_qwen3_dir, loops, PROMPT_LEN, RESPONSE_LEN)


def rebuild(calls: list[Call]) -> tuple[list[int], list[int], list[int], list[float]]:
    """(prompt, response, mask, logprobs) as the server saw them: each call's prompt is the previous
    one plus its sampled tokens (mask 1) plus the observation tokens turnrl inserted (mask 0)."""
    prompt = calls[0].prompt_ids
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for call in calls:
        assert call.prompt_ids[: len(prompt) + len(response)] == prompt + response  # only ever appended
        inserted = call.prompt_ids[len(prompt) + len(response) :]
        response += inserted + call.gen.token_ids
        mask += [0] * len(inserted) + [1] * len(call.gen.token_ids)
        logprobs += [0.0] * len(inserted) + call.gen.logprobs
    return prompt, response, mask, logprobs


def by_request(calls: list[Call]) -> dict[str, list[Call]]:
    out: dict[str, list[Call]] = {}
    for call in calls:
        out.setdefault(call.request_id, []).append(call)
    return out


def test_the_turnrl_agent_loop_is_registered_for_verl() -> None:
    assert issubclass(TurnRLAgentLoop, AgentLoopBase)
    assert _agent_loop_registry[NAME] == {"_target_": "turnrl.integrations.verl.TurnRLAgentLoop"}


async def test_verl_worker_runs_multi_turn_trajectories_with_exact_tokens(
    verl_config: Any, engine: HFEngine
) -> None:
    server = HFServerManager(engine, style="sglang")
    worker = AgentLoopWorker(verl_config, llm_client=server)
    rows = [
        (
            "turnrl_echo",
            [{"role": "user", "content": "Tell a story about a fox."}],
            "echo",
            {"index": 1},
            None,
        ),
        ("turnrl_echo", [{"role": "user", "content": "Count to ten, slowly."}], "echo", {"index": 2}, None),
        (
            NAME,  # the registered name: no config file, the row names its env
            [{"role": "user", "content": "Guess my number from 1 to 5, in brackets."}],
            "guess_number",
            {"index": 3, "seed": 3},  # extra_info: the env reads the seed from the sample's metadata
            {"name": "guess_number", "kwargs": {"hi": 5}},
        ),
    ]
    n = len(rows)

    def column(values: list[Any]) -> Any:
        array = np.empty(n, dtype=object)
        array[:] = values
        return array

    batch = DataProto.from_single_dict(
        {
            "dummy_tensor": torch.zeros(n, 1, dtype=torch.uint8),
            "agent_name": column([r[0] for r in rows]),
            "raw_prompt": column([r[1] for r in rows]),
            "data_source": column([r[2] for r in rows]),
            "extra_info": column([r[3] for r in rows]),
            "index": column([r[3]["index"] for r in rows]),
            "turnrl_env": column([r[4] for r in rows]),
        },
        meta_info={"global_steps": 1, "validate": False},
    )
    out = await worker.generate_sequences(batch)

    prompts, responses = out.batch["prompts"], out.batch["responses"]
    assert prompts.shape == (n, PROMPT_LEN) and responses.shape == (n, RESPONSE_LEN)
    assert out.batch["input_ids"].shape == (n, PROMPT_LEN + RESPONSE_LEN)
    attention = out.batch["attention_mask"]
    traces = by_request(server.calls)
    assert len(traces) == n  # one request id per trajectory, kept across its turns
    first_prompt = {tuple(calls[0].prompt_ids): calls for calls in traces.values()}
    pad = worker.tokenizer.pad_token_id
    for i in range(n):
        prompt = prompts[i][attention[i, :PROMPT_LEN].bool()].tolist()
        calls = first_prompt[tuple(prompt)]
        want_prompt, want_response, want_mask, want_logprobs = rebuild(calls)
        length = len(want_response)
        assert want_prompt == prompt and 0 < length <= RESPONSE_LEN
        assert responses[i, :length].tolist() == want_response
        assert responses[i, length:].tolist() == [pad] * (RESPONSE_LEN - length)
        assert out.batch["response_mask"][i].tolist() == want_mask + [0] * (RESPONSE_LEN - length)
        assert torch.equal(
            out.batch["rollout_log_probs"][i],
            torch.tensor(want_logprobs + [0.0] * (RESPONSE_LEN - length), dtype=torch.float32),
        )
        model_turns = len(calls)
        assert out.non_tensor_batch["turnrl_model_turns"][i] == model_turns
        stop = StopReason(out.non_tensor_batch["turnrl_stop_reason"][i])
        # verl counts every turn plus the prompt; the last model turn is not followed by an observation
        assert out.non_tensor_batch["__num_turns__"][i] == 2 * model_turns
        assert out.non_tensor_batch["min_global_steps"][i] == 3 == out.non_tensor_batch["max_global_steps"][i]
        reward = float(out.batch["rm_scores"][i].sum())
        assert out.batch["rm_scores"][i, length - 1] == reward
        spent = 0
        for call in calls:  # the sampling verl asked for, with the per-turn cap and the budget left
            spent = len(call.prompt_ids) - len(prompt)
            cap = 24 if rows[i][0] == "turnrl_echo" else RESPONSE_LEN
            assert call.params["max_tokens"] == min(cap, RESPONSE_LEN - spent)
            assert call.params["logprobs"] is True and call.params["temperature"] == 1.0
        if rows[i][0] == "turnrl_echo":  # EchoEnv: done after its 3rd step, rewarded 1.0 then
            assert stop == StopReason.ENV_DONE and model_turns == 3 and reward == 1.0
            assert list(out.non_tensor_batch["turn_scores"][i]) == [0.0, 0.0, 1.0]
        else:  # the game's own score: 0.9 ** (guesses - 1) when found, else 0
            assert stop in (StopReason.ENV_DONE, StopReason.MAX_TURNS, StopReason.TOKEN_BUDGET)
            expected = 0.9 ** (model_turns - 1) if stop == StopReason.ENV_DONE else 0.0
            assert reward == pytest.approx(expected, rel=1e-6)  # verl keeps scores in float32


def instantiate(
    verl_config: Any,
    server: Any,
    tokenizer: Any,
    processor: Any = None,
    model_type: str = "qwen3",
    **entry: Any,
) -> TurnRLAgentLoop:
    """The agent loop built the way verl's worker builds it: hydra, from the registry entry."""
    loop = hydra.utils.instantiate(
        config={**_agent_loop_registry[NAME], **entry},
        trainer_config=DictConfigWrap(config=verl_config),
        server_manager=server,
        tokenizer=tokenizer,
        processor=processor,
        hf_model_type=model_type,
        dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(verl_config.data),
        tools=ToolListWrap([]),
    )
    assert isinstance(loop, TurnRLAgentLoop)
    return loop


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


async def test_the_response_stops_at_verls_response_length(
    verl_config: Any, engine: HFEngine, qwen3_tokenizer: Any
) -> None:
    server = HFServerManager(engine, style="vllm", global_steps=None)
    env = {"name": "turnrl.testing:EchoEnv", "kwargs": {"done_after": 0, "reply": "Again, please."}}
    loop = instantiate(verl_config, server, qwen3_tokenizer, turnrl={"env": env, "limits": {"max_turns": 50}})
    row = {"raw_prompt": np.array([{"role": "user", "content": "Talk."}], dtype=object), "index": 0}
    output = await loop.run(dict(SAMPLING), **row)

    traj = loop.trajectory
    assert traj is not None and traj.num_turns >= 2
    assert traj.stop_reason == StopReason.TOKEN_BUDGET  # verl's response length ran out
    assert isinstance(output, AgentLoopOutput)
    assert output.prompt_ids == traj.prompt_ids
    assert output.response_ids == traj.response_ids and len(output.response_ids) <= RESPONSE_LEN
    assert output.response_mask == traj.loss_mask
    assert output.response_logprobs == traj.rollout_logprobs
    assert (
        output.num_turns == len(traj.turns) + 1
        and output.extra_fields["turnrl_stop_reason"] == "token_budget"
    )
    assert output.reward_score is None  # EchoEnv never scored: verl's reward function decides
    assert "min_global_steps" not in output.extra_fields  # this server reports no weight version
    want = rebuild(server.calls)
    assert (want[1], want[2], want[3]) == (traj.response_ids, traj.loss_mask, traj.rollout_logprobs)
    budget = [RESPONSE_LEN - (len(c.prompt_ids) - len(traj.prompt_ids)) for c in server.calls]
    assert [c.params["max_tokens"] for c in server.calls] == budget  # no per-turn cap: the budget left
    tensors = output.as_dict()  # verl's own conversion for its batch
    assert tensors["responses"].dtype == torch.int64 and tensors["prompts"].tolist() == traj.prompt_ids
    assert tensors["rollout_log_probs"].shape == tensors["response_mask"].shape == (len(traj.response_ids),)


async def test_images_go_to_verls_servers_with_every_turn_and_into_its_output(verl_config: Any) -> None:
    """FrozenLake on the tiny Qwen2-VL: an image in verl's raw prompt (as verl's dataset builds it)
    and a board image in every observation reach the server as ``image_data`` with each turn, and
    verl's output names them all in ``multi_modal_data``. verl's own processor for a Qwen2-VL
    model cannot be built on this machine (its video processor needs torchvision, which has no
    CPU build for this torch), so the loop gets an object with the one part turnrl reads from it,
    the image processor; verl's worker-side re-processing of the images is not run."""
    from types import SimpleNamespace

    from PIL import Image

    from turnrl.app import hf_engine
    from turnrl.env.builtin.frozen_lake import FrozenLakeEnv

    seven = list(range(0, 151_000, 7))  # the random model's turns end at every 7th id
    vlm = hf_engine("tiny-qwen2-vl", seed=0, eos_token_ids=seven)
    assert vlm.vision is not None
    server = HFServerManager(vlm)
    processor = SimpleNamespace(image_processor=vlm.vision.image_processor)
    env = {"name": "frozen_lake"}
    loop = instantiate(
        verl_config,
        server,
        vlm.tokenizer,
        processor,
        "qwen2_vl",
        turnrl={"env": env, "limits": {"max_turns": 3}},
    )
    again = instantiate(verl_config, server, vlm.tokenizer, processor, "qwen2_vl", turnrl={"env": env})
    assert again.vision is loop.vision  # one per processor: every row's loop shares its encoder
    row = FrozenLakeEnv.dataset(size=1, seed=0)[0]
    picture = Image.new("RGB", (56, 56), (200, 30, 30))
    prompt = [dict(m) for m in row["prompt"]]
    prompt[-1]["content"] = [
        {"type": "image", "image": picture},
        {"type": "text", "text": prompt[-1]["content"]},
    ]
    fields = {k: v for k, v in row.items() if k not in ("id", "prompt")}
    try:
        output = await loop.run(dict(SAMPLING), raw_prompt=prompt, extra_info=fields)
    finally:
        await vlm.close()
    traj = loop.trajectory
    assert traj is not None and traj.num_turns >= 2 and traj.metrics["check/ok"], traj and traj.error
    assert output.multi_modal_data is not None
    images = output.multi_modal_data["images"]
    assert images == traj.images and any(i is picture for i in images) and len(images) == 1 + traj.num_turns
    assert [c.images for c in server.calls] == [2 + k for k in range(traj.num_turns)]  # all so far
    want = rebuild(server.calls)  # what the server conditioned on, turn after turn
    assert (want[1], want[2], want[3]) == (traj.response_ids, traj.loss_mask, traj.rollout_logprobs)
    assert output.prompt_ids == traj.prompt_ids and output.response_ids == traj.response_ids
    image_tokens = (output.prompt_ids + output.response_ids).count(vlm.vision.image_token_id)
    grid = traj.multimodal_inputs["image_grid_thw"]
    assert image_tokens == int(grid.prod(dim=1).sum()) // vlm.vision.merge_size**2


async def test_a_prompt_longer_than_verls_prompt_length_is_not_generated_from(
    verl_config: Any, engine: HFEngine, qwen3_tokenizer: Any
) -> None:
    server = HFServerManager(engine)
    env = {"name": "turnrl.testing:EchoEnv"}
    loop = instantiate(verl_config, server, qwen3_tokenizer, turnrl={"env": env})
    long = " ".join(["word"] * (PROMPT_LEN + 20))  # longer than verl's prompt, shorter than prompt + response
    row = {"raw_prompt": [{"role": "user", "content": long}]}
    output = await loop.run(dict(SAMPLING, logprobs=False), **row)  # calculate_log_probs off
    assert server.calls == [] and output.response_logprobs is None
    assert loop.trajectory is not None and loop.trajectory.stop_reason == StopReason.ENGINE_ERROR
    assert "prompt_length" in (loop.trajectory.error or "")
    assert output.prompt_ids == loop.trajectory.prompt_ids[-PROMPT_LEN:] and output.response_ids == []


class Scripted:
    """A server manager answering with fixed TokenOutputs."""

    def __init__(self, outputs: list[TokenOutput]) -> None:
        self.outputs = outputs

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]
    ) -> Any:
        return self.outputs.pop(0)


@pytest.mark.parametrize(
    ("stop_reason", "tokens", "expected"),
    [
        ("completed", [5, 6, 7, 8], "length"),  # vLLM: all max_tokens used, no stop id at the end
        ("completed", [5, 6, 9], "stop"),  # vLLM: ended on the stop id
        ("completed", [5, 6], "stop"),  # vLLM: ended early
        ("aborted", [5], "abort"),
        ("length", [5, 6], "length"),  # SGLang says what happened
        ("stop", [5, 6, 7, 8], "stop"),
        ("abort", [], "abort"),
    ],
)
async def test_finish_reasons_from_verls_token_output(
    stop_reason: str, tokens: list[int], expected: str
) -> None:
    assert finish_reason(stop_reason, tokens, 4, frozenset({9})) == expected
    out = TokenOutput(token_ids=tokens, log_probs=[-0.5] * len(tokens), stop_reason=stop_reason)
    engine = VerlServerEngine(Scripted([out]), SAMPLING, stop_token_ids=[9])
    gen = await engine.generate([1, 2], SamplingParams(max_tokens=4))
    assert (gen.token_ids, gen.logprobs, gen.finish_reason) == (tokens, [-0.5] * len(tokens), expected)
