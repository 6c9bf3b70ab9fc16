"""An engine for OpenAI-compatible ``/v1/completions`` servers, with token ids in and out.

The prompt is always sent as token ids (never text), and the sampled token ids come back
with their logprobs; text is never re-tokenized. Three servers speak slightly different
dialects of the same endpoint:

- ``vllm`` (vLLM >= 0.10.2): ``return_token_ids`` gives ``choices[0].token_ids``;
  ``return_tokens_as_token_ids`` makes ``logprobs.tokens`` read ``"token_id:123"`` (used
  when ``token_ids`` is absent, on older versions); ``logprobs: 0`` returns the sampled
  token's logprob only. vLLM's logprobs are by default those of the raw model
  (temperature 1); start vLLM with ``--logprobs-mode processed_logprobs`` for logprobs at
  the sampling temperature (which are also renormalized after top-k / top-p).
- ``sglang``: ``return_token_ids`` (recent SGLang) gives ``choices[0].token_ids``; older
  versions return no ids on this endpoint: use :class:`turnrl.engines.sglang.SGLangEngine`
  (the native ``/generate``) there.
- ``llamacpp`` (llama.cpp's ``llama-server``): ``logprobs: 1`` returns
  ``logprobs.content[i] = {id, logprob, ...}``, so ids and logprobs come together. Its
  logprobs before sampling are ``softmax(logits)`` at temperature 1, exactly what
  ``Generation`` asks for when the temperature is 0 or 1. At another temperature the
  engine asks for probabilities after the sampler chain (``post_sampling_probs``), which
  equal ``softmax(logits / T)`` over the whole vocabulary only without top-k / top-p
  (``min_p`` is always sent as 0); with them, ``info["logprobs_after_filter"]`` is set.
  llama-server has no per-request stop token ids: the engine cuts the output after the
  first one itself (the server may have sampled a few tokens past it).

``finish_reason`` "stop" / "length" map over; anything else becomes "abort". When the server
stopped on eos, every dialect above returns the eos id with its logprob (checked for
llama-server in the tests); if the last token is not a known stop id,
``info["stop_token_missing"]`` is set so a caller can see the gap.

Partial rollout: completions are not streamed, so :meth:`OpenAIEngine.abort_all` cancels
the HTTP requests in flight (closing their connections, which the servers take as an
abort) and each of those ``generate`` calls returns ``Generation([], [], "abort")``: no
partial tokens come back, so on resume the turn is sampled again from its start. Weight
updates (:meth:`OpenAIEngine.update_weights`) exist for the ``sglang`` dialect only
(``/update_weights_from_disk``, a checkpoint path on the server's disk); for vLLM use
``engine.kind: vllm`` (:class:`turnrl.engines.vllm.VLLMServerEngine`, in-place reloads);
llama-server has no such endpoint.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import httpx

from turnrl.engines.http import JsonClient, RequestError, RetryPolicy, finish, present, require
from turnrl.engines.sglang import checkpoint_path, post_update_weights_from_disk
from turnrl.types import EngineError, Generation, SamplingParams, Weights

Dialect = Literal["vllm", "sglang", "llamacpp"]
DIALECTS: tuple[Dialect, ...] = ("vllm", "sglang", "llamacpp")
_TOKEN_ID_PREFIX = "token_id:"


def completion_payload(
    dialect: Dialect, prompt_ids: Sequence[int], sampling: SamplingParams, model: str | None
) -> dict[str, Any]:
    """The ``/v1/completions`` request body for one generation in ``dialect``."""
    body: dict[str, Any] = {
        "prompt": [int(t) for t in prompt_ids],
        "max_tokens": sampling.max_tokens,
        "temperature": max(sampling.temperature, 0.0),
        "top_p": sampling.top_p,
        "n": 1,
        "stream": False,
    }
    if model:
        body["model"] = model
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if dialect == "llamacpp":
        body |= _llamacpp_fields(sampling)
    else:
        body |= {
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "logprobs": 0 if dialect == "vllm" else 1,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if dialect == "vllm":
            body["return_tokens_as_token_ids"] = True
        if sampling.stop_token_ids:
            body["stop_token_ids"] = list(sampling.stop_token_ids)
    return body


def _llamacpp_fields(sampling: SamplingParams) -> dict[str, Any]:
    """llama-server's extra fields: full-vocabulary probabilities, no hidden samplers."""
    return {
        "top_k": max(sampling.top_k, 0),
        "min_p": 0.0,  # llama-server's default (0.05) would filter silently
        "typical_p": 1.0,
        "repeat_penalty": 1.0,
        "logprobs": 1,
        "post_sampling_probs": _llamacpp_post_sampling(sampling),
        "cache_prompt": True,
    }


