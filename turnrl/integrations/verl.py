"""verl's agent loop running turnrl trajectories: keep the turnrl env and config, train with verl.

``TurnRLAgentLoop`` is an ``AgentLoopBase`` registered as ``"turnrl"``. verl's agent-loop worker
builds one per data row and awaits ``run(sampling_params, **row)``; it runs one turnrl trajectory
(env, chat encoding, limits and rewards from the turnrl config) and generates through verl's own
server manager, token ids in and token ids + logprobs out, so nothing is re-tokenized. It returns
verl's ``AgentLoopOutput``:

- ``prompt_ids``: the prompt turnrl encoded (env tools included);
- ``response_ids`` / ``response_mask``: every response token, model (1) and env (0) interleaved;
- ``response_logprobs``: the server's logprob per token (0.0 on env tokens), when verl asks for
  them (``rollout.calculate_log_probs``), else None;
- ``reward_score``: turnrl's reward when it computed one (reward function, env score or non-zero
  step rewards), else None so that verl's reward function scores the response;
- ``num_turns``: verl's count (prompt + every model turn + every env turn); ``extra_fields`` hold
  ``turn_scores`` (env reward per model turn), ``turnrl_stop_reason``, ``turnrl_model_turns``,
  ``turnrl_error`` and, when the servers report them, ``min_global_steps`` / ``max_global_steps``.

Images: with verl's processor of a vision-language model (its ``image_processor`` is all turnrl
reads), image parts in the row's ``raw_prompt`` (as verl's dataset builds them), in observations and
in tool results are encoded by turnrl (image tokens expanded), every image so far goes to verl's
server with each turn as ``image_data`` (PIL images), and the output's ``multi_modal_data`` holds
``{"images": [...]}``, all of the trajectory's images in order, for verl to re-process for training.

verl's lengths are the budget: the response never exceeds ``rollout.response_length`` (turnrl stops
the trajectory with ``token_budget``, or ``length`` for one turn, before it would), a prompt longer
than ``rollout.prompt_length`` is not generated from (the trajectory ends with ``engine_error`` and
the prompt is cut from the left, as verl does), and prompt + response stay within their sum.

Settings come from the agent-loop config entry (``turnrl_config``: a turnrl YAML; ``turnrl``: inline
overrides) and per row from a ``turnrl_env`` field (see ``turnrl.integrations.agent_settings``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register

from turnrl.engines.http import finish
from turnrl.integrations.agent_settings import (
    ENV_FIELD,
    AgentSettings,
    chat_encoder,
    computed_reward,
    env_factory,
    load_settings,
    plain,
    trainer_limits,
    trainer_sample,
    turn_max_tokens,
    vision_processor,
)
from turnrl.rollout.loop import run_trajectory
from turnrl.rollout.spec import RolloutSpec
from turnrl.types import EngineError, Generation, Sample, SamplingParams, Trajectory

NAME = "turnrl"  # the agent name rows give in their ``agent_name`` field
_ABORTED = frozenset({"abort", "aborted"})


def finish_reason(
    stop_reason: str | None, token_ids: Sequence[int], max_tokens: int, stop_ids: frozenset[int]
) -> str:
    """turnrl's finish reason for a verl ``TokenOutput``. SGLang's servers say stop / length / abort;
    vLLM's say ``completed`` for both stop and length, so a generation that used all its
    ``max_tokens`` without ending on a stop id counts as length."""
    if stop_reason in _ABORTED:
        return "abort"
    if stop_reason in ("stop", "length"):
        return stop_reason
    if len(token_ids) >= max_tokens and not (token_ids and token_ids[-1] in stop_ids):
        return "length"
    return "stop"


class VerlServerEngine:
    """A turnrl Engine over verl's server manager (``AgentLoopBase.server_manager``).

    Every turn of one trajectory goes out with one ``request_id`` (verl keeps a request's turns
    on one server for its prefix cache). verl's sampling params are sent as given, with this
    turn's ``max_tokens`` and ``logprobs: True``. ``max_prompt_tokens`` refuses a first prompt
    longer than verl's prompt length.
    """

    def __init__(
        self,
        server_manager: Any,
        sampling_params: Mapping[str, Any],
        *,
        stop_token_ids: Iterable[int] = (),
        request_id: str | None = None,
        max_prompt_tokens: int | None = None,
    ) -> None:
        self.server_manager = server_manager
        self.request_id = request_id or uuid.uuid4().hex
        self._params = dict(sampling_params)
        self._stop_ids = frozenset(int(t) for t in stop_token_ids)
        self._max_prompt = max_prompt_tokens
        self._calls = 0
        self.global_steps: list[int] = []  # per turn, the weight version the server reported

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[Any] = (),
        *,
        session: str | None = None,
    ) -> Generation:
        """One model turn through verl's server manager."""
        if self._calls == 0 and self._max_prompt is not None and len(prompt_ids) > self._max_prompt:
            raise EngineError(
                f"prompt of {len(prompt_ids)} tokens exceeds verl's rollout.prompt_length={self._max_prompt}"
            )
        self._calls += 1
        params = dict(self._params, max_tokens=sampling.max_tokens, logprobs=True)
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        extra: dict[str, Any] = {}
        if images:  # PIL images, as verl's servers take them (the ids hold the expanded image tokens)
            extra["image_data"] = [getattr(image, "image", image) for image in images]
        out = await self.server_manager.generate(
            request_id=self.request_id, prompt_ids=list(prompt_ids), sampling_params=params, **extra
        )
        ids = [int(t) for t in out.token_ids]
        if out.log_probs is None or len(out.log_probs) != len(ids):
            raise EngineError(f"verl's server returned {len(ids)} tokens but no logprob for each")
        logprobs = [float(x) for x in out.log_probs]
        stop_ids = self._stop_ids | frozenset(sampling.stop_token_ids)
        reason = finish_reason(out.stop_reason, ids, sampling.max_tokens, stop_ids)
        info: dict[str, Any] = {"request_id": self.request_id, "stop_reason": out.stop_reason}
        gen = finish(ids, logprobs, reason, stop_ids, info, eos_known=bool(self._stop_ids))
        step = (out.extra_fields or {}).get("global_steps")
        if isinstance(step, int) and not isinstance(step, bool):
            gen.versions = [step] * len(gen.token_ids)
            self.global_steps.append(step)
        return gen

    async def close(self) -> None:
        """Nothing to release: verl owns its servers."""


