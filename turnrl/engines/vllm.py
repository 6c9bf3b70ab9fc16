"""An engine for vLLM servers: token ids in, streamed token ids and logprobs out, weight updates.

Each generation streams ``/v1/completions`` (the prompt as token ids, ``return_token_ids``,
the sampled token's logprob), so the tokens a server has produced are in hand at every
moment. :meth:`VLLMServerEngine.abort_all` closes this client's streams, which vLLM takes as
an abort of those requests alone (another client of the same server, an eval job or another
training rank, goes on): each generation ends with finish_reason "abort" and the tokens it
received, which partial rollout continues from after a weight update. Tokens the server sampled
after the last one received are dropped with the request, so nothing is trained on that the
rollout did not condition on.

Turns with images (vision-language models) stream ``/inference/v1/generate`` instead (the
server must run with ``--enable-scale-out``; managed servers of a VLM do): the prompt goes as
token ids with one image token per image, the images as PNG data URLs (``content_parts``);
vLLM's processor expands each image token into the image's tokens, as turnrl's own processor
did, and the prompt vLLM reports back (``return_token_ids``) must equal turnrl's token for
token, or the generation fails instead of training on tokens the server did not condition on.

Weight updates (:meth:`VLLMServerEngine.update_weights`) use vLLM's own in-place reload: the
weights are written once as safetensors into a folder the server can read (a state dict is
saved into ``weights_dir``; a folder is used as it is), then ``/pause`` (in-flight requests
finish on the old weights), ``/collective_rpc reload_weights`` (every worker loads the folder
in place), ``/reset_prefix_cache`` (no KV computed by the old weights is reused),
``/update_weight_version`` and ``/resume``. Servers that turnrl started also run its worker
extension's ``refresh_tied_weights`` right after the reload: vLLM's CPU build keeps a packed copy
of a tied ``lm_head`` that the in-place reload does not refresh (measured: a GRPO step's ratio off
by up to 5% on the tiny Qwen2-VL without it). Tokens carry the weight version they were sampled
with (``Generation.versions``): the engine's version is bumped before ``/resume``, and nothing
is sampled while the server is paused, so the stamp is exact.

With ``keep_in_flight`` (overlapped training's in-flight updates, as PipelineRL's) an update
does not wait for or abort the generations in flight: ``/pause?mode=keep`` freezes them where they
are, the weights reload, and after ``/resume`` each goes on in the same request, its context's KV
cache as the old weights computed it (nothing is run again; the prefix cache is not reset either,
so a later request may reuse such KV). The sampled tokens' logprobs are those the server sampled
with, so the importance correction stays exact. Every generation then streams
``/inference/v1/generate`` (the server runs with ``--enable-scale-out``), whose last event gives the
server's own weight-version spans over the output tokens: each token carries the version that
sampled it. A generation aborted before its last event has no spans; its tokens carry the
version it started under (the oldest they can be).

The server must run with ``VLLM_SERVER_DEV_MODE=1`` for these endpoints (managed servers do).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx

from turnrl.engines.http import JsonClient, RequestError, RetryPolicy, finish, present
from turnrl.engines.openai import completion_payload
from turnrl.engines.weights import write_safetensors

if TYPE_CHECKING:
    from turnrl.engines.weight_group import WeightGroup
from turnrl.types import TOKEN_SINK, EngineError, Generation, SamplingParams, Weights
from turnrl.vision.processor import image_url

WEIGHTS_FILE = "model.safetensors"


@dataclass
class _Received:
    """What one generation's stream has brought so far."""

    info: dict[str, Any]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: str | None = None
    spans: list[Mapping[str, Any]] | None = None  # the server's weight-version spans (its last event)


def untied(weights: Mapping[str, Any]) -> dict[str, Any]:
    """``weights`` with each tied tensor once (lm_head = embed_tokens: the model ties it again on load)."""
    seen: set[tuple[int, int]] = set()
    tensors: dict[str, Any] = {}
    for name, tensor in weights.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key not in seen:
            seen.add(key)
            tensors[name] = tensor
    return tensors


