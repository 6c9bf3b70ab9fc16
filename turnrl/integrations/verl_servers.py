"""verl's agent loop on vLLM servers reached by URL (started by turnrl, or by anyone).

verl's rollout workers ask ``LLMServerClient.generate`` for tokens; the client asks verl's
``GlobalRequestLoadBalancer`` (a Ray actor: sticky request ids, least in flight) for a server
handle and calls ``handle.generate.remote(request_id=..., prompt_ids=..., sampling_params=...)``.
verl's own handles run vLLM inside Ray actors it places on GPUs. ``VLLMServerHandle`` is such a
handle over one running vLLM server's HTTP API instead (token ids in, token ids and logprobs out,
through turnrl's ``VLLMServerEngine``), and ``server_client`` builds verl's balancer and client
over several, so verl's ``AgentLoopWorker`` (and the turnrl agent loop inside it) runs unchanged
against servers on other machines or processes, e.g. those ``engine.kind: vllm`` starts.

The handle answers the way verl's vLLM server does: ``max_tokens`` (or ``max_new_tokens``) and
``logprobs`` are taken out, ``stop_reason`` is ``completed`` or ``aborted``, ``extra_fields`` hold
``global_steps`` (set by :meth:`VLLMServerHandle.set_global_steps` after a weight update); the other
sampling params (``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop_token_ids``,
``repetition_penalty``, ...) go to vLLM as they are. ``image_data`` (verl's PIL images, every
image of the conversation so far) goes with the token ids to vLLM's generate endpoint when the
handle knows the model's image token (``image_token_id``; the servers of a VLM that turnrl starts
enable that endpoint); videos are refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import ray
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput
from verl.workers.rollout.router import get_router_handle

from turnrl.engines.vllm import VLLMServerEngine
from turnrl.types import SamplingParams

_OWN = ("temperature", "top_p", "top_k", "seed", "stop_token_ids")


def sampling_from_verl(params: Mapping[str, Any]) -> tuple[SamplingParams, bool, dict[str, Any]]:
    """verl's sampling params as (turnrl sampling, whether logprobs are wanted, the rest for vLLM)."""
    rest = {k: v for k, v in params.items() if v is not None}
    max_tokens = rest.pop("max_tokens", None)
    max_tokens = rest.pop("max_new_tokens", max_tokens)
    if max_tokens is None:
        raise ValueError("verl's sampling params name no max_tokens")
    logprobs = bool(rest.pop("logprobs", False))
    own = {k: rest.pop(k) for k in _OWN if k in rest}
    seed = own.get("seed")
    sampling = SamplingParams(
        temperature=float(own.get("temperature", 1.0)),
        top_p=float(own.get("top_p", 1.0)),
        top_k=max(int(own.get("top_k", 0)), 0),
        max_tokens=int(max_tokens),
        stop_token_ids=tuple(int(t) for t in own.get("stop_token_ids") or ()),
        seed=int(seed) if seed is not None else None,
    )
    return sampling, logprobs, rest


class VLLMServerHandle:
    """verl's rollout-server interface over one running vLLM server (wrap it with ``ray.remote``)."""

    def __init__(
        self,
        url: str,
        eos_token_ids: Iterable[int] = (),
        timeout_s: float = 600.0,
        image_token_id: int | None = None,
    ) -> None:
        self.url = url
        self._eos = [int(t) for t in eos_token_ids]
        self._timeout_s = timeout_s
        self._image_token_id = image_token_id
        self._engines: dict[str, VLLMServerEngine] = {}  # one per set of pass-through params
        self.global_steps: int | None = None

    def _engine(self, extra: dict[str, Any]) -> VLLMServerEngine:
        key = json.dumps(extra, sort_keys=True, default=str)
        if key not in self._engines:
            self._engines[key] = VLLMServerEngine(
                self.url,
                eos_token_ids=self._eos,
                timeout_s=self._timeout_s,
                request_params=extra,
                image_token_id=self._image_token_id,
            )
        return self._engines[key]

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """One generation, answered as verl's vLLM server answers it."""
        if video_data:
            raise ValueError(f"{self.url}: turnrl's vLLM client sends no videos")
        sampling, logprobs, extra = sampling_from_verl(sampling_params)
        gen = await self._engine(extra).generate(list(prompt_ids), sampling, list(image_data or ()))
        return TokenOutput(
            token_ids=list(gen.token_ids),
            log_probs=list(gen.logprobs) if logprobs else None,
            stop_reason="aborted" if gen.finish_reason == "abort" else "completed",
            extra_fields={"global_steps": self.global_steps, "server": self.url},
        )

    def set_global_steps(self, steps: int | None) -> None:
        """The weight version this server's answers report (verl's ``global_steps``)."""
        self.global_steps = steps

    async def close(self) -> None:
        """Close the connections to the server."""
        for engine in self._engines.values():
            await engine.close()
        self._engines.clear()


def server_handles(
    urls: Sequence[str],
    *,
    eos_token_ids: Iterable[int] = (),
    timeout_s: float = 600.0,
    image_token_id: int | None = None,
) -> dict[str, Any]:
    """One ``VLLMServerHandle`` Ray actor per URL (no CPU reserved: the work is the server's);
    ``image_token_id``: a VLM's image token, for turns with images."""
    actor = ray.remote(VLLMServerHandle).options(num_cpus=0)
    eos = [int(t) for t in eos_token_ids]
    return {url: actor.remote(url, eos, timeout_s, image_token_id) for url in urls}


def server_client(config: Any, handles: Mapping[str, Any]) -> LLMServerClient:
    """verl's ``LLMServerClient`` over ``handles`` behind verl's own load balancer; ``config`` is
    verl's trainer config (the client reads ``actor_rollout_ref.rollout`` from it)."""
    rollout = config.actor_rollout_ref.rollout
    balancer = get_router_handle(
        servers=dict(handles),
        router_config_path=getattr(rollout, "router_config_path", None),
        full_determinism=bool(getattr(rollout, "full_determinism", False)),
    )
    return LLMServerClient(config, balancer)