def _llamacpp_post_sampling(sampling: SamplingParams) -> bool:
    """Whether llama-server must report probabilities after its sampler chain (temperature != 1)."""
    return sampling.temperature > 0 and sampling.temperature != 1.0


def _vllm_ids(choice: Mapping[str, Any], logprobs: Mapping[str, Any]) -> list[int]:
    """Sampled ids from ``token_ids``, else from ``"token_id:N"`` strings in ``logprobs.tokens``."""
    ids = choice.get("token_ids")
    if ids is not None:
        return [int(t) for t in ids]
    tokens = logprobs.get("tokens") or []
    require(
        all(isinstance(t, str) and t.startswith(_TOKEN_ID_PREFIX) for t in tokens),
        "the server returned no token ids (needs vLLM >= 0.10.2 or SGLang with return_token_ids; "
        "for older SGLang use SGLangEngine)",
    )
    return [int(t[len(_TOKEN_ID_PREFIX) :]) for t in tokens]


def parse_openai_choice(choice: Mapping[str, Any]) -> tuple[list[int], list[float]]:
    """Token ids and logprobs of a vLLM / SGLang completion choice."""
    logprobs = choice.get("logprobs") or {}
    ids = _vllm_ids(choice, logprobs)
    values = present(logprobs.get("token_logprobs"), "the server returned no logprobs")
    require(all(v is not None for v in values), "the server returned a null logprob")
    return ids, [float(v) for v in values]


def parse_llamacpp_choice(choice: Mapping[str, Any], post_sampling: bool) -> tuple[list[int], list[float]]:
    """Token ids and logprobs from llama-server's ``logprobs.content`` entries."""
    content = present(
        (choice.get("logprobs") or {}).get("content"),
        "llama-server returned no logprobs.content (is it llama.cpp?)",
    )
    ids = [int(entry["id"]) for entry in content]
    if post_sampling:
        values = [math.log(p) if (p := float(entry["prob"])) > 0 else -math.inf for entry in content]
    else:
        values = [float(entry["logprob"]) for entry in content]
    return ids, values