def save_weights(weights: Mapping[str, Any], folder: str | Path) -> Path:
    """Write a state dict as ``folder/model.safetensors`` (tied tensors once), over the last push's
    file in place (see ``write_safetensors``); the folder."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(untied(weights), out / WEIGHTS_FILE)
    return out


def one_token_per_image(prompt_ids: Sequence[int], images: Sequence[Any], image_token_id: int) -> list[int]:
    """``prompt_ids`` with each image's run of image tokens cut to one (the prompt vLLM expands).

    An ``ImageInput`` knows its run (``num_tokens``), which must be there; another image (a PIL
    image or URL from a trainer's integration) takes the whole run of image tokens where it is,
    and vLLM's report of the prompt it expanded tells whether that was right. A prompt whose runs
    do not match its images is refused.
    """
    out: list[int] = []
    k = i = 0
    while i < len(prompt_ids):
        token = int(prompt_ids[i])
        out.append(token)
        if token != image_token_id:
            i += 1
            continue
        if k >= len(images):
            raise RequestError(f"the prompt has more image-token runs than its {len(images)} image(s)")
        end = i + 1
        while end < len(prompt_ids) and prompt_ids[end] == image_token_id:
            end += 1
        need = getattr(images[k], "num_tokens", None)
        if need is not None:  # the image ends where its own tokens do (another may follow at once)
            if end - i < need:
                raise RequestError(
                    f"image {k} needs a run of {need} image tokens in the prompt; it has {end - i}"
                )
            end = i + need
        i = end
        k += 1
    if k != len(images):
        raise RequestError(f"the prompt has {k} image-token run(s) for {len(images)} image(s)")
    return out


_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "logprobs",
    "skip_special_tokens",
    "stop_token_ids",
)


def vision_payload(
    prompt_ids: Sequence[int],
    sampling: SamplingParams,
    images: Sequence[Any],
    image_token_id: int | None,
    request_params: Mapping[str, Any],
    model: str | None,
) -> dict[str, Any]:
    """The ``/inference/v1/generate`` body of a turn (with images: ``image_token_id`` is needed);
    ``request_params`` are sampling fields.

    The sampling fields are those of a text turn's ``/v1/completions`` request (one place builds them).
    """
    text_turn = completion_payload("vllm", (), sampling, None)
    params = {k: text_turn[k] for k in _SAMPLING_FIELDS if k in text_turn} | {"n": 1}
    body: dict[str, Any] = {
        "token_ids": list(prompt_ids),
        "sampling_params": dict(request_params) | params,
        "return_token_ids": True,
        "stream": True,
    }
    if images:
        if image_token_id is None:
            raise RequestError("a turn with images needs the model's image token id")
        body["token_ids"] = one_token_per_image(prompt_ids, images, image_token_id)
        body["content_parts"] = [{"type": "image_url", "url": image_url(image)} for image in images]
    if model:
        body["model"] = model
    return body


def event_logprobs(choice: Mapping[str, Any]) -> list[float]:
    """The sampled tokens' logprobs of one streamed choice (completions' or generate's shape)."""
    logprobs = choice.get("logprobs") or {}
    if "content" in logprobs:
        return [float(entry["logprob"]) for entry in logprobs["content"] or ()]
    return [float(v) for v in logprobs.get("token_logprobs") or ()]


def scratch_weights_dir() -> Path:
    """A new folder for weight updates, in shared memory when there is some (the caller removes it)."""
    shm = Path("/dev/shm")
    parent = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="turnrl-weights-", dir=parent))


