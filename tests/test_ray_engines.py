"""Engines as Ray actors in a registry: same tokens as local, engines joining and dying mid-rollout."""

from __future__ import annotations

import asyncio
import dataclasses
import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")


from turnrl.app import Prepared, prepare  # noqa: E402
from turnrl.app.engines import EngineBuild, ray_engine, server_for_entry  # noqa: E402
from turnrl.config import HFEngineConfig, OpenAIEngineConfig, RunConfig  # noqa: E402
from turnrl.distributed import RayEngine, RayEngineConfig, RegistryEngine  # noqa: E402
from turnrl.distributed.ray_engines import (  # noqa: E402
    get_registry,
    register_actor,
    register_server,
    start_engine_actor,
)
from turnrl.engines.balancer import BalancedEngine  # noqa: E402
from turnrl.engines.http import RequestError  # noqa: E402
from turnrl.engines.openai import OpenAIEngine  # noqa: E402
from turnrl.engines.servers import free_port  # noqa: E402
from turnrl.rollout.collector import collect, iter_trajectories  # noqa: E402
from turnrl.types import Generation, SamplingParams, Trajectory  # noqa: E402

# Engines defined here travel to the actors by value (this test module is not importable there).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

REPO = Path(__file__).resolve().parents[1]
REGISTRY = "test-engines"
# Random-init weights rarely sample <|im_end|>: stopping on every 5th id gives multi-turn episodes.
STOP_IDS = tuple(range(0, 151_000, 5))


def run_config(model: Path, out: Path, **ray_engine: Any) -> RunConfig:
    """A multi-turn EchoEnv rollout of the tiny Qwen3; ``ray_engine`` fills ``engine.ray``."""
    return RunConfig.model_validate(
        {
            "model": str(model),
            "env": {"name": "turnrl.testing:EchoEnv", "kwargs": {"done_after": 3}},
            "data": {"kwargs": {"size": 4}},
            "engine": {"max_batch_size": 16, "ray": ray_engine},
            "sampling": {"temperature": 1.0, "max_tokens": 8},
            "limits": {"max_turns": 3, "max_context_tokens": 512},
            "rollout": {"group_size": 2, "concurrency": 8},
            "seed": 3,
            "output_dir": str(out),
        }
    )


def ready(config: RunConfig) -> Prepared:
    """The prepared run, with the multi-turn stop ids."""
    prepared = prepare(config)
    sampling = dataclasses.replace(prepared.spec.sampling, stop_token_ids=STOP_IDS)
    prepared.spec = dataclasses.replace(prepared.spec, sampling=sampling)
    return prepared


def on_registry(tmp_path: Path, model: Path, **more: Any) -> RunConfig:
    """The same run, on the engines of the test registry (none started by the driver)."""
    ray_section = {"enabled": True, "replicas": 0, "registry": REGISTRY, "refresh_s": 0.1, **more}
    return run_config(model, tmp_path / "ray", **ray_section)


@pytest.fixture(scope="module")
def local(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Trajectory]:
    """The reference: the same config with the embedded engine in this process, by trajectory id."""
    prepared = ready(run_config(tiny_qwen3_dir, tmp_path_factory.mktemp("local")))

    async def run() -> list[Trajectory]:
        try:
            return await collect(prepared.samples, prepared.spec, group_size=2, concurrency=8)
        finally:
            await prepared.spec.engine.close()

    trajs = asyncio.run(run())
    assert len(trajs) == 8 and max(t.num_turns for t in trajs) >= 2  # multi-turn episodes
    return {t.id: t for t in trajs}


def build(model: Path) -> EngineBuild:
    return EngineBuild(str(model), HFEngineConfig(max_batch_size=16))


@pytest.fixture(scope="module")
def actors(ray_cluster: str, tiny_qwen3_dir: Path) -> Iterator[list[Any]]:
    """Two engine actors hosting the tiny Qwen3, starting (they load while the local run runs)."""
    handles = [start_engine_actor(build(tiny_qwen3_dir), num_cpus=0.5) for _ in range(2)]
    yield handles
    for handle in handles:
        ray.kill(handle)


@pytest.fixture(scope="module")
def hosts(actors: list[Any], local: dict[str, Trajectory]) -> dict[str, Any]:
    """The two actors, registered in the test registry: name -> handle."""
    registry = get_registry(REGISTRY, health_interval_s=0.2)
    return {register_actor(registry, h): h for h in actors}


