"""vLLM in this process (``AsyncLLM``): token ids in, sampled ids and logprobs out.

Optional: ``vllm`` is not a dependency of turnrl (it needs a GPU build); importing this
module works without it and ``VLLMEngine`` raises ``EngineError`` when vllm is missing.
Each request asks for ``logprobs=0`` (the sampled token's logprob only). vLLM's logprobs
are those of the raw model (temperature 1) unless the engine is built with
``logprobs_mode="processed_logprobs"`` (pass it in ``engine_kwargs``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from turnrl.types import EngineError, FinishReason, Generation, SamplingParams


def _import_vllm() -> Any:
    """The vllm module, or EngineError when it is not installed."""
    try:
        import vllm
    except ImportError as exc:
        raise EngineError(f"VLLMEngine needs vllm (pip install vllm on a GPU machine): {exc}") from None
    return vllm


def vllm_sampling_params(vllm: Any, sampling: SamplingParams) -> Any:
    """vLLM's SamplingParams for one generation: final output only, sampled-token logprobs."""
    from vllm.sampling_params import RequestOutputKind

    return vllm.SamplingParams(
        n=1,
        temperature=max(sampling.temperature, 0.0),
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else -1,
        max_tokens=sampling.max_tokens,
        stop_token_ids=list(sampling.stop_token_ids),
        seed=sampling.seed,
        logprobs=0,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def to_generation(output: Any) -> Generation:
    """A Generation from vLLM's final RequestOutput (``outputs[0]``)."""
    completion = output.outputs[0]
    ids = [int(t) for t in completion.token_ids]
    steps = completion.logprobs or []
    if len(steps) != len(ids):
        raise EngineError(f"vLLM returned {len(ids)} tokens but {len(steps)} logprobs")
    logprobs = [float(step[token].logprob) for step, token in zip(steps, ids, strict=True)]
    reason: FinishReason = (
        completion.finish_reason if completion.finish_reason in ("stop", "length") else "abort"
    )
    return Generation(ids, logprobs, reason, {"stop_reason": completion.stop_reason})


class VLLMEngine:
    """Runs vLLM's AsyncLLM in this process."""

    def __init__(self, model: str, **engine_kwargs: Any) -> None:
        """Build the engine for ``model``; ``engine_kwargs`` go to vLLM's ``AsyncEngineArgs``."""
        self._vllm = _import_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **engine_kwargs))

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[Any] = (),
        *,
        session: str | None = None,
    ) -> Generation:
        """Sample a continuation of ``prompt_ids`` (images go to vLLM's ``multi_modal_data``)."""
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=[int(t) for t in prompt_ids])
        if images:
            prompt["multi_modal_data"] = {"image": [getattr(i, "image", i) for i in images]}  # PIL images
        final = None
        params = vllm_sampling_params(self._vllm, sampling)
        async for output in self._engine.generate(prompt, params, uuid.uuid4().hex):
            final = output
        if final is None:
            raise EngineError("vLLM returned no output")
        return to_generation(final)

    async def close(self) -> None:
        """Shut the engine down."""
        self._engine.shutdown()
