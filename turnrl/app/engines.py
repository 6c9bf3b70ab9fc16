"""Engines from configs: embedded, vLLM in process, servers by URL (balanced), and on Ray."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from turnrl.config import (
    AnyEngineConfig,
    EngineConfig,
    HFEngineConfig,
    OpenAIEngineConfig,
    RayEngineConfig,
    ScriptedEngineConfig,
    SGLangEngineConfig,
    VLLMEngineConfig,
)
from turnrl.models import (
    load_model,
    load_tokenizer,
    load_vision_processor,
    model_folder,
    resolve_model,
    stop_token_ids,
)
from turnrl.support.imports import import_object
from turnrl.types import Engine

if TYPE_CHECKING:
    from turnrl.distributed.registry import EngineEntry
    from turnrl.engines.balancer import BalancedEngine
    from turnrl.engines.hf import HFEngine

ServerConfig = OpenAIEngineConfig | SGLangEngineConfig


class EngineSetupError(ValueError):
    """An engine that cannot be built from its config; the message says why."""


Say = Callable[[str], None]  # where a long set-up step reports progress


class EngineSections(Protocol):
    """What building an engine reads of a config (a run's, or the gateway's)."""

    @property
    def model(self) -> str: ...
    @property
    def engine(self) -> EngineConfig: ...
    @property
    def seed(self) -> int: ...


def build_engine(
    config: EngineSections, log_dir: Path | None = None, say: Say | None = None
) -> tuple[Engine, Any]:
    """The engine and the tokenizer for ``config.model``: in this process, or on Ray (``engine.ray``).

    Servers turnrl starts (``kind: vllm`` without ``urls``) log into ``log_dir``; ``say`` gets a
    progress line while they start.
    """
    e = config.engine
    if isinstance(e, ScriptedEngineConfig):
        return scripted_engine(config.model, e)
    if e.ray.enabled:
        return ray_engine(config.model, e)
    return local_engine(config.model, e, log_dir=log_dir, say=say, seed=config.seed)


def scripted_engine(model: str, e: ScriptedEngineConfig) -> tuple[Engine, Any]:
    """The policy function of ``engine.policy`` playing in place of a model, with the model's tokenizer."""
    from turnrl.engines.scripted import ScriptedEngine, policy_replies

    tokenizer = load_tokenizer(model)
    policy = import_object(e.policy, "engine.policy")
    return ScriptedEngine(tokenizer, policy_replies(policy), logprob=e.logprob), tokenizer


def local_engine(
    model: str, e: AnyEngineConfig, *, log_dir: Path | None = None, say: Say | None = None, seed: int = 0
) -> tuple[Engine, Any]:
    """The engine ``e`` describes, in this process (servers: their clients), and the tokenizer."""
    if isinstance(e, HFEngineConfig):
        engine = hf_engine(model, e)
        return engine, engine.tokenizer
    tokenizer = load_tokenizer(model)
    if isinstance(e, VLLMEngineConfig) and e.in_process:
        from turnrl.engines.vllm_inproc import VLLMEngine

        return VLLMEngine(resolve_model(model).path, **e.engine_args), tokenizer
    if isinstance(e, VLLMEngineConfig):
        return vllm_engine(model, e, tokenizer, log_dir=log_dir, say=say, seed=seed), tokenizer
    return server_engine(e, tokenizer), tokenizer


def vllm_engine(
    model: str,
    e: VLLMEngineConfig,
    tokenizer: Any,
    *,
    log_dir: Path | None = None,
    say: Say | None = None,
    seed: int = 0,
) -> Engine:
    """Clients for vLLM servers: ``e.urls``, else ``e.servers`` servers started here for ``model``
    (stopped when the engine closes); several go behind the balancer. A VLM's turns with images
    go to vLLM's token-in generate endpoint, which its managed servers enable (``--enable-scale-out``),
    as every turn does with ``keep_in_flight``."""
    from turnrl.engines.managed import ManagedEngine
    from turnrl.engines.process import launch_all
    from turnrl.engines.vllm_server import servers_for

    vision = load_vision_processor(model, tokenizer)
    servers = []
    urls = list(e.urls)
    token_in = vision or e.keep_in_flight  # turns go to the generate endpoint
    if not urls:
        folder = model_folder(model)
        servers = list(
            servers_for(
                folder,
                e.servers,
                log_dir,
                python=e.python,
                max_model_len=e.max_model_len,
                dtype=e.dtype,
                kv_cache_gib=e.kv_cache_gib,
                seed=seed,
                args={"enable_scale_out": True} | e.server_args if token_in else e.server_args,
            )
        )
        started = time.monotonic()

        def waiting(_: float) -> None:
            if say is not None:
                say(f"starting {len(servers)} vLLM server(s) for {model}: {time.monotonic() - started:.0f}s")

        launch_all(servers, e.start_timeout_s, waiting)
        urls = [s.url for s in servers]
    image_token = vision.image_token_id if vision else None
    engine = _vllm_clients(e, stop_token_ids(model, tokenizer), urls, image_token, managed=bool(servers))
    return ManagedEngine(engine, servers) if servers else engine


