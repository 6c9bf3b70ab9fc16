"""slime's custom generate function running turnrl trajectories: keep the turnrl env, train with slime.

Use ``--custom-generate-function-path turnrl.integrations.slime.generate``. slime calls
``generate(args, sample, sampling_params)`` for each sample; it runs one turnrl trajectory against
slime's SGLang router (``http://{args.sglang_router_ip}:{args.sglang_router_port}``, native
``/generate`` with ``input_ids`` and ``return_logprob``, through turnrl's ``SGLangEngine``) and fills
the sample the way slime's own generate does:

- ``tokens``: prompt + response ids; ``response_length``: the number of response ids;
- ``loss_mask`` / ``rollout_log_probs``: per response token, 1 and the server's logprob for model
  tokens, 0 and 0.0 for env and template tokens;
- ``response``: the response decoded (env text included, special tokens kept);
- ``status``: COMPLETED (env_done, no_tool_call), TRUNCATED (max_turns, token_budget, length),
  ABORTED (aborted, e.g. slime aborting the servers for a weight update), FAILED (env_error,
  engine_error, internal_error; ABORTED where slime's Sample has no FAILED);
- ``reward``: turnrl's reward when it computed one (reward function, env score, non-zero step
  rewards), else left None for slime's reward model (``--custom-rm-path`` / ``--rm-type``);
- ``weight_versions``: the server's weight version per model turn; ``metadata["turnrl"]``: stop
  reason, model turns, per-turn rewards and spans, error.
- for a vision-language model (``args.hf_checkpoint`` has an image processor):
  ``multimodal_inputs["images"]``, every image of the sequence (prompt, observations, tool
  results) in order, and ``multimodal_train_inputs``, the processor outputs for them
  (``pixel_values``, ``image_grid_thw``) that slime's trainer feeds the model; the images go to
  SGLang with every turn as ``image_data``.

The budget is slime's: ``sampling_params["max_new_tokens"]`` (``--rollout-max-response-len``) bounds
the whole response, ``args.rollout_max_context_len`` prompt + response. Temperature, top-p, top-k,
stop token ids and ``sampling_seed`` come from slime's sampling params (a seed becomes turnrl's
per-turn seeds); the other SGLang params slime sets (``stop``, ...) are passed through. An episode
cannot be continued from partial tokens, so an ABORTED sample handed back is run again from its
start. Top-p replay data and routed experts are not recorded.

Settings: ``args.turnrl_config`` (a turnrl YAML) and ``args.turnrl`` (overrides), set through
slime's ``--custom-config-path`` YAML; per sample, ``metadata["turnrl_env"]`` names its env (see
``turnrl.integrations.agent_settings``). ``sample.prompt`` must be chat messages (or a plain string,
taken as one user message): do not pass ``--apply-chat-template``, turnrl renders the template. A
prompt's images come as image parts of its messages, or in ``sample.multimodal_inputs["images"]``
placed at its ``<image>`` placeholders (before the first user text when it has none).
"""

from __future__ import annotations

import asyncio
import json
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from turnrl.engines.sglang import SGLangEngine
from turnrl.integrations.agent_settings import (
    ENV_FIELD,
    chat_encoder,
    computed_reward,
    env_factory,
    load_settings,
    plain,
    trainer_limits,
    trainer_sample,
    turn_max_tokens,
)
from turnrl.rollout.failures import FAILURES
from turnrl.rollout.loop import run_trajectory
from turnrl.rollout.spec import RolloutSpec
from turnrl.types import Generation, SamplingParams, StopReason, Trajectory
from turnrl.types import Sample as TurnrlSample
from turnrl.vision.processor import VisionProcessor

# slime's sampling params that turnrl sets itself for every turn (the others pass through)
OWNED = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "max_new_tokens",
        "stop_token_ids",
        "sampling_seed",
        "skip_special_tokens",
        "no_stop_trim",
        "custom_params",  # asks for top-p replay data, which turnrl does not record
    }
)
COMPLETED = frozenset(
    {StopReason.ENV_DONE, StopReason.NO_TOOL_CALL, StopReason.AGENT_DONE, StopReason.MODEL_STOP}
)
FAILED = FAILURES
TIMEOUT_S = 3600.0  # one /generate request

