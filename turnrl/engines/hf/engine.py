"""The embedded engine: a transformers causal LM served in this process with continuous batching.

``HFEngine`` is the facade: it validates requests and hands them to the worker thread
(``scheduler``), which batches them (``kv``), keeps sessions' KV between turns
(``prefix_cache``), places image tokens (``positions``) and samples (``sampling``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from turnrl.engines.hf.fused import FusedForward, fusable
from turnrl.engines.hf.graphs import GraphedDecode
from turnrl.engines.hf.packed import PackedLinears, packing_available
from turnrl.engines.hf.prefix_cache import PrefixCache
from turnrl.engines.hf.requests import Request, WeightUpdate
from turnrl.engines.hf.scheduler import Scheduler
from turnrl.engines.weights import load_state_dict
from turnrl.support.openmp import release_pool
from turnrl.types import TOKEN_SINK, EngineError, Generation, SamplingParams, Weights
from turnrl.vision.processor import ImageInput, ImageTokenError, VisionProcessor, as_image_inputs

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


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
        packed_weights: bool | None = None,
        cuda_graphs: bool | None = None,
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
        ``packed_weights`` serves the linear layers from oneDNN-packed copies of their weights
        (``packed``: 2-3x faster matrix products on CPU, the same float32 arithmetic); None: when
        the model is on CPU in float32 or bfloat16 and torch has oneDNN. With it, Llama, Mistral,
        Qwen2 and Qwen3 text models run the engine's own forward pass on fused packed weights
        (``fused``). Only the engine's own forward passes read the packs; they are refreshed by
        ``update_weights``, so weights changed in place behind the engine's back are not seen.
        ``cuda_graphs`` replays decode steps from CUDA graphs over a KV pool allocated once for
        ``max_batch_size`` rows (``graphs``); None: on for those text models on a GPU.
        """
        _check_full_attention(model)
        self._model = model.eval()
        if packed_weights is None:
            packed_weights = packing_available(model)
        elif packed_weights and not packing_available(model):
            raise EngineError(
                "packed_weights needs a float32 or bfloat16 model on CPU and torch with oneDNN"
                " (bfloat16: a processor with oneDNN's bfloat16 support)"
            )
        packed = PackedLinears(model) if packed_weights else None
        fused = FusedForward(model) if packed_weights and vision is None and fusable(model) else None
        graphable = model.device.type == "cuda" and vision is None and fusable(model)
        if cuda_graphs and not graphable:
            raise EngineError(
                "cuda_graphs needs a Llama, Mistral, Qwen2 or Qwen3 text model on a CUDA device"
            )
        graphs = None
        if graphable and cuda_graphs is not False:
            graphs = GraphedDecode(model, max_batch_size, capture=torch.cuda.is_available())
        self._tokenizer = tokenizer
        self._eos_ids = (
            frozenset(_ids(eos_token_ids))
            if eos_token_ids is not None
            else _default_eos_ids(model, tokenizer)
        )
        self._vision = vision
        self._context = int(getattr(model.config.get_text_config(), "max_position_embeddings", 0) or 0)
        self._vocab = int(model.get_output_embeddings().weight.shape[0])
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._prefix_cache = PrefixCache(prefix_cache_tokens)
        self._scheduler = Scheduler(
            self._model,
            max_batch_size=max_batch_size,
            max_prefill_tokens=max_prefill_tokens,
            num_threads=num_threads,
            vision=vision,
            prefix_cache=self._prefix_cache,
            packed=packed,
            fused=fused,
            graphs=graphs,
        )

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
        return self._scheduler.version

    @property
    def tokens_sampled(self) -> int:
        """Tokens sampled since the engine started, over every request (progress for tests and bars)."""
        return self._scheduler.tokens_sampled

    @property
    def prefix_stats(self) -> dict[str, int]:
        """Prefix-cache counters: hits, reused_tokens, prefilled_tokens."""
        return self._prefix_cache.stats

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
        release_pool()  # this thread hands the cores to the engine's worker (``turnrl.support.openmp``)
        request = self._make_request(list(prompt_ids), sampling, images)
        request.session, request.sink = session, TOKEN_SINK.get()
        if request.max_new_tokens <= 0:
            return Generation([], [], "length", {"prompt_tokens": len(request.prompt_ids)})
        self._scheduler.submit(request)
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
        update = WeightUpdate(state_dict, strict, version, loop, loop.create_future())
        self._scheduler.submit(update)
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
        await asyncio.to_thread(self._scheduler.abort)

    async def close(self) -> None:
        """Stop the worker; running and queued requests end with finish_reason "abort"; free the
        packed weights, and the CUDA graphs with their KV pool."""
        await asyncio.to_thread(self._scheduler.close)
        self._scheduler.repack()
        if self._scheduler.graphs is not None:
            self._scheduler.graphs.pool.release()

    def _make_request(
        self, prompt_ids: list[int], sampling: SamplingParams, images: Sequence[Any]
    ) -> Request:
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
        request = Request(prompt_ids, sampling, stop_ids, max_new, generator, loop, loop.create_future())
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
