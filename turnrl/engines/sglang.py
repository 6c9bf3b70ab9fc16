"""An engine for SGLang's native ``/generate`` endpoint: token ids in, ids and logprobs out.

Request: ``input_ids``, ``sampling_params`` (temperature, top_p, top_k, max_new_tokens,
stop_token_ids, sampling_seed), ``return_logprob: true``, ``rid`` (so a request can be
aborted) and ``image_data`` for vision-language models (base64 strings, data URLs or
URLs, passed through as given). Answer: ``meta_info.output_token_logprobs`` holds
``[logprob, token_id, text]`` per sampled token and ``meta_info.finish_reason`` is
``{"type": "stop" | "length" | "abort", ...}``; SGLang includes the matched stop token.

Partial rollout: :meth:`SGLangEngine.abort_all` posts ``/abort_request`` with the ``rid`` of
each of this client's requests in flight (not SGLang's ``abort_all: true``, which would end an
eval job's or another rank's requests on a shared server too); each of those ``/generate`` calls
then returns with finish type "abort" and the tokens (and logprobs) sampled so far, which
``generate`` keeps. SGLang drops an abort whose rid it has not registered yet (a request still on
its way in), so the aborts go out again for those still in flight until each has returned.
:meth:`SGLangEngine.update_weights` takes a checkpoint folder on the server's disk and posts
``/update_weights_from_disk`` (``model_path``, ``weight_version``).

Which distribution SGLang's logprobs are under depends on the server (by default they are
taken after temperature scaling; see SGLang's docs on ``return_logprob``); this engine
passes them through unchanged.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import httpx

from turnrl.engines.http import JsonClient, RequestError, RetryPolicy, finish, present, require
from turnrl.types import EngineError, Generation, SamplingParams, Weights
from turnrl.vision.processor import image_url

ABORT_AGAIN_S = 0.1  # how long an abort may take before it is posted again (the rid may be new there)
ABORT_WAIT_S = 30.0  # then abort_all gives up: those generations end on their own (max_new_tokens)


def sampling_params(sampling: SamplingParams) -> dict[str, Any]:
    """SGLang's ``sampling_params`` for one generation."""
    params: dict[str, Any] = {
        "temperature": max(sampling.temperature, 0.0),
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "max_new_tokens": sampling.max_tokens,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    return params


def generate_payload(
    prompt_ids: Sequence[int], sampling: SamplingParams, images: Sequence[Any], rid: str
) -> dict[str, Any]:
    """The ``/generate`` request body."""
    body: dict[str, Any] = {
        "input_ids": [int(t) for t in prompt_ids],
        "sampling_params": sampling_params(sampling),
        "return_logprob": True,
        "logprob_start_len": -1,  # logprobs of the output only
        "top_logprobs_num": 0,
        "stream": False,
        "rid": rid,
    }
    if images:
        body["image_data"] = [image_url(image) for image in images]
    return body


def parse_generate(answer: Any) -> tuple[list[int], list[float], str | None, dict[str, Any]]:
    """Token ids, logprobs, finish type and meta_info from a ``/generate`` answer."""
    require(
        isinstance(answer, dict) and isinstance(answer.get("meta_info"), dict), "no meta_info in the answer"
    )
    meta: dict[str, Any] = answer["meta_info"]
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    triples = meta.get("output_token_logprobs")
    if triples is None and kind == "abort":
        triples = []  # aborted before its first token
    triples = present(triples, "no meta_info.output_token_logprobs (was return_logprob ignored?)")
    ids = [int(t[1]) for t in triples]
    logprobs = [float(t[0]) for t in triples]
    output_ids = answer.get("output_ids")
    if output_ids is not None:
        require([int(t) for t in output_ids] == ids, "output_ids and output_token_logprobs disagree")
    return ids, logprobs, kind, meta


async def post_update_weights_from_disk(
    client: JsonClient,
    model_path: str,
    *,
    load_format: str | None = None,
    weight_version: str | None = None,
) -> dict[str, Any]:
    """POST SGLang's ``/update_weights_from_disk``; the server's answer, or RequestError on failure."""
    body: dict[str, Any] = {"model_path": model_path}
    if load_format is not None:
        body["load_format"] = load_format
    if weight_version is not None:
        body["weight_version"] = weight_version
    answer = await client.post("/update_weights_from_disk", body)
    if not isinstance(answer, dict) or not answer.get("success", False):
        message = answer.get("message") if isinstance(answer, dict) else answer
        raise RequestError(f"{client.base_url}: update_weights_from_disk failed: {message}")
    return answer


def checkpoint_path(weights: Weights, engine: str) -> str:
    """The checkpoint path a server engine loads, or EngineError for an in-memory state dict."""
    if not isinstance(weights, str | os.PathLike):
        raise EngineError(
            f"{engine} updates weights from a checkpoint path on the server's disk, not a state dict: "
            "save the weights (save_pretrained) where the server can read them and pass that path"
        )
    return os.fspath(weights)


class SGLangEngine:
    """Generates through SGLang's native ``/generate``; also aborts requests and reloads weights."""

    def __init__(
        self,
        base_url: str,
        *,
        eos_token_ids: Iterable[int] = (),
        api_key: str | None = None,
        timeout_s: float = 300.0,
        max_retries: int = 3,
        retry_budget_s: float = 600.0,
        backoff_s: float = 0.25,
        extra_sampling_params: Mapping[str, Any] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """``eos_token_ids`` are the model's stop ids (used to cut and to flag a missing stop token)."""
        retry = RetryPolicy(max_retries=max_retries, budget_s=retry_budget_s, backoff_s=backoff_s)
        self._client = JsonClient(
            base_url, api_key=api_key, timeout_s=timeout_s, retry=retry, transport=transport
        )
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self._extra = dict(extra_sampling_params or {})
        self._version = 0
        self._rids: set[str] = set()  # this client's requests in flight

    @property
    def weight_version(self) -> int:
        """The version of the last weight update made through this engine (0 before any)."""
        return self._version

    @property
    def in_flight(self) -> int:
        """This client's generations in flight."""
        return len(self._rids)

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
        rid: str | None = None,
    ) -> Generation:
        """Sample a continuation; ``rid`` names the request for :meth:`abort` (default: a fresh uuid)."""
        if not prompt_ids:
            raise RequestError("empty prompt")
        body = generate_payload(prompt_ids, sampling, images, rid or uuid.uuid4().hex)
        body["sampling_params"] |= self._extra
        self._rids.add(body["rid"])
        try:
            answer = await self._client.post("/generate", body)
        finally:
            self._rids.discard(body["rid"])
        try:
            ids, logprobs, kind, meta = parse_generate(answer)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise RequestError(f"{self.base_url}: malformed /generate answer ({exc!r})") from None
        info: dict[str, Any] = {"server": self.base_url, "rid": body["rid"]}
        info["prompt_tokens"] = meta.get("prompt_tokens")
        if meta.get("weight_version") is not None:
            info["weight_versions"] = [meta["weight_version"], meta["weight_version"]]
        stop_ids = self.eos_token_ids | frozenset(sampling.stop_token_ids)
        return finish(ids, logprobs, kind, stop_ids, info, eos_known=bool(self.eos_token_ids))

    async def abort(self, rid: str) -> None:
        """Abort a running request (its generate() returns with finish_reason "abort")."""
        await self._client.post("/abort_request", {"rid": rid})

    async def abort_all(self) -> None:
        """Abort this client's requests in flight, by rid (others sharing the server go on); each
        of those generate() calls returns with finish_reason "abort" and the tokens sampled so far.
        Returns once they have returned: an abort that SGLang dropped (the request not registered
        yet) is posted again every ``ABORT_AGAIN_S``, for up to ``ABORT_WAIT_S``."""
        pending = set(self._rids)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ABORT_WAIT_S
        while pending and loop.time() < deadline:
            await asyncio.gather(*(self.abort(rid) for rid in sorted(pending)))
            again = min(loop.time() + ABORT_AGAIN_S, deadline)
            while (pending := pending & self._rids) and loop.time() < again:
                await asyncio.sleep(0.005)

    async def update_weights(self, weights: Weights, *, version: int | None = None) -> int:
        """Have the server load the checkpoint folder ``weights`` (a path on its disk).

        The new version (``version``, else the previous one plus one) is sent as SGLang's
        ``weight_version`` and returned. A state dict is refused with EngineError.
        """
        path = checkpoint_path(weights, "SGLangEngine")
        new = self._version + 1 if version is None else version
        await post_update_weights_from_disk(self._client, path, weight_version=str(new))
        self._version = new
        return new

    async def update_weights_from_disk(
        self, model_path: str, *, load_format: str | None = None, weight_version: str | None = None
    ) -> dict[str, Any]:
        """Load new weights from ``model_path`` on the server's disk; the server's answer."""
        return await post_update_weights_from_disk(
            self._client, model_path, load_format=load_format, weight_version=weight_version
        )

    async def close(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()
