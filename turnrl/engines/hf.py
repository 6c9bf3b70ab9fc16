"""An in-process Hugging Face transformers engine with continuous batching.

A background thread owns the model. Each iteration it (1) applies pending weight updates,
(2) prefills newly arrived requests one by one (no padding, so a prompt's cache is the same
as when run alone), (3) merges them into the running batch, whose KV caches are left-padded
to a common length, and (4) runs one decode step for every running row. Requests join and
leave between steps; asyncio callers only wait on futures, so the event loop stays free.

Sampling is done here, per row, from raw logits: temperature, top-k, then top-p over the
renormalized top-k set, and a per-request ``torch.Generator`` when a seed is given. The
returned logprob is ``log_softmax(logits / temperature)`` over the full vocabulary, taken
before any filtering (temperature 1 for greedy), as ``Generation`` requires.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from turnrl.engines.weights import load_state_dict
from turnrl.types import EngineError, FinishReason, Generation, SamplingParams, Weights
from turnrl.vision.processor import ImageInput, ImageTokenError, VisionProcessor, as_image_inputs

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_SPARE_COLUMNS = 64  # free KV columns kept after a rebuild, so decode steps rarely reallocate
_TOP_P_SHORTLIST = 1024  # top-p first looks for the nucleus among this many most likely tokens


@dataclass(eq=False)
class _Request:
    """One generate() call as the worker sees it."""

    prompt_ids: list[int]
    sampling: SamplingParams
    stop_ids: frozenset[int]  # eos ids plus the request's stop_token_ids
    max_new_tokens: int  # max_tokens, lowered to fit the context window
    generator: torch.Generator  # the request's own when seeded, else the engine's
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Generation]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # weight version of each sampled token
    cancelled: bool = False  # set by the caller's task when it stops waiting
    images: list[ImageInput] = field(default_factory=list)  # the prompt's images, in order
    session: str | None = None  # the trajectory it belongs to (its KV may be kept for the next turn)
    rope_delta: int = 0  # multimodal RoPE: text positions after images are shifted by this much

    def add_token(self, token: int, logprob: float, version: int) -> FinishReason | None:
        """Record a sampled token; the finish reason when it ends the generation."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if token in self.stop_ids:
            return "stop"
        return "length" if len(self.token_ids) >= self.max_new_tokens else None

    def finish(self, reason: FinishReason) -> None:
        """Hand the generation to the waiting caller."""
        span = [self.versions[0], self.versions[-1]] if self.versions else []
        info = {"prompt_tokens": len(self.prompt_ids), "weight_versions": span}
        result = Generation(list(self.token_ids), list(self.logprobs), reason, info, list(self.versions))
        _resolve(self.loop, self.future, result)


@dataclass
class _SessionKV:
    """The KV cache a finished generation leaves: its tokens and, per layer, keys and values."""

    tokens: list[int]  # prompt + sampled tokens but the last (whose KV was never computed)
    rows: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [heads, len(tokens), dim]


@dataclass(eq=False)
class _WeightUpdate:
    """A state dict waiting to be loaded between two steps."""

    state_dict: Mapping[str, torch.Tensor]
    strict: bool
    version: int | None  # the version to set; None: the current one plus one
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[int]


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], value: Any) -> None:
    """Set a result (or an exception) on a future owned by another thread's loop."""

    def settle() -> None:
        if future.done():
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
        loop.call_soon_threadsafe(settle)