class VLLMServerEngine:
    """Generates through one vLLM server, streaming; aborts keep their tokens; weights update in place."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        eos_token_ids: Iterable[int] = (),
        api_key: str | None = None,
        timeout_s: float = 300.0,
        max_retries: int = 3,
        retry_budget_s: float = 600.0,
        weights_dir: str | Path | None = None,
        request_params: Mapping[str, Any] | None = None,
        image_token_id: int | None = None,
        refresh_tied_weights: bool = False,
        keep_in_flight: bool = False,
        weight_sync: Literal["file", "collective", "auto"] = "file",
        weight_sync_host: str = "127.0.0.1",
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """``base_url`` is the server root; ``weights_dir`` is where a state dict given to
        :meth:`update_weights` is written (a folder the server can read; default: a new temporary
        folder, in ``/dev/shm`` when there is one); ``request_params`` go with every request
        (vLLM's sampling fields such as ``repetition_penalty``, ``min_p`` or ``structured_outputs``;
        the fields turnrl sets itself win); ``image_token_id``: the VLM's image token, for turns
        with images; ``refresh_tied_weights``: the server runs turnrl's worker extension (servers
        turnrl starts do), called after each reload; ``keep_in_flight``: an update freezes the
        generations in flight and they go on under the new weights (the module's docstring);
        ``weight_sync``: how a state dict reaches the server: written to ``weights_dir`` and loaded
        (``file``), or broadcast to its workers over a process group whose store this process holds
        at ``weight_sync_host`` (``collective``; the server runs turnrl's worker extension), or
        collective where the state dict is on a GPU and file where it is not (``auto``)."""
        root = base_url.rstrip("/")
        root = root[: -len("/v1")] if root.endswith("/v1") else root
        retry = RetryPolicy(max_retries=max_retries, budget_s=retry_budget_s)
        self._client = JsonClient(
            root, api_key=api_key, timeout_s=timeout_s, retry=retry, transport=transport
        )
        self.model = model
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.weights_dir = Path(weights_dir) if weights_dir else None
        self.request_params = dict(request_params or {})
        self.image_token_id = image_token_id
        self.refresh_tied_weights = refresh_tied_weights
        self.keep_in_flight = keep_in_flight
        self.weight_sync = weight_sync
        self.weight_sync_host = weight_sync_host
        self._group: WeightGroup | None = None
        self._labels: dict[str, int] = {}  # the weight-version labels this engine gave the server
        self._own_weights_dir = False
        self._version = 0
        self._streams: set[asyncio.Future[Any]] = set()  # the streams being read now
        self._aborted: set[asyncio.Future[Any]] = set()  # those abort_all closed
        self.tokens_received = 0  # sampled tokens streamed back so far, all generations together

    @property
    def base_url(self) -> str:
        """The server root this engine talks to."""
        return self._client.base_url

    @property
    def in_flight(self) -> int:
        """Generations waiting on the server now."""
        return len(self._streams)

    @property
    def weight_version(self) -> int:
        """The version of the weights the server samples with (0: those it started with)."""
        return self._version

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[Any] = (),
        *,
        session: str | None = None,
    ) -> Generation:
        """Sample a continuation of ``prompt_ids`` (``images``: the trajectory's images so far, in
        prompt order); ``session`` is accepted for the balancer and unused."""
        if not prompt_ids:
            raise RequestError("empty prompt")
        path, body = self._request(prompt_ids, sampling, images)
        started = self._version
        got = _Received(info={"server": self.base_url})
        stream = asyncio.ensure_future(self._read(path, body, prompt_ids if images else None, got))
        self._streams.add(stream)
        try:
            await stream
        except asyncio.CancelledError:
            if stream not in self._aborted:
                stream.cancel()
                raise  # the caller was cancelled
            got.reason = got.reason or "abort"  # a finish that arrived before the abort stands
        finally:
            self._streams.discard(stream)
            self._aborted.discard(stream)
        versions = self._versions(got, started)
        got.info["weight_versions"] = [versions[0], versions[-1]] if versions else [self._version] * 2
        stop_ids = self.eos_token_ids | frozenset(sampling.stop_token_ids)
        gen = finish(
            got.ids, got.logprobs, got.reason, stop_ids, got.info, eos_known=bool(self.eos_token_ids)
        )
        gen.versions = versions[: len(gen.token_ids)]
        return gen

    def _versions(self, got: _Received, started: int) -> list[int]:
        """The weight version of each token of ``got``. Without ``keep_in_flight`` one for all, the
        current one: no update happens while a generation is in flight. With it, the server's spans
        (a label this engine did not set, such as the start-up weights', is the version the request
        began under), or where there are none (an abort) the version it began under."""
        if not self.keep_in_flight:
            return [self._version] * len(got.ids)
        out = [started] * len(got.ids)
        for span in got.spans or ():
            start, end = int(span["start"]), int(span["end"])
            out[start:end] = [self._labels.get(str(span["version"]), started)] * (end - start)
        return out

    async def _read(
        self, path: str, body: dict[str, Any], images_prompt: Sequence[int] | None, got: _Received
    ) -> None:
        """Read one generation's stream into ``got``, event by event (an abort keeps what arrived);
        ``images_prompt``: the prompt to compare with the one vLLM expanded, for turns with images."""
        sink = TOKEN_SINK.get()  # a streamed call: each event's tokens as they arrive
        try:
            async for event in self._client.events(path, body):
                if images_prompt is not None and "prompt_token_ids" in event:
                    self._check_prompt(images_prompt, event["prompt_token_ids"])
                choice = present(
                    (event.get("choices") or [None])[0], f"{self.base_url}: an event has no choice"
                )
                new = [int(t) for t in choice.get("token_ids") or ()]
                got.ids += new
                self.tokens_received += len(new)
                if sink is not None and new:
                    sink(new)
                got.logprobs += event_logprobs(choice)
                got.reason = choice.get("finish_reason") or got.reason
                if choice.get("stop_reason") is not None:
                    got.info["stop_reason"] = choice["stop_reason"]
                if choice.get("weight_versions"):
                    got.spans = list(choice["weight_versions"])
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise RequestError(f"{self.base_url}: malformed completion event ({exc!r})") from None

    def _request(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, images: Sequence[Any]
    ) -> tuple[str, dict[str, Any]]:
        """The endpoint and streamed body of one generation: completions for text, generate for
        images (and for every turn with ``keep_in_flight``: its last event has the version spans)."""
        if not images and not self.keep_in_flight:
            body = self.request_params | completion_payload("vllm", prompt_ids, sampling, self.model)
            return "/v1/completions", body | {"stream": True}
        body = vision_payload(
            prompt_ids, sampling, images, self.image_token_id, self.request_params, self.model
        )
        return "/inference/v1/generate", body

    def _check_prompt(self, sent: Sequence[int], conditioned: Sequence[int]) -> None:
        """Refuse a generation whose prompt, as vLLM expanded its images, is not turnrl's."""
        if [int(t) for t in conditioned] != [int(t) for t in sent]:
            at = next(
                (i for i, (a, b) in enumerate(zip(sent, conditioned, strict=False)) if a != b),
                min(len(sent), len(conditioned)),
            )
            raise RequestError(
                f"{self.base_url}: vLLM's prompt differs from turnrl's at token {at} ({len(conditioned)} vs "
                f"{len(sent)} tokens): its image processor expands the images differently"
            )

    async def abort_all(self) -> None:
        """Abort this client's generations in flight: their streams close (vLLM aborts a request
        whose client went away) and each returns the tokens received so far, finish "abort".
        Other clients' requests on the server go on. Returns once the streams are closed."""
        streams = [s for s in self._streams if not s.done()]
        for stream in streams:
            self._aborted.add(stream)
            stream.cancel()
        await asyncio.gather(*streams, return_exceptions=True)

    async def update_weights(self, weights: Weights, *, version: int | None = None) -> int:
        """Load new weights into the server in place; the new version (``version``, else previous + 1).

        ``weights``: a state dict (written to ``weights_dir`` first) or a folder of safetensors
        the server can read. Requests in flight finish on the old weights first (with
        ``keep_in_flight``: they freeze and go on under the new weights).
        """
        new = self._version + 1 if version is None else version
        collective = isinstance(weights, Mapping) and (
            self.weight_sync == "collective"
            or (self.weight_sync == "auto" and any(getattr(t, "is_cuda", False) for t in weights.values()))
        )
        folder = None
        if not collective:
            folder = self._save(weights) if isinstance(weights, Mapping) else Path(weights)
            if not any(folder.glob("*.safetensors")):
                raise EngineError(f"no *.safetensors in {folder} for the vLLM server to load")
        await self._client.post(f"/pause?mode={'keep' if self.keep_in_flight else 'wait'}", {})
        try:
            if folder is None:
                await self._broadcast(weights)  # type: ignore[arg-type]
            else:
                rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(folder.resolve())}}
                await self._client.post("/collective_rpc", rpc, timeout_s=max(self._client.timeout_s, 600.0))
            if self.refresh_tied_weights:
                await self._client.post("/collective_rpc", {"method": "refresh_tied_weights"})
            if not self.keep_in_flight:  # frozen requests hold their KV: vLLM would refuse the reset
                await self._client.post("/reset_prefix_cache", {})
            await self._client.post("/update_weight_version", {"new_version": str(new)})
            self._labels[str(new)] = new
            self._version = new  # before /resume: every token after it is sampled by the new weights
        finally:
            await self._client.post("/resume", {})
        return new

    async def _broadcast(self, weights: Mapping[str, Any]) -> None:
        """Send ``weights`` to the server's workers over the weight group while they load them bucket
        by bucket. A new group is made at the first push, after a push that failed, and when the
        workers are not in this client's group (another client joined them since, or the server
        restarted)."""
        from turnrl.engines.weight_group import buckets_of, layout  # torch: only where weights are sent

        try:
            answer = await self._client.post("/collective_rpc", {"method": "weight_group_id"})
            ids = answer.get("results", []) if isinstance(answer, Mapping) else []
            group = self._group
            if group is None or any(i != group.id for i in ids):
                group = await self._join_group(len(ids), weights)
            buckets = buckets_of(untied(weights))
            rpc = {"method": "receive_weights", "args": [json.dumps(layout(buckets))]}
            timeout = max(self._client.timeout_s, 600.0)
            received = asyncio.ensure_future(self._client.post("/collective_rpc", rpc, timeout_s=timeout))
            await asyncio.gather(asyncio.to_thread(group.send, buckets), received)
        except BaseException:
            self._leave_group()
            raise

    async def _join_group(self, workers: int, weights: Mapping[str, Any]) -> WeightGroup:
        """A new weight group with the server's ``workers`` (gloo for CPU weights, NCCL for CUDA ones)."""
        from turnrl.engines.weight_group import WeightGroup

        self._leave_group()
        if workers == 0:
            raise EngineError(f"{self.base_url} reported no workers for a weight group")
        on_gpu = any(getattr(t, "is_cuda", False) for t in weights.values())
        backend = "nccl" if on_gpu else "gloo"
        timeout_s = self._client.timeout_s
        group = WeightGroup(workers, host=self.weight_sync_host, backend=backend, timeout_s=timeout_s)
        rpc = {"method": "init_weight_group", "args": [json.dumps(group.spec())]}
        joined = asyncio.ensure_future(self._client.post("/collective_rpc", rpc))
        try:
            await asyncio.gather(asyncio.to_thread(group.connect), joined)
        except BaseException:
            group.close()
            raise
        self._group = group
        return group

    def _leave_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    async def follow_weights(self, version: int) -> None:
        """Take up weight version ``version``, which another process loaded into the server (the
        rank that pushes for every training rank): the server must report it, else EngineError."""
        answer = await self._client.get("/weight_info")
        served = answer.get("weight_version") if isinstance(answer, Mapping) else None
        if str(served) != str(version):
            raise EngineError(
                f"{self.base_url} serves weight version {served}, not {version}: the update did not reach it"
            )
        self._labels[str(version)] = version
        self._version = version

    def _save(self, weights: Mapping[str, Any]) -> Path:
        """Write a state dict where the server reads it."""
        if self.weights_dir is None:
            self.weights_dir = scratch_weights_dir()
            self._own_weights_dir = True
        return save_weights(weights, self.weights_dir)

    async def close(self) -> None:
        """Close the connection pool and the weight group; remove the weights folder this engine made."""
        self._leave_group()
        await self._client.aclose()
        if self._own_weights_dir and self.weights_dir is not None:
            shutil.rmtree(self.weights_dir, ignore_errors=True)