def _vllm_clients(
    e: VLLMEngineConfig, eos: list[int], urls: list[str], image_token: int | None, *, managed: bool
) -> Engine:
    """One streaming client per server; several behind the balancer, sharing one weights folder.
    Servers turnrl started (``managed``) run its worker extension; others when the config says so."""
    from turnrl.engines.balancer import BalancedEngine
    from turnrl.engines.vllm import VLLMServerEngine

    key = os.environ.get(e.api_key_env) if e.api_key_env else None
    engines: list[Engine] = [
        VLLMServerEngine(
            url,
            eos_token_ids=eos,
            api_key=key,
            timeout_s=e.timeout_s,
            max_retries=e.max_retries,
            retry_budget_s=e.retry_budget_s,
            weights_dir=e.weights_dir,
            request_params=e.request_params,
            image_token_id=image_token,
            refresh_tied_weights=managed if e.refresh_tied_weights is None else e.refresh_tied_weights,
            keep_in_flight=e.keep_in_flight,
            weight_sync=e.weight_sync if managed else e.sync_way(on_gpu=False),
            weight_sync_host=e.weight_sync_host,
        )
        for url in urls
    ]
    if len(engines) == 1:
        return engines[0]
    return BalancedEngine(engines, **e.balancer.model_dump())


def hf_engine(model: str, e: HFEngineConfig | None = None, **overrides: Any) -> HFEngine:
    """The embedded engine serving ``model`` (a shipped name, folder or cached hub id), with its
    tokenizer and, for VLMs, its image processor; ``overrides`` go to ``HFEngine`` as they are."""
    from turnrl.engines.hf import HFEngine

    e = e or HFEngineConfig()
    spec = resolve_model(model)
    tokenizer = load_tokenizer(spec)
    kwargs = hf_engine_options(e) | {"vision": load_vision_processor(spec, tokenizer)}
    return HFEngine(load_model(spec, dtype=e.dtype, device=e.device), tokenizer, **(kwargs | overrides))


def hf_engine_options(e: HFEngineConfig) -> dict[str, Any]:
    """``HFEngine``'s keyword arguments from the ``hf`` engine section."""
    return {
        "max_batch_size": e.max_batch_size,
        "max_prefill_tokens": e.max_prefill_tokens,
        "prefix_cache_tokens": e.prefix_cache_tokens,
        "num_threads": e.num_threads,
        "packed_weights": e.packed_weights,
        "cuda_graphs": e.cuda_graphs,
    }


def server_engine(e: ServerConfig, tokenizer: Any) -> Engine:
    """OpenAI-compatible or SGLang servers; several URLs go behind a load balancer."""
    from turnrl.engines.balancer import BalancedEngine
    from turnrl.engines.openai import OpenAIEngine
    from turnrl.engines.sglang import SGLangEngine

    eos = [i for i in (tokenizer.eos_token_id,) if i is not None]
    key = os.environ.get(e.api_key_env) if e.api_key_env else None
    common: dict[str, Any] = {
        "eos_token_ids": eos,
        "api_key": key,
        "timeout_s": e.timeout_s,
        "max_retries": e.max_retries,
        "retry_budget_s": e.retry_budget_s,
    }
    engines: list[Engine] = [
        OpenAIEngine(url, e.served_model, dialect=e.dialect, **common)
        if isinstance(e, OpenAIEngineConfig)
        else SGLangEngine(url, **common)
        for url in e.urls
    ]
    if len(engines) == 1:
        return engines[0]
    return BalancedEngine(engines, **e.balancer.model_dump())