class _GrowingLayer(DynamicLayer):
    """A full-attention cache layer that appends into spare room instead of concatenating."""

    def __init__(
        self, rows: Sequence[tuple[torch.Tensor, torch.Tensor]], spare: int = _SPARE_COLUMNS
    ) -> None:
        """Stack per-row ``(keys, values)`` of shape ``[heads, len, dim]``, right-aligned (left-padded)."""
        super().__init__()
        length = max(k.shape[-2] for k, _ in rows)
        k0 = rows[0][0]
        shape = (len(rows), k0.shape[0], length + spare, k0.shape[-1])
        self._keys_buf, self._values_buf = k0.new_zeros(shape), k0.new_zeros(shape)
        for b, (k, v) in enumerate(rows):
            self._keys_buf[b, :, length - k.shape[-2] : length] = k
            self._values_buf[b, :, length - v.shape[-2] : length] = v
        self.dtype, self.device, self.is_initialized = k0.dtype, k0.device, True
        self._set_length(length)

    def _set_length(self, length: int) -> None:
        """Point keys/values at the first ``length`` columns of the buffers."""
        self._length = length
        self.keys = self._keys_buf[:, :, :length]
        self.values = self._values_buf[:, :, :length]

    def _grow(self, needed: int) -> None:
        """Reallocate the buffers with at least ``needed`` columns."""
        for name in ("_keys_buf", "_values_buf"):
            old = getattr(self, name)
            shape = (*old.shape[:2], max(needed, 2 * old.shape[2]), old.shape[3])
            new = old.new_zeros(shape)
            new[:, :, : self._length] = old[:, :, : self._length]
            setattr(self, name, new)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new states and return every cached state."""
        end = self._length + key_states.shape[-2]
        if end > self._keys_buf.shape[2]:
            self._grow(end)
        self._keys_buf[:, :, self._length : end] = key_states
        self._values_buf[:, :, self._length : end] = value_states
        self._set_length(end)
        assert self.keys is not None and self.values is not None
        return self.keys, self.values


class _Batch:
    """The running rows: their requests, real lengths and one left-padded KV cache."""

    def __init__(self) -> None:
        self.requests: list[_Request] = []
        self.lengths: list[int] = []  # real tokens in the cache, per row
        self.deltas: list[int] = []  # per row: position shift after images (multimodal RoPE)
        self.cache: Cache | None = None

    def __len__(self) -> int:
        return len(self.requests)

    def _rows(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every row's unpadded keys and values for one layer."""
        return [self.row(layer, b) for b in range(len(self.lengths))] if self.cache is not None else []

    @property
    def num_layers(self) -> int:
        """Layers of the cache (0 when empty)."""
        return len(self.cache.layers) if self.cache is not None else 0

    def row(self, layer: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``b``'s unpadded keys and values for one layer."""
        assert self.cache is not None
        keys, values = _layer_kv(self.cache, layer)
        n, width = self.lengths[b], keys.shape[-2]
        return keys[b, :, width - n :], values[b, :, width - n :]

    def rebuild(self, keep: list[bool], new: list[tuple[_Request, Cache]]) -> None:
        """Drop rows where ``keep`` is False, append prefilled requests, and re-pad the cache."""
        requests = [r for r, kept in zip(self.requests, keep, strict=True) if kept] + [r for r, _ in new]
        if not requests:
            self.requests, self.lengths, self.deltas, self.cache = [], [], [], None
            return
        num_layers = len(self.cache.layers) if self.cache is not None else len(new[0][1].layers)
        layers: list[Any] = []
        for layer in range(num_layers):
            old = [row for row, kept in zip(self._rows(layer), keep, strict=True) if kept]
            layers.append(_GrowingLayer(old + [_first_row(cache, layer) for _, cache in new]))
        self.lengths = [n for n, kept in zip(self.lengths, keep, strict=True) if kept]
        self.lengths += [len(r.prompt_ids) for r, _ in new]
        self.deltas = [r.rope_delta for r in requests]
        self.requests, self.cache = requests, Cache(layers=layers)

    def step_inputs(self, device: torch.device) -> dict[str, torch.Tensor | None]:
        """Model inputs for one decode step: each row's last token at its own position."""
        width = max(self.lengths)
        mask = None
        if min(self.lengths) < width:
            cols = torch.arange(width + 1, device=device)
            starts = torch.tensor([width - n for n in self.lengths], device=device)
            mask = (cols[None, :] >= starts[:, None]).long()
        return {
            "input_ids": torch.tensor([[r.token_ids[-1]] for r in self.requests], device=device),
            "position_ids": torch.tensor(
                [[n + d] for n, d in zip(self.lengths, self.deltas, strict=True)], device=device
            ),
            "attention_mask": mask,
        }


def _layer_kv(cache: Cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's cached keys and values, ``[batch, heads, len, dim]``."""
    cache_layer = cache.layers[layer]
    assert isinstance(cache_layer, DynamicLayer)
    assert cache_layer.keys is not None and cache_layer.values is not None
    return cache_layer.keys, cache_layer.values


def _first_row(cache: Cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of a single-row cache, without the batch axis."""
    keys, values = _layer_kv(cache, layer)
    return keys[0], values[0]


def _draw(logprobs_K: torch.Tensor, generator: torch.Generator) -> int:
    """Index of a sample from unnormalized log-probabilities (inverse CDF, float64)."""
    cdf = torch.cumsum(torch.exp(logprobs_K.double() - logprobs_K.max()), 0)
    u = float(torch.rand((), generator=generator, dtype=torch.float64)) * cdf[-1:]
    return min(int(torch.searchsorted(cdf, u, right=True)), cdf.numel() - 1)


def _nucleus(values_K: torch.Tensor, top_p: float) -> int:
    """How many of the sorted (descending) log-probabilities form the top-p nucleus."""
    probs = torch.softmax(values_K.double(), 0)
    before = torch.cumsum(probs, 0) - probs  # mass of the tokens ranked above each token
    return max(1, int((before < top_p).sum()))


def _candidates(logprobs_V: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens top-k then top-p keep, sorted by probability: (log-probabilities, ids)."""
    vocab = logprobs_V.numel()
    k = min(top_k, vocab) if top_k > 0 else min(_TOP_P_SHORTLIST, vocab)
    values, ids = torch.topk(logprobs_V, k)
    if top_k <= 0 and k < vocab and float(values.exp().sum()) < top_p:
        values, ids = torch.sort(logprobs_V, descending=True)  # the nucleus is wider than the shortlist
    n = _nucleus(values, top_p) if top_p < 1.0 else k
    return values[:n], ids[:n]


def sample_token(
    logits_V: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> tuple[int, float]:
    """Sample one token from raw logits; return it with its full-vocabulary logprob at the temperature."""
    logits_V = logits_V.float()
    if sampling.temperature <= 0:
        logprobs_V = torch.log_softmax(logits_V, -1)
        token = int(torch.argmax(logits_V))
        return token, float(logprobs_V[token])
    logprobs_V = torch.log_softmax(logits_V / sampling.temperature, -1)
    if sampling.top_k <= 0 and sampling.top_p >= 1.0:
        token = _draw(logprobs_V, generator)
    else:
        values, ids = _candidates(logprobs_V, sampling.top_k, sampling.top_p)
        token = int(ids[_draw(values, generator)])
    return token, float(logprobs_V[token])


def _ids(value: Any) -> set[int]:
    """Token ids from an int, a list of ints or None."""
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


def _default_eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """The eos ids of the model's generation config and config, plus the tokenizer's."""
    ids = _ids(getattr(model.generation_config, "eos_token_id", None)) | _ids(model.config.eos_token_id)
    return frozenset(ids | _ids(getattr(tokenizer, "eos_token_id", None)))


def _check_full_attention(model: PreTrainedModel) -> None:
    """Refuse models whose cache is not plain full attention (sliding windows, linear attention)."""
    layers = DynamicCache(config=model.config).layers
    if any(type(layer) is not DynamicLayer for layer in layers):
        raise EngineError(f"HFEngine supports full-attention models only, not {type(model).__name__}")


class HFEngine:
    """Runs a transformers causal LM in this process, batching concurrent requests continuously."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        eos_token_ids: Iterable[int] | None = None,
        max_batch_size: int = 32,
        max_prefill_tokens: int = 8192,
        seed: int | None = None,
        num_threads: int | None = None,
        vision: VisionProcessor | None = None,
        prefix_cache_tokens: int = 32768,
    ) -> None:
        """Serve ``model``; the tokenizer is optional, kept for callers, and its eos id stops generations.

        ``eos_token_ids`` replaces the default stop ids (the model's generation config and
        config eos ids, plus the tokenizer's). ``max_prefill_tokens`` bounds the prompt tokens
        prefilled between two decode steps; ``num_threads`` sets torch's intra-op threads
        (process-wide) when the worker starts; ``seed`` seeds requests that bring none.
        ``vision`` is a vision-language model's image processor: requests may then bring images
        (``ImageInput``s from the rollout, or raw images that are processed here).
        ``prefix_cache_tokens`` bounds the KV kept between the turns of a session: a request whose
        prompt extends its session's last prompt and sample prefills only the new tokens. The
        least recently used sessions go first; a weight update drops them all (0: keep none).
        """
        _check_full_attention(model)
        self._model = model.eval()
        self._tokenizer = tokenizer
        self._eos_ids = (
            frozenset(_ids(eos_token_ids))
            if eos_token_ids is not None
            else _default_eos_ids(model, tokenizer)
        )
        self._max_batch_size = max_batch_size
        self._max_prefill_tokens = max_prefill_tokens
        self._num_threads = num_threads
        self._vision = vision
        self._context = int(getattr(model.config.get_text_config(), "max_position_embeddings", 0) or 0)
        self._vocab = int(model.get_output_embeddings().weight.shape[0])
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._version = 0
        self._prefix_cache_tokens = prefix_cache_tokens
        self._sessions: OrderedDict[str, _SessionKV] = OrderedDict()
        self._cached_tokens = 0
        self.prefix_stats = {"hits": 0, "reused_tokens": 0, "prefilled_tokens": 0}
        self._cond = threading.Condition()
        self._pending: deque[_Request] = deque()
        self._updates: deque[_WeightUpdate] = deque()
        self._closing = False
        self._aborting = False
        self._thread: threading.Thread | None = None

    @property
    def model(self) -> PreTrainedModel:
        """The served model; change its weights through ``update_weights`` only."""
        return self._model

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The tokenizer given at construction (``turnrl.app.hf_engine`` loads the model's)."""
        return self._tokenizer

    @property
    def vision(self) -> VisionProcessor | None:
        """The image processor of a vision-language model (None for text-only models)."""
        return self._vision

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end every generation."""
        return self._eos_ids

    @property
    def weight_version(self) -> int:
        """How many weight updates have been applied."""
        return self._version

    async def __aenter__(self) -> HFEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[Any] = (),
        *,
        session: str | None = None,
    ) -> Generation:
        """Sample a continuation of ``prompt_ids``; concurrent calls share decode steps."""
        request = self._make_request(list(prompt_ids), sampling, images)
        request.session = session
        if request.max_new_tokens <= 0:
            return Generation([], [], "length", {"prompt_tokens": len(request.prompt_ids)})
        self._submit(self._pending, request)
        try:
            return await request.future
        except asyncio.CancelledError:
            request.cancelled = True
            raise

    async def update_weights(
        self, weights: Weights, *, version: int | None = None, strict: bool = True
    ) -> int:
        """Load new weights between two decode steps; return the new weight version.

        ``weights`` is a state dict or a saved checkpoint folder (its safetensors files are
        read; tied weights it leaves out are taken from the tensors they are tied to). The new
        version is ``version`` when given, else the current one plus one. Running requests
        keep their KV cache and go on with the new weights; each Generation's
        ``info["weight_versions"]`` gives the versions of its first and last token.
        """
        if isinstance(weights, str | os.PathLike):
            state_dict: Mapping[str, torch.Tensor] = await asyncio.to_thread(self._read_checkpoint, weights)
        else:
            state_dict = weights
        loop = asyncio.get_running_loop()
        update = _WeightUpdate(state_dict, strict, version, loop, loop.create_future())
        self._submit(self._updates, update)
        return await update.future

    def _read_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
        """A checkpoint folder's state dict, with the tied weights it omits filled in."""
        state = load_state_dict(path)
        names_by_storage: dict[int, list[str]] = {}
        for name, tensor in self._model.state_dict().items():
            names_by_storage.setdefault(tensor.data_ptr(), []).append(name)
        for names in names_by_storage.values():
            source = next((n for n in names if n in state), None)
            for name in names:
                if source is not None and name not in state:
                    state[name] = state[source]
        return state

    async def abort_all(self) -> None:
        """End every running and queued request now with finish_reason "abort", keeping the tokens
        sampled so far; the engine stays up (partial rollout: abort, update weights, resume)."""
        with self._cond:
            if self._thread is None:
                return
            self._aborting = True
            self._cond.notify_all()
        await asyncio.to_thread(self._wait_for_abort)

    def _wait_for_abort(self) -> None:
        with self._cond:
            while self._aborting and self._thread is not None and self._thread.is_alive():
                self._cond.wait(0.05)

    async def close(self) -> None:
        """Stop the worker; running and queued requests end with finish_reason "abort"."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join)

    def _make_request(
        self, prompt_ids: list[int], sampling: SamplingParams, images: Sequence[Any]
    ) -> _Request:
        """Validate a call and turn it into a request."""
        inputs = self._image_inputs(prompt_ids, images)
        if not prompt_ids:
            raise EngineError("empty prompt")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self._vocab:
            raise EngineError(f"prompt has token ids outside the vocabulary [0, {self._vocab})")
        if self._context and len(prompt_ids) >= self._context:
            raise EngineError(f"prompt of {len(prompt_ids)} tokens fills the {self._context}-token context")
        room = self._context - len(prompt_ids) if self._context else sampling.max_tokens
        generator = self._generator
        if sampling.seed is not None:
            generator = torch.Generator().manual_seed(sampling.seed)
        loop = asyncio.get_running_loop()
        stop_ids = self._eos_ids | frozenset(sampling.stop_token_ids)
        max_new = min(sampling.max_tokens, room)
        request = _Request(prompt_ids, sampling, stop_ids, max_new, generator, loop, loop.create_future())
        request.images = inputs
        return request

    def _image_inputs(self, prompt_ids: list[int], images: Sequence[Any]) -> list[ImageInput]:
        """The images as processed inputs, checked against the prompt's image tokens."""
        if self._vision is None:
            if images:
                name = type(self._model).__name__
                raise EngineError(f"{name} is text-only (no image processor): images are not supported")
            return []
        try:
            inputs = as_image_inputs(images, self._vision)
            self._vision.check(prompt_ids, inputs)
        except (ImageTokenError, ValueError) as exc:
            raise EngineError(str(exc)) from exc
        return inputs

    def _submit(self, queue: deque[Any], item: _Request | _WeightUpdate) -> None:
        """Queue work for the worker, starting it on first use."""
        with self._cond:
            if self._closing:
                raise EngineError("engine is closed")
            queue.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="turnrl-hf-engine", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    # ---- worker thread ----

    def _run(self) -> None:
        """The worker loop: weight updates, admissions, one decode step, repeat."""
        if self._num_threads:
            torch.set_num_threads(self._num_threads)
        batch = _Batch()
        while True:
            if self._aborting:
                self._abort(batch)
                batch = _Batch()
            work = self._take_work(len(batch))
            if work is None:
                break
            new, updates = work
            for update in updates:
                self._apply_update(update)
            try:
                with torch.inference_mode():
                    self._step(batch, new)
            except Exception as err:  # a failed step fails its requests, not the engine
                for request in [*batch.requests, *new]:
                    _resolve(request.loop, request.future, EngineError(f"generation failed: {err!r}"))
                batch = _Batch()
        self._abort(batch)

    def _take_work(self, running: int) -> tuple[list[_Request], list[_WeightUpdate]] | None:
        """Wait for something to do; take queued requests that fit. None when closing."""
        with self._cond:
            while not (self._closing or self._aborting or self._pending or self._updates or running):
                self._cond.wait()
            if self._aborting:
                return [], []
            if self._closing:
                return None
            new: list[_Request] = []
            budget = self._max_prefill_tokens
            while self._pending and running + len(new) < self._max_batch_size:
                if new and len(self._pending[0].prompt_ids) > budget:
                    break
                budget -= len(self._pending[0].prompt_ids)
                new.append(self._pending.popleft())
            updates = list(self._updates)
            self._updates.clear()
            return new, updates

    def _apply_update(self, update: _WeightUpdate) -> None:
        """Load a state dict into the model (between steps, so no forward pass sees half of it)."""
        try:
            with torch.no_grad():
                self._model.load_state_dict(dict(update.state_dict), strict=update.strict)
            self._sessions.clear()  # their KV was computed with the old weights
            self._cached_tokens = 0
            self._version = self._version + 1 if update.version is None else update.version
            _resolve(update.loop, update.future, self._version)
        except Exception as err:
            _resolve(update.loop, update.future, err)

    def _step(self, batch: _Batch, new: list[_Request]) -> None:
        """Prefill the new requests, merge them in, then decode one token for every row."""
        prefilled = [(r, cache) for r in new if not r.cancelled and (cache := self._prefill(r)) is not None]
        keep = [not r.cancelled for r in batch.requests]
        if prefilled or not all(keep):
            batch.rebuild(keep, prefilled)
        if len(batch):
            self._decode(batch)

    def _prefill(self, request: _Request) -> Cache | None:
        """Run the prompt alone (after its session's kept KV, when the prompt extends it), sample
        its first token; its cache, or None when it already finished."""
        cache = DynamicCache(config=self._model.config)
        start = self._reuse(request, cache)
        ids = torch.tensor([request.prompt_ids[start:]], device=self._model.device)
        extra = self._image_kwargs(request, ids) if request.images else {}
        if start:
            extra["position_ids"] = torch.arange(start, len(request.prompt_ids), device=ids.device)[None]
        out = self._model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1, **extra)
        self.prefix_stats["prefilled_tokens"] += ids.shape[1]
        reason = self._sample(request, out.logits[0, -1])
        if reason is not None:
            request.finish(reason)
            if self._keeps(request):
                self._remember(request, [_first_row(cache, layer) for layer in range(len(cache.layers))])
            return None
        return cache

    def _reuse(self, request: _Request, cache: Cache) -> int:
        """Seed ``cache`` with the session's kept KV when the prompt extends its tokens; how many."""
        saved = self._sessions.pop(request.session, None) if request.session is not None else None
        if saved is None:
            return 0
        self._cached_tokens -= len(saved.tokens)
        n = len(saved.tokens)
        if request.images or n >= len(request.prompt_ids) or request.prompt_ids[:n] != saved.tokens:
            return 0
        for layer, (keys, values) in enumerate(saved.rows):
            cache.update(keys[None], values[None], layer)
        self.prefix_stats["hits"] += 1
        self.prefix_stats["reused_tokens"] += n
        return n

    def _keeps(self, request: _Request) -> bool:
        """Whether a finished request's KV is kept for its session's next turn (text-only ones)."""
        return request.session is not None and not request.images and self._prefix_cache_tokens > 0

    def _remember(self, request: _Request, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep a finished request's KV for its session's next turn (see ``_keeps``)."""
        assert request.session is not None
        tokens = request.prompt_ids + request.token_ids[:-1]
        if not rows or rows[0][0].shape[-2] != len(tokens) or len(tokens) > self._prefix_cache_tokens:
            return
        old = self._sessions.pop(request.session, None)
        self._cached_tokens -= len(old.tokens) if old else 0
        self._sessions[request.session] = _SessionKV(tokens, [(k.clone(), v.clone()) for k, v in rows])
        self._cached_tokens += len(tokens)
        while self._cached_tokens > self._prefix_cache_tokens:
            _, evicted = self._sessions.popitem(last=False)
            self._cached_tokens -= len(evicted.tokens)

    def _image_kwargs(self, request: _Request, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Pixel values, grids and multimodal RoPE positions of a prompt with images; the
        request keeps its position shift for the decode steps."""
        assert self._vision is not None
        device = self._model.device
        pixels = torch.cat([image.pixel_values for image in request.images]).to(device, self._model.dtype)
        grid = torch.cat([image.grid_thw for image in request.images]).to(device)
        token_types = (ids == self._vision.image_token_id).int()
        positions, delta = self._model.model.get_rope_index(
            ids, mm_token_type_ids=token_types, image_grid_thw=grid
        )
        request.rope_delta = int(delta.reshape(-1)[0])
        return {"pixel_values": pixels, "image_grid_thw": grid, "position_ids": positions}

    def _decode(self, batch: _Batch) -> None:
        """One forward step for every row; finished rows leave the batch."""
        inputs = batch.step_inputs(self._model.device)
        out = self._model(**inputs, past_key_values=batch.cache, use_cache=True, logits_to_keep=1)
        batch.lengths = [n + 1 for n in batch.lengths]
        keep = []
        for row, request in enumerate(batch.requests):
            reason = self._sample(request, out.logits[row, -1])
            if reason is not None:
                request.finish(reason)
                if self._keeps(request):
                    self._remember(request, [batch.row(layer, row) for layer in range(batch.num_layers)])
            keep.append(reason is None and not request.cancelled)
        if not all(keep):
            batch.rebuild(keep, [])

    def _sample(self, request: _Request, logits_V: torch.Tensor) -> FinishReason | None:
        """Sample the request's next token; the finish reason if it ends the generation."""
        token, logprob = sample_token(logits_V, request.sampling, request.generator)
        return request.add_token(token, logprob, self._version)

    def _abort(self, batch: _Batch) -> None:
        """End every running and queued request with what it has so far."""
        with self._cond:
            queued = list(self._pending)
            self._pending.clear()
            updates = list(self._updates)
            self._updates.clear()
        for request in [*batch.requests, *queued]:
            request.finish("abort")
        if self._aborting:
            with self._cond:
                self._updates.extendleft(reversed(updates))  # an abort keeps pending weight updates
                self._aborting = False
                self._cond.notify_all()
            return
        for update in updates:
            _resolve(update.loop, update.future, EngineError("engine closed before the weight update"))
