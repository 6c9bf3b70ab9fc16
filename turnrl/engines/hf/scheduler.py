"""The worker thread that owns the model: continuous batching of generation requests.

Each iteration it (1) applies pending weight updates, (2) prefills newly arrived requests (text
prompts together in padded groups, ``prefill``, each after its session's kept KV when the prompt
extends it; prompts with images one by one), (3) merges them into the running batch, whose KV
caches are left-padded to a common length, and (4) runs one decode step for every running row
(on a GPU, replayed from a CUDA graph, ``graphs``).
Requests join and leave between steps; asyncio callers only wait on futures, so their loop stays
free. Text forward passes of Llama-family models run the engine's own (``fused``).
"""

from __future__ import annotations

import inspect
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, DynamicCache

from turnrl.engines.hf.fused import FusedForward
from turnrl.engines.hf.graphs import GraphedDecode
from turnrl.engines.hf.kv import KV, Batch, first_row
from turnrl.engines.hf.packed import PackedLinears, serve_packed
from turnrl.engines.hf.positions import image_kwargs
from turnrl.engines.hf.prefill import Row, chunks, inputs, row_kv
from turnrl.engines.hf.prefix_cache import PrefixCache
from turnrl.engines.hf.requests import Request, WeightUpdate, resolve
from turnrl.engines.hf.sampling import sample_tokens
from turnrl.support.openmp import release_pool
from turnrl.types import EngineError, FinishReason
from turnrl.vision.processor import VisionProcessor

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class Scheduler:
    """Queues work for the worker thread (started on first use) and runs it there."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_batch_size: int,
        max_prefill_tokens: int,
        num_threads: int | None,
        vision: VisionProcessor | None,
        prefix_cache: PrefixCache,
        packed: PackedLinears | None = None,
        fused: FusedForward | None = None,
        graphs: GraphedDecode | None = None,
    ) -> None:
        self.model = model
        self.packed = packed  # the model's linear layers on packed weights, repacked after updates
        self.fused = fused  # the engine's own forward for text (``fused``), repacked after updates
        self.graphs = graphs  # decode steps over a fixed KV pool, from CUDA graphs (``graphs``)
        self.version = 0  # weight updates applied
        self.tokens_sampled = 0  # tokens sampled since start, over every request
        self.prefix_cache = prefix_cache
        self._max_batch_size = max_batch_size
        self._max_prefill_tokens = max_prefill_tokens
        self._num_threads = num_threads
        self._vision = vision
        self._cond = threading.Condition()
        self._pending: deque[Request] = deque()
        self._updates: deque[WeightUpdate] = deque()
        self._closing = False
        self._aborting = False
        self._thread: threading.Thread | None = None
        # transformers >=5.24 names the KV-cache argument `cache` (`past_key_values` warns, then goes)
        forward = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"

    # ---- called from the callers' threads ----

    def submit(self, item: Request | WeightUpdate) -> None:
        """Queue a request or a weight update, starting the worker on first use."""
        with self._cond:
            if self._closing:
                raise EngineError("engine is closed")
            if isinstance(item, Request):
                self._pending.append(item)
            else:
                self._updates.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="turnrl-hf-engine", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def abort(self) -> None:
        """End every running and queued request with what it has; blocks until done."""
        with self._cond:
            if self._thread is None:
                return
            self._aborting = True
            self._cond.notify_all()
            while self._aborting and self._thread.is_alive():
                self._cond.wait(0.05)

    def close(self) -> None:
        """Stop the worker (its requests end with "abort"); blocks until it is gone."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    # ---- the worker thread ----

    def _run(self) -> None:
        """The worker loop: weight updates, admissions, one decode step, repeat."""
        if self._num_threads:
            torch.set_num_threads(self._num_threads)
        if self.packed is not None:
            serve_packed()
        batch = self._new_batch()
        while True:
            if self._aborting:
                self._abort(batch)
                batch = self._new_batch()
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
                    resolve(request.loop, request.future, EngineError(f"generation failed: {err!r}"))
                batch = self._new_batch()
        self._abort(batch)

    def _new_batch(self) -> Batch:
        """An empty running batch (in the CUDA-graph decode's KV pool, when there is one)."""
        return Batch(self.graphs.pool if self.graphs is not None else None)

    def _take_work(self, running: int) -> tuple[list[Request], list[WeightUpdate]] | None:
        """Wait for something to do; take queued requests that fit. None when closing."""
        with self._cond:
            while not (self._closing or self._aborting or self._pending or self._updates or running):
                release_pool()  # idle: the cores go to whichever thread computes next, unthrottled
                self._cond.wait()
            if self._aborting:
                return [], []
            if self._closing:
                return None
            new: list[Request] = []
            budget = self._max_prefill_tokens
            while self._pending and running + len(new) < self._max_batch_size:
                if new and len(self._pending[0].prompt_ids) > budget:
                    break
                budget -= len(self._pending[0].prompt_ids)
                new.append(self._pending.popleft())
            updates = list(self._updates)
            self._updates.clear()
            return new, updates

    def _apply_update(self, update: WeightUpdate) -> None:
        """Load a state dict into the model (between steps, so no forward pass sees half of it)."""
        try:
            with torch.no_grad():
                self.model.load_state_dict(dict(update.state_dict), strict=update.strict)
                self.repack()
            self.prefix_cache.clear()  # its KV was computed with the old weights
            self.version = self.version + 1 if update.version is None else update.version
            resolve(update.loop, update.future, self.version)
        except Exception as err:
            resolve(update.loop, update.future, err)

    def _step(self, batch: Batch, new: list[Request]) -> None:
        """Prefill the new requests, merge them in, then decode one token for every row."""
        live = [r for r in new if not r.cancelled]
        prefilled = [p for r in live if r.images and (p := self._prefill_alone(r)) is not None]
        prefilled += self._prefill_together([r for r in live if not r.images])
        keep = [not r.cancelled for r in batch.requests]
        if prefilled or not all(keep):
            batch.rebuild(keep, prefilled)
        if len(batch):
            self._decode(batch)

    def _prefill_together(self, requests: list[Request]) -> list[tuple[Request, list[KV]]]:
        """Prefill text prompts in padded groups (``prefill``), each after its session's kept KV,
        and sample their first tokens; those that go on, with their KV."""
        rows = [Row(r, self.prefix_cache.take(r)) for r in requests]
        going: list[tuple[Request, list[KV]]] = []
        for group in chunks(rows, self._max_prefill_tokens):
            kwargs, cache = inputs(group, self.model.device)
            cache = cache if cache is not None else DynamicCache(config=self.model.config)
            logits = self._logits(kwargs, cache)
            self.prefix_cache.stats["prefilled_tokens"] += sum(len(r.new) for r in group)
            reasons = self._sample([r.request for r in group], logits)
            for b, (row, reason) in enumerate(zip(group, reasons, strict=True)):
                kv = row_kv(cache, group, b)
                if reason is None:
                    going.append((row.request, kv))
                else:
                    self._finish(row.request, reason, kv)
        return going

    def _prefill_alone(self, request: Request) -> tuple[Request, list[KV]] | None:
        """Run a prompt with images alone and sample its first token; it with its KV, or None when
        it already finished."""
        assert self._vision is not None
        self.prefix_cache.take(request)  # a turn with images replaces its session's kept KV
        cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([request.prompt_ids], device=self.model.device)
        extra: dict[str, Any] = image_kwargs(self.model, self._vision, request, ids)
        extra[self._cache_arg] = cache
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **extra)
        self.prefix_cache.stats["prefilled_tokens"] += ids.shape[1]
        (reason,) = self._sample([request], out.logits[:, -1])
        kv = [first_row(cache, layer) for layer in range(len(cache.layers))]
        if reason is not None:
            self._finish(request, reason, kv)
            return None
        return request, kv

    def _decode(self, batch: Batch) -> None:
        """One forward step for every row; finished rows leave the batch."""
        assert batch.cache is not None
        if self.graphs is not None:
            logits = self.graphs.decode(batch)
        else:
            logits = self._logits(batch.step_inputs(self.model.device), batch.cache)
        batch.lengths = [n + 1 for n in batch.lengths]
        reasons = self._sample(batch.requests, logits)
        keep = []
        for row, (request, reason) in enumerate(zip(batch.requests, reasons, strict=True)):
            if reason is not None:
                self._finish(request, reason, [batch.row(layer, row) for layer in range(batch.num_layers)])
            keep.append(reason is None and not request.cancelled)
        if not all(keep):
            batch.rebuild(keep, [])

    def repack(self) -> None:
        """Drop the packed and fused weight copies and the captured graphs: the next forward makes
        them from the weights."""
        for copies in (self.packed, self.fused):
            if copies is not None:
                copies.repack()
        if self.graphs is not None:
            self.graphs.reset()

    def _logits(self, inputs: dict[str, Any], cache: Cache) -> torch.Tensor:
        """The last position's logits ``[B, V]`` of a text forward pass after ``cache`` (appended to)."""
        if self.fused is not None:
            return self.fused(inputs["input_ids"], inputs["position_ids"], inputs["attention_mask"], cache)
        out = self.model(**inputs, **{self._cache_arg: cache}, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def _finish(self, request: Request, reason: FinishReason, kv: list[KV]) -> None:
        """Hand a finished generation over; keep its KV for its session's next turn."""
        request.finish(reason)
        if self.prefix_cache.keeps(request):
            self.prefix_cache.remember(request, kv)

    def _sample(self, requests: list[Request], logits_B_V: torch.Tensor) -> list[FinishReason | None]:
        """Sample every request's next token; per request, the finish reason if it ends the generation."""
        drawn = sample_tokens(logits_B_V, [r.sampling for r in requests], [r.generator for r in requests])
        self.tokens_sampled += len(requests)
        return [r.add_token(t, lp, self.version) for r, (t, lp) in zip(requests, drawn, strict=True)]

    def _abort(self, batch: Batch) -> None:
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
            resolve(update.loop, update.future, EngineError("engine closed before the weight update"))