def assert_same(local: dict[str, Trajectory], trajs: Sequence[Trajectory], everyone: bool = True) -> None:
    """Token-identical to the local run (logprobs within float noise of another batch mix)."""
    assert len({t.id for t in trajs}) == len(trajs) and {t.id for t in trajs} <= set(local)
    assert len(trajs) == len(local) or not everyone
    for traj in trajs:
        ref = local[traj.id]
        assert traj.stop_reason == ref.stop_reason and traj.error is None
        assert (traj.prompt_ids, traj.response_ids, traj.loss_mask) == (
            ref.prompt_ids,
            ref.response_ids,
            ref.loss_mask,
        )
        assert [t.text for t in traj.turns] == [t.text for t in ref.turns]
        assert traj.rollout_logprobs == pytest.approx(ref.rollout_logprobs, abs=1e-4)


def served(engine: RegistryEngine) -> dict[str, int]:
    return {s.name: s.served for s in engine.balancer.stats}


async def test_rollout_on_registered_engine_actors_equals_local_and_streams(
    hosts: dict[str, Any], local: dict[str, Trajectory], tiny_qwen3_dir: Path, tmp_path: Path
) -> None:
    prepared = ready(on_registry(tmp_path, tiny_qwen3_dir))
    engine = prepared.spec.engine
    assert isinstance(engine, RegistryEngine) and sorted(engine.names()) == sorted(hosts)
    arrivals: list[tuple[Trajectory, int]] = []  # each trajectory, and the generations in flight then
    try:
        async for traj in iter_trajectories(prepared.samples, prepared.spec, group_size=2, concurrency=8):
            arrivals.append((traj, sum(s.in_flight for s in engine.balancer.stats)))
    finally:
        await engine.close()
    assert_same(local, [t for t, _ in arrivals])
    assert any(in_flight for _, in_flight in arrivals[:-1])  # streamed: others were still generating
    assert all(count > 0 for count in served(engine).values())  # both actors took work
    assert ray.get([h.ping.remote() for h in hosts.values()]) == [True, True]  # close left them running


async def test_an_engine_registered_mid_rollout_receives_trajectories(
    hosts: dict[str, Any], local: dict[str, Trajectory], tiny_qwen3_dir: Path, tmp_path: Path
) -> None:
    registry = get_registry(REGISTRY)
    late, handle = sorted(hosts.items())[1]
    [entry] = [e for e in ray.get(registry.entries.remote())[1] if e.name == late]
    assert ray.get(registry.unregister.remote(late))  # it leaves, to come back mid-rollout
    prepared = ready(on_registry(tmp_path, tiny_qwen3_dir))
    engine = prepared.spec.engine
    assert isinstance(engine, RegistryEngine) and len(engine.names()) == 1
    joined: list[int] = []

    def on_done(traj: Trajectory) -> None:
        if not joined:  # the first trajectory is back: the engine registers (again)
            joined.append(len(engine.names()))
            registry.register.remote(entry)

    trajs = await collect(prepared.samples, prepared.spec, group_size=2, concurrency=2, on_done=on_done)
    assert joined == [1] and sorted(engine.names()) == sorted(hosts)
    assert engine.engine_stats(late).served > 0  # it took trajectories started after it joined
    assert_same(local, trajs)  # which engine runs a trajectory does not change its tokens
    ray.get(registry.unregister.remote(late))
    await engine.refresh()
    assert late not in engine.names()  # it left: retired from the balancer
    before = served(engine)[late]
    await collect(prepared.samples[:1], prepared.spec, group_size=2)
    assert served(engine)[late] == before  # and gets no more work
    ray.get(registry.register.remote(entry))  # back for the next test
    await engine.close()
    assert ray.get(handle.ping.remote())