def _container(value: Any) -> dict[str, Any]:
    """A DictConfig (what hydra hands over) or a mapping, as a plain dict."""
    if value is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(value, DictConfig):
            container = OmegaConf.to_container(value, resolve=True)
            return {str(k): v for k, v in container.items()} if isinstance(container, dict) else {}
    except ImportError:  # pragma: no cover - omegaconf comes with verl
        pass
    return dict(plain(dict(value)))


def verl_sample(row: Mapping[str, Any]) -> Sample:
    """The turnrl sample of a verl row: ``raw_prompt`` is the prompt; the id (a GRPO group) is the
    row's ``id``, else verl's ``uid``, else ``extra_info.index``; other fields go to metadata."""
    if "raw_prompt" not in row:
        raise KeyError("the verl row has no 'raw_prompt' (verl's RLHFDataset provides it)")
    fields = {k: v for k, v in row.items() if k not in ("raw_prompt", "agent_name")}
    extra = row.get("extra_info")
    index = extra.get("index") if isinstance(extra, Mapping) else None
    group = row.get("id") or row.get("uid") or (index if index is not None else uuid.uuid4().hex)
    return trainer_sample(row["raw_prompt"], fields, str(group))


@register(NAME)
class TurnRLAgentLoop(AgentLoopBase):
    """One turnrl trajectory per data row, generated through verl's servers."""

    def __init__(
        self,
        *args: Any,
        turnrl_config: str | None = None,
        turnrl: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """verl's arguments, plus ``turnrl_config`` (a turnrl YAML) and ``turnrl`` (inline
        overrides), both from the agent-loop config entry."""
        super().__init__(*args, **kwargs)
        self.settings: AgentSettings = load_settings(turnrl_config, _container(turnrl))
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.response_length = int(self.rollout_config.response_length)
        self.trajectory: Trajectory | None = None  # the last trajectory run, for inspection
        image_processor = getattr(self.processor, "image_processor", None)  # a VLM's, from verl
        self.vision = vision_processor(image_processor, self.tokenizer) if image_processor else None

    def _stop_ids(self) -> list[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return [int(eos)] if eos is not None else []

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """Run one trajectory for the row ``kwargs`` (verl's dataset fields)."""
        row = plain(dict(kwargs))
        sample = verl_sample(row)
        settings = self.settings
        template_kwargs = {**_container(self.apply_chat_template_kwargs), **settings.chat.template_kwargs}
        engine = VerlServerEngine(
            self.server_manager,
            sampling_params,
            stop_token_ids=self._stop_ids(),
            max_prompt_tokens=self.prompt_length,
        )
        spec = RolloutSpec(
            env_factory=env_factory(settings, row.get(ENV_FIELD)),
            engine=engine,
            encoder=chat_encoder(self.tokenizer, template_kwargs, self.vision),
            sampling=SamplingParams(
                temperature=float(sampling_params.get("temperature", 1.0)),
                top_p=float(sampling_params.get("top_p", 1.0)),
                top_k=max(int(sampling_params.get("top_k", 0) or 0), 0),
                max_tokens=turn_max_tokens(settings, self.response_length),
            ),
            limits=trainer_limits(
                settings,
                max_response_tokens=self.response_length,
                max_context_tokens=self.prompt_length + self.response_length,
            ),
            check=settings.chat.check,
            rewards=settings.reward_routing(),
        )
        traj = await run_trajectory(sample, spec)
        self.trajectory = traj
        return self._output(traj, engine.global_steps, want_logprobs=bool(sampling_params.get("logprobs")))

    def _output(self, traj: Trajectory, steps: list[int], *, want_logprobs: bool) -> AgentLoopOutput:
        if not traj.prompt_ids:
            raise RuntimeError(f"turnrl trajectory {traj.id} could not start: {traj.error}")
        limit = self.response_length
        extra: dict[str, Any] = {
            "turn_scores": list(traj.turn_rewards),
            "tool_rewards": [],
            "turnrl_stop_reason": traj.stop_reason.value,
            "turnrl_model_turns": traj.num_turns,
            "turnrl_error": traj.error,
        }
        if steps:
            extra["min_global_steps"], extra["max_global_steps"] = min(steps), max(steps)
        return AgentLoopOutput(
            prompt_ids=traj.prompt_ids[-self.prompt_length :],
            response_ids=traj.response_ids[:limit],
            response_mask=traj.loss_mask[:limit],
            response_logprobs=traj.rollout_logprobs[:limit] if want_logprobs else None,
            reward_score=computed_reward(traj),
            num_turns=len(traj.turns) + 1,
            metrics={
                "generate_sequences": float(traj.metrics.get("time/generate", 0.0)),
                "tool_calls": float(traj.metrics.get("time/env", 0.0)),
            },
            extra_fields=extra,
            multi_modal_data={"images": list(traj.images)} if traj.images else None,
        )