_LOCK = threading.Lock()
_MODELS: dict[str, tuple[Any, VisionProcessor | None]] = {}
IMAGE_PLACEHOLDER = "<image>"  # where slime's datasets put a prompt's images in the text
_ENGINES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, SGLangEngine]] = (
    weakref.WeakKeyDictionary()
)


def status_name(stop: StopReason) -> str:
    """The name of slime's ``Sample.Status`` for a turnrl stop reason."""
    if stop in COMPLETED:
        return "COMPLETED"
    if stop.truncated:
        return "TRUNCATED"
    if stop in FAILED:
        return "FAILED"
    return "ABORTED"


def _model(path: str) -> tuple[Any, VisionProcessor | None]:
    """The checkpoint's tokenizer and, for a vision-language model, its image processor; read once."""
    with _LOCK:
        if path not in _MODELS:
            from turnrl.models import load_tokenizer, load_vision_processor

            tokenizer = load_tokenizer(path)
            _MODELS[path] = (tokenizer, load_vision_processor(path, tokenizer))
        return _MODELS[path]


def _engine(url: str, eos: Sequence[int], extra: Mapping[str, Any]) -> SGLangEngine:
    """One SGLangEngine (one connection pool) per event loop, router and pass-through params."""
    loop = asyncio.get_running_loop()
    key = json.dumps([url, sorted(eos), extra], sort_keys=True, default=str)
    engines = _ENGINES.setdefault(loop, {})
    if key not in engines:
        engines[key] = SGLangEngine(url, eos_token_ids=eos, timeout_s=TIMEOUT_S, extra_sampling_params=extra)
    return engines[key]


async def close_engines() -> None:
    """Close this event loop's connections to slime's router (at shutdown; later calls reconnect)."""
    engines = _ENGINES.pop(asyncio.get_running_loop(), {})
    for engine in engines.values():
        await engine.close()


class _VersionRecorder:
    """Delegates to an engine and keeps the weight version the server reports for each turn."""

    def __init__(self, engine: SGLangEngine) -> None:
        self.engine = engine
        self.weight_versions: list[str] = []

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[Any] = (),
        *,
        session: str | None = None,
    ) -> Generation:
        gen = await self.engine.generate(prompt_ids, sampling, images, session=session)
        versions = (gen.info or {}).get("weight_versions")
        if versions:
            self.weight_versions.append(str(versions[-1]))
        return gen

    async def close(self) -> None:
        """The shared engine stays open for the next trajectories."""


def _prompt(sample: Any) -> Any:
    """The sample's chat messages, its ``multimodal_inputs["images"]`` placed as image parts where
    the text says ``<image>`` (slime's datasets), or before the first user message's text."""
    prompt = sample.prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    images = list((getattr(sample, "multimodal_inputs", None) or {}).get("images") or [])
    return with_image_parts(messages, images) if images else messages


def with_image_parts(messages: Sequence[Mapping[str, Any]], images: Sequence[Any]) -> list[dict[str, Any]]:
    """``messages`` with ``images`` as ``{"type": "image"}`` parts: each ``<image>`` in a text
    content takes the next image; without any ``<image>``, all go before the first user text."""
    out = [dict(m) for m in messages]
    texts = [i for i, m in enumerate(out) if isinstance(m.get("content"), str)]
    marked = sum(str(out[i]["content"]).count(IMAGE_PLACEHOLDER) for i in texts)
    if not marked:
        first = next((i for i in texts if out[i].get("role") == "user"), None)
        if first is None:
            raise ValueError("the prompt has images but no user message with text to put them in")
        parts = [{"type": "image", "image": image} for image in images]
        out[first]["content"] = [*parts, {"type": "text", "text": out[first]["content"]}]
        return out
    if marked != len(images):
        raise ValueError(f"the prompt has {marked} {IMAGE_PLACEHOLDER} placeholders for {len(images)} images")
    pending = iter(images)
    for i in texts:
        pieces = str(out[i]["content"]).split(IMAGE_PLACEHOLDER)
        if len(pieces) == 1:
            continue
        content: list[dict[str, Any]] = []
        for k, text in enumerate(pieces):
            if k:
                content.append({"type": "image", "image": next(pending)})
            if text:
                content.append({"type": "text", "text": text})
        out[i]["content"] = content
    return out