class OpenAIEngine:
    """Generates through an OpenAI-compatible ``/v1/completions`` endpoint, token ids in and out."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        dialect: Dialect = "vllm",
        eos_token_ids: Iterable[int] = (),
        api_key: str | None = None,
        timeout_s: float = 300.0,
        max_retries: int = 3,
        retry_budget_s: float = 600.0,
        backoff_s: float = 0.25,
        extra_body: Mapping[str, Any] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """``base_url`` is the server root (``http://127.0.0.1:8000``, a trailing ``/v1`` is fine).

        ``eos_token_ids`` are the model's stop ids: output is cut after the first of them
        (or of a request's ``stop_token_ids``), and a "stop" without one is flagged in
        ``info``. ``extra_body`` is merged into every request (server-specific options).
        """
        if dialect not in DIALECTS:
            raise ValueError(f"unknown dialect {dialect!r}; expected one of {', '.join(DIALECTS)}")
        root = base_url.rstrip("/")
        root = root[: -len("/v1")] if root.endswith("/v1") else root
        retry = RetryPolicy(max_retries=max_retries, budget_s=retry_budget_s, backoff_s=backoff_s)
        self._client = JsonClient(
            root, api_key=api_key, timeout_s=timeout_s, retry=retry, transport=transport
        )
        self.model = model
        self.dialect: Dialect = dialect
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self._extra = dict(extra_body or {})
        self._in_flight: set[asyncio.Task[Any]] = set()
        self._aborted: set[asyncio.Task[Any]] = set()
        self._version = 0

    @property
    def weight_version(self) -> int:
        """The version of the last weight update made through this engine (0 before any)."""
        return self._version

    @property
    def base_url(self) -> str:
        """The server root this engine talks to."""
        return self._client.base_url

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[Any] = (),
        *,
        session: str | None = None,
    ) -> Generation:
        """Sample a continuation of ``prompt_ids``; ``session`` is accepted for the balancer and unused."""
        if images:
            raise RequestError(
                "OpenAIEngine sends token ids to /v1/completions, which takes no images: "
                "use the SGLang engine (kind: sglang, image_data) or vLLM in process for VLMs"
            )
        if not prompt_ids:
            raise RequestError("empty prompt")
        body = completion_payload(self.dialect, prompt_ids, sampling, self.model) | self._extra
        request = asyncio.ensure_future(self._client.post("/v1/completions", body))
        self._in_flight.add(request)
        try:
            answer = await request
        except asyncio.CancelledError:
            if request not in self._aborted:
                raise  # the caller was cancelled
            return Generation([], [], "abort", {"server": self.base_url})
        finally:
            self._in_flight.discard(request)
            self._aborted.discard(request)
        try:
            return self._generation(answer, sampling)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise RequestError(f"{self.base_url}: malformed completion answer ({exc!r})") from None

    def _generation(self, answer: Any, sampling: SamplingParams) -> Generation:
        """Parse one completion answer into a Generation."""
        choices = answer.get("choices") if isinstance(answer, dict) else None
        choice = present(choices or None, f"{self.base_url}: the answer has no choices")[0]
        if self.dialect == "llamacpp":
            ids, logprobs = parse_llamacpp_choice(choice, _llamacpp_post_sampling(sampling))
        else:
            ids, logprobs = parse_openai_choice(choice)
        info = self._info(answer, choice, sampling)
        stop_ids = self.eos_token_ids | frozenset(sampling.stop_token_ids)
        return finish(
            ids, logprobs, choice.get("finish_reason"), stop_ids, info, eos_known=bool(self.eos_token_ids)
        )

    def _info(
        self, answer: Mapping[str, Any], choice: Mapping[str, Any], sampling: SamplingParams
    ) -> dict[str, Any]:
        """Server details worth keeping: the server, usage, weight version, matched stop."""
        info: dict[str, Any] = {"server": self.base_url}
        if isinstance(usage := answer.get("usage"), dict):
            info["prompt_tokens"] = usage.get("prompt_tokens")
        version = (answer.get("metadata") or {}).get("weight_version")
        if version is not None:
            info["weight_versions"] = [version, version]
        for key in ("stop_reason", "matched_stop"):
            if choice.get(key) is not None:
                info[key] = choice[key]
        filtered = sampling.top_k > 0 or sampling.top_p < 1.0
        if self.dialect == "llamacpp" and _llamacpp_post_sampling(sampling) and filtered:
            info["logprobs_after_filter"] = True
        return info

    async def abort_all(self) -> None:
        """Cancel every request in flight; each generate() returns ``Generation([], [], "abort")``.

        The answers are not streamed, so the tokens sampled so far are lost: on resume the
        turn is sampled again from its start. Returns once the cancelled requests are gone.
        """
        requests = [r for r in self._in_flight if not r.done()]
        for request in requests:
            self._aborted.add(request)
            request.cancel()
        await asyncio.gather(*requests, return_exceptions=True)

    async def update_weights(self, weights: Weights, *, version: int | None = None) -> int:
        """Have an SGLang server load the checkpoint folder ``weights`` (a path on its disk).

        Only the ``sglang`` dialect has a weight-update endpoint (``/update_weights_from_disk``);
        the new version (``version``, else the previous one plus one) is sent as its
        ``weight_version`` and returned. Other dialects, and a state dict, raise EngineError.
        """
        if self.dialect != "sglang":
            raise EngineError(
                f"the {self.dialect} server at {self.base_url} has no weight-update endpoint: restart "
                "(or reload) it on the new checkpoint, or use engine.kind vllm (vLLM) or sglang"
            )
        path = checkpoint_path(weights, "OpenAIEngine")
        new = self._version + 1 if version is None else version
        await post_update_weights_from_disk(self._client, path, weight_version=str(new))
        self._version = new
        return new

    async def close(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()