async def test_engine_served_from_a_node_then_killed_mid_rollout_loses_nothing(
    ray_cluster: str,
    hosts: dict[str, Any],
    local: dict[str, Trajectory],
    tiny_qwen3_dir: Path,
    tmp_path: Path,
) -> None:
    config = tmp_path / "node.yaml"
    config.write_text(on_registry(tmp_path, tiny_qwen3_dir, replicas=1, num_cpus=0.5).model_dump_json())
    node = subprocess.Popen(
        [sys.executable, "-m", "turnrl.cli", "serve", str(config), "--address", ray_cluster],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    registry = get_registry(REGISTRY)
    try:
        entries = await wait_for_more(registry, set(hosts), node)
        [entry] = [e for e in entries if e.name not in hosts]
        prepared = ready(on_registry(tmp_path, tiny_qwen3_dir))
        engine = prepared.spec.engine
        assert isinstance(engine, RegistryEngine)
        victim = engine.engine_stats(entry.name)
        run = asyncio.create_task(collect(prepared.samples, prepared.spec, group_size=2, concurrency=8))
        deadline = time.monotonic() + 30
        while victim.in_flight == 0 and time.monotonic() < deadline:  # wait for calls on the new engine
            await asyncio.sleep(0.005)
        assert victim.in_flight > 0
        ray.kill(entry.handle)
        trajs = await asyncio.wait_for(run, 60)
        assert victim.failures >= 1  # calls were in flight on it when it died
        assert_same(local, trajs)  # no trajectory lost, none cut: moved calls are re-run with their seeds
        deadline = time.monotonic() + 10
        while entry.name in engine.names() and time.monotonic() < deadline:
            await engine.refresh()  # the registry's health check drops it; the driver retires it
            await asyncio.sleep(0.1)
        assert sorted(engine.names()) == sorted(hosts)
        dropped = ray.get(registry.dropped_entries.remote())
        assert any(name == entry.name and "died" in why for name, why in dropped)
        await engine.close()
    finally:
        node.send_signal(signal.SIGTERM)
        out, err = node.communicate(timeout=30)
    assert node.returncode == 0, err
    assert f"registered {entry.name}" in out


async def test_replicas_started_by_the_driver_without_a_registry(
    ray_cluster: str, local: dict[str, Trajectory], tiny_qwen3_dir: Path, tmp_path: Path
) -> None:
    prepared = ready(run_config(tiny_qwen3_dir, tmp_path, enabled=True, replicas=1, num_cpus=0))
    engine = prepared.spec.engine
    assert isinstance(engine, BalancedEngine) and isinstance(engine.engines[0], RayEngine)
    try:
        trajs = await collect(prepared.samples[:2], prepared.spec, group_size=2, concurrency=4)
    finally:
        await engine.close()  # the driver's own actor is stopped with it
    assert_same(local, trajs, everyone=False)
    with pytest.raises(ray.exceptions.RayActorError):
        await engine.engines[0].handle.ping.remote()


async def wait_for_more(registry: Any, known: set[str], node: subprocess.Popen[str]) -> list[Any]:
    """The registry's entries once one more than ``known`` is listed (the node's engine is up)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        _, entries = await registry.entries.remote()
        if len(entries) > len(known):
            return list(entries)
        if node.poll() is not None:
            raise AssertionError(f"serve exited: {node.communicate()[1][-2000:]}")
        await asyncio.sleep(0.2)
    raise AssertionError("the node's engine never registered")


class ToyEngine:
    """An engine without a model: replies [prompt length], refuses empty prompts, waits on long ones."""

    def __init__(self) -> None:
        self.version = 0

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[Any] = (),
        *,
        session: str | None = None,
    ) -> Generation:
        if not prompt_ids:
            raise RequestError("empty prompt")
        if len(prompt_ids) > 100:
            await asyncio.sleep(3600)
        return Generation([len(prompt_ids)], [-0.5], "stop", {"session": session, "version": self.version})

    async def abort_all(self) -> None:
        pass

    async def update_weights(self, weights: Any, *, version: int | None = None) -> int:
        self.version = self.version + 1 if version is None else version
        return self.version

    async def close(self) -> None:
        pass


async def test_ray_engine_proxies_calls_and_errors(ray_cluster: str) -> None:
    handle = start_engine_actor(ToyEngine, num_cpus=0)
    engine = RayEngine(handle, "toy", owned=True)
    try:
        gen = await engine.generate([1, 2, 3], SamplingParams(), session="s")
        assert (gen.token_ids, gen.info) == ([3], {"session": "s", "version": 0})
        with pytest.raises(RequestError, match="empty prompt"):  # the engine's own error, not Ray's
            await engine.generate([], SamplingParams())
        hung = asyncio.create_task(engine.generate(list(range(200)), SamplingParams()))
        await asyncio.sleep(0.2)
        hung.cancel()  # cancelling the caller cancels the call in the actor
        with pytest.raises(asyncio.CancelledError):
            await hung
        await engine.abort_all()
        assert await engine.update_weights({}, version=4) == 4 and engine.weight_version == 4
    finally:
        await engine.close()  # owned: the actor is killed
    with pytest.raises(ray.exceptions.RayActorError):
        await handle.ping.remote()


async def test_an_engine_joining_after_a_weight_update_gets_the_weights_first(ray_cluster: str) -> None:
    registry = get_registry("test-weights", health_interval_s=60)
    first, second = (start_engine_actor(ToyEngine, num_cpus=0) for _ in range(2))
    try:
        await asyncio.to_thread(register_actor, registry, first, "first")
        engine = RegistryEngine(registry, (await registry.entries.remote())[1], refresh_s=60)
        assert (await engine.generate([1], SamplingParams())).info == {
            "session": None,
            "version": 0,
            "engine": "first",
        }
        assert await engine.update_weights({"w": 1}, version=5) == 5
        await asyncio.to_thread(register_actor, registry, second, "second")
        await engine.refresh()
        assert engine.engine_stats("second").weight_version == 5
        gen = await engine.generate([1], SamplingParams(), session="new")
        assert gen.info == {"session": "new", "version": 5, "engine": "second"}  # the newcomer, updated
        await engine.close()
        assert await first.ping.remote() and await second.ping.remote()  # registered engines stay up
    finally:
        ray.kill(first)
        ray.kill(second)


class Health(http.server.BaseHTTPRequestHandler):
    """Answers /health with 200."""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


async def test_registry_drops_dead_servers_and_actors_and_lists_the_rest(ray_cluster: str) -> None:
    registry = get_registry("test-health", health_interval_s=0.1)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    up = f"http://127.0.0.1:{server.server_address[1]}"
    actor = start_engine_actor(ToyEngine, num_cpus=0)
    names = [
        register_server(registry, up, dialect="llamacpp"),
        await asyncio.to_thread(register_actor, registry, actor, "toy"),
        register_server(registry, f"http://127.0.0.1:{free_port()}", name="nobody-home"),
    ]
    assert names == [up, "toy", "nobody-home"]
    assert await wait_listed(registry, {up, "toy"})  # the unreachable server went after 3 misses
    ray.kill(actor)
    assert await wait_listed(registry, {up})
    dropped = dict(await registry.dropped_entries.remote())
    assert "died" in dropped["toy"] and "ConnectError" in dropped["nobody-home"]
    server.shutdown()
    server.server_close()
    assert await wait_listed(registry, set())
    register_server(registry, up)
    assert await registry.unregister.remote(up) and not await registry.unregister.remote(up)


async def wait_listed(registry: Any, names: set[str], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, entries = await registry.entries.remote()
        if {e.name for e in entries} == names:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_registry_engine_builds_clients_for_registered_servers(
    ray_cluster: str, qwen3_tokenizer: Any
) -> None:
    registry = get_registry("test-servers", health_interval_s=60)
    register_server(registry, "http://127.0.0.1:9", dialect="llamacpp", served_model="m")  # never called
    entries = (await registry.entries.remote())[1]
    config = OpenAIEngineConfig(kind="openai", urls=["http://127.0.0.1:9"], timeout_s=5)

    engine = RegistryEngine(registry, entries, make_server=partial(server_for_entry, config, qwen3_tokenizer))
    [client] = engine.balancer.engines
    assert isinstance(client, OpenAIEngine) and client.base_url == "http://127.0.0.1:9"
    assert (client.dialect, client.model) == ("llamacpp", "m")
    await engine.close()


def test_config_switch_defaults_off_and_needs_an_engine_source(ray_cluster: str) -> None:
    assert HFEngineConfig().ray.enabled is False and RayEngineConfig().replicas == 1
    with pytest.raises(ValueError, match="extra"):
        RayEngineConfig.model_validate({"enabled": True, "workers": 3})
    config = HFEngineConfig(ray=RayEngineConfig(enabled=True, replicas=0))
    with pytest.raises(ValueError, match=r"needs engine\.ray\.registry"):
        ray_engine("tiny-qwen3", config)
    servers = OpenAIEngineConfig(kind="openai", urls=["http://x:1"], ray=RayEngineConfig(enabled=True))
    with pytest.raises(ValueError, match=r"server engine needs engine\.ray\.registry"):
        ray_engine("tiny-qwen3", servers)


def test_importing_configs_does_not_import_ray() -> None:
    code = (
        "import sys, turnrl.config as c, turnrl.distributed as d; c.HFEngineConfig().ray; d.RayEngineConfig;"
        " assert 'ray' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})