@dataclass(frozen=True)
class EngineBuild:
    """How a Ray engine host builds its engine: ``model`` and ``engine`` as a run config gives them."""

    model: str  # HF id, local folder or shipped name, resolved on the host's node
    engine: HFEngineConfig | VLLMEngineConfig  # its ``ray`` section is ignored: the host runs it in-process

    def __call__(self) -> Engine:
        """The engine, built as ``turnrl rollout`` builds it without Ray."""
        engine, _ = local_engine(self.model, self.engine.model_copy(update={"ray": RayEngineConfig()}))
        return engine


def server_for_entry(config: AnyEngineConfig, tokenizer: Any, entry: EngineEntry) -> Engine:
    """The driver's client for a registered server, with the driver's timeouts and retries."""
    base = config.model_dump(include={"api_key_env", "timeout_s", "max_retries", "retry_budget_s"})
    server: ServerConfig
    if entry.kind == "sglang":
        server = SGLangEngineConfig(kind="sglang", urls=[entry.url], **base)
    else:
        served = {"served_model": entry.served_model} if entry.served_model else {}
        server = OpenAIEngineConfig(kind="openai", urls=[entry.url], dialect=entry.dialect, **served, **base)
    return server_engine(server, tokenizer)


def ray_engine(model: str, config: AnyEngineConfig) -> tuple[BalancedEngine | Engine, Any]:
    """What ``engine.ray`` asks for; blocks until its engines are up.

    Embedded kinds (``hf``, ``vllm``): ``replicas`` engine actors, each building ``model`` with
    this config. Server kinds (``openai``, ``sglang``): ``engine.urls`` are registered as
    servers (a registry is needed). Without a registry, a balancer over the actors; with one,
    a RegistryEngine over everything registered there (waiting for ``min_engines``).
    """
    try:
        from turnrl.distributed import ray_engines as re
        from turnrl.distributed.registry_engine import RegistryEngine
        from turnrl.engines.balancer import BalancedEngine
    except ImportError as exc:
        raise EngineSetupError(f"engine.ray.enabled needs ray: pip install 'turnrl[ray]' ({exc})") from None
    rc = config.ray
    server = config if isinstance(config, OpenAIEngineConfig | SGLangEngineConfig) else None
    if rc.registry is None and (server or rc.replicas == 0):
        what = "a server engine" if server else "replicas: 0"
        raise EngineSetupError(
            f"engine.ray with {what} needs engine.ray.registry (where other nodes register)"
        )
    balancer = server.balancer.model_dump() if server else {}
    tokenizer = load_tokenizer(model)
    re.connect(rc.address)
    handles = []
    if not isinstance(config, OpenAIEngineConfig | SGLangEngineConfig):
        handles = [re.start_replica(EngineBuild(model, config), rc) for _ in range(rc.replicas)]
    try:
        infos = re.wait_ready(handles, rc.start_timeout_s)
        if rc.registry is None:
            names = [re.actor_name(info) for info in infos]
            engines: list[Engine] = [
                re.RayEngine(h, n, owned=True) for h, n in zip(handles, names, strict=True)
            ]
            return BalancedEngine(engines, names=names, **balancer), tokenizer
        registry = re.get_registry(rc.registry, rc.namespace, health_interval_s=rc.health_interval_s)
        owned = [re.register_actor(registry, h) for h in handles]
        if server:
            owned += [re.register_server(registry, url, **_registration(server)) for url in server.urls]
        entries = re.wait_for_entries(registry, rc.min_engines, rc.start_timeout_s)
    except TimeoutError as exc:
        raise EngineSetupError(str(exc)) from None
    except BaseException:
        for handle in handles:
            re.kill(handle)
        raise
    make_server = partial(server_for_entry, config, tokenizer)
    engine = RegistryEngine(
        registry, entries, make_server=make_server, refresh_s=rc.refresh_s, owned=owned, **balancer
    )
    return engine, tokenizer


def _registration(config: ServerConfig) -> dict[str, Any]:
    """register_server's keyword arguments for the servers of ``config``."""
    if isinstance(config, SGLangEngineConfig):
        return {"kind": "sglang", "dialect": "sglang", "served_model": None}
    return {"kind": "openai", "dialect": config.dialect, "served_model": config.served_model}