def _turnrl_sample(sample: Any) -> TurnrlSample:
    """The turnrl sample of a slime sample: its prompt, its metadata, ``label`` as ground truth; the
    id (a GRPO group) is ``metadata["id"]``, else slime's ``group_index``, else its ``index``."""
    metadata = dict(plain(dict(sample.metadata or {})))
    group = metadata.get("id")
    if group is None:
        group = sample.group_index if sample.group_index is not None else sample.index
    fields = {k: v for k, v in metadata.items() if k not in ("id", ENV_FIELD, "turnrl")}
    if sample.label is not None:
        fields.setdefault("label", sample.label)
    return trainer_sample(_prompt(sample), fields, str(group))


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    """Run one turnrl trajectory for ``sample`` and fill it in (see the module docstring)."""
    settings = load_settings(getattr(args, "turnrl_config", None), getattr(args, "turnrl", None))
    tokenizer, vision = _model(str(args.hf_checkpoint))
    params = dict(sampling_params)
    budget = int(params["max_new_tokens"])
    eos = [int(tokenizer.eos_token_id)] if tokenizer.eos_token_id is not None else []
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
    extra = {k: v for k, v in params.items() if k not in OWNED and v is not None}
    engine = _VersionRecorder(_engine(url, eos, extra))
    top_k = params.get("top_k")
    seed = params.get("sampling_seed")
    template_kwargs = {
        **(getattr(sample, "apply_chat_template_kwargs", None) or {}),
        **settings.chat.template_kwargs,
    }
    spec = RolloutSpec(
        env_factory=env_factory(settings, (sample.metadata or {}).get(ENV_FIELD)),
        engine=engine,
        encoder=chat_encoder(tokenizer, template_kwargs, vision),
        sampling=SamplingParams(
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=max(int(top_k), 0) if top_k is not None else 0,
            max_tokens=turn_max_tokens(settings, budget),
            stop_token_ids=tuple(int(t) for t in params.get("stop_token_ids") or ()),
            seed=int(seed) if seed is not None else None,
        ),
        limits=trainer_limits(
            settings,
            max_response_tokens=budget,
            max_context_tokens=getattr(args, "rollout_max_context_len", None),
        ),
        check=settings.chat.check,
        rewards=settings.reward_routing(),
    )
    traj = await run_trajectory(_turnrl_sample(sample), spec, int(sample.index or 0))
    if not traj.prompt_ids:
        raise RuntimeError(f"turnrl trajectory for sample {sample.index} could not start: {traj.error}")
    fill(sample, traj, spec.encoder.template.decode(traj.response_ids), engine.weight_versions)
    return sample


def fill(sample: Any, traj: Trajectory, response: str, weight_versions: list[str]) -> None:
    """Write a trajectory into a slime sample (what ``generate`` returns)."""
    sample.tokens = traj.prompt_ids + traj.response_ids
    sample.response = response
    sample.response_length = len(traj.response_ids)
    sample.loss_mask = list(traj.loss_mask)
    sample.rollout_log_probs = list(traj.rollout_logprobs)
    name = status_name(traj.stop_reason)
    status = type(sample).Status
    sample.status = getattr(status, name, None) or status.ABORTED
    sample.reward = computed_reward(traj)
    sample.weight_versions = list(weight_versions)
    if traj.images:  # every image of the sequence, and the processor outputs slime trains on
        sample.multimodal_inputs = {"images": list(traj.images)}
        sample.multimodal_train_inputs = dict(traj.multimodal_inputs) or None
    sample.metadata = {
        **(sample.metadata or {}),
        "turnrl": {
            "stop_reason": traj.stop_reason.value,
            "num_turns": traj.num_turns,
            "turn_rewards": list(traj.turn_rewards),
            "turns": [[t.role, t.start, t.end] for t in traj.turns],
            "error": traj.error,
        },
    }
