"""TRL's ``GRPOTrainer`` trained on turnrl's multi-turn rollouts, through its ``rollout_func`` hook.

``make_rollout_func(env, data, ...)`` returns a callable ``rollout_func(prompts, trainer)``. TRL hands
it the prompts of a generation batch (each prompt repeated ``num_generations`` times, in a row); it
runs one turnrl trajectory per entry and returns, per entry:

- ``prompt_ids``: the encoded prompt, exactly as the engine saw it;
- ``completion_ids``: every response token, model and env tokens interleaved;
- ``logprobs``: the sampled tokens' logprobs (0.0 on env tokens), one per completion token;
- ``env_mask``: turnrl's loss mask (1 model, 0 env/template), which TRL multiplies into its loss mask;
- ``turnrl_reward`` and friends: extra keys TRL passes to reward functions (``turnrl_reward`` below).

TRL passes prompts only, not dataset rows. ``rollout.dataset()`` builds the trainer's dataset with
the sample id in each prompt's first message (a field chat templates ignore; the prompt the model
sees is the env's, encoded by turnrl), so every prompt maps back to its sample (metadata, tools,
data source) exactly; prompts without it are mapped by their text.

By default the rollouts run on turnrl's embedded engine serving its own copy of ``trainer.model``:
the copy is made at the first call and, at every later call where the trainer's step has moved,
the trainer's weights are pushed into it with ``engine.update_weights`` (no reload). A copy, not
the trainer's model itself, because the engine switches its model to eval mode and decodes on a
background thread; sharing would leave the trained model in eval mode (no dropout) and tie the
two together. It costs one more set of weights in memory. Full-parameter training only: a PEFT
model's weights are not pushed (pass ``engine=`` and update it yourself).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import threading
import zlib
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from turnrl.app.parts import build_env_factory, load_samples
from turnrl.chat.encoder import ChatEncoder
from turnrl.config import ChatConfig, DataConfig, EnvConfig
from turnrl.data import to_samples
from turnrl.env.base import EnvFactory
from turnrl.env.registry import EnvEntry, resolve_env
from turnrl.env.rewards import RewardFn, Rewards
from turnrl.integrations.prompt_index import ID_FIELD, PromptIndex, tag_prompt
from turnrl.record.episode import failed_trajectory
from turnrl.record.writer import JsonlWriter
from turnrl.rollout.loop import run_trajectory
from turnrl.rollout.spec import RolloutSpec
from turnrl.support.errors import describe
from turnrl.support.openmp import release_pool
from turnrl.types import Engine, Limits, Sample, SamplingParams, StopReason, Trajectory

REWARD_KEY = "turnrl_reward"  # per completion: the trajectory's final reward (None: no model turn ran)
SAMPLE_ID_KEY = "turnrl_sample_id"  # per completion: the sample (group) id the prompt was mapped to
STOP_KEY = "turnrl_stop_reason"  # per completion: why the trajectory stopped
TURNS_KEY = "turnrl_num_turns"  # per completion: model turns
ID_COLUMN = ID_FIELD  # the sample id column of rollout.dataset()

T = TypeVar("T")


class _LoopThread:
    """An event loop on a daemon thread: the trainer calls synchronously, the rollout is async."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="turnrl-trl-rollout", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result (works inside a running loop, e.g. Jupyter).
        The trainer's thread frees its OpenMP pool first: the rollout's engine computes meanwhile
        (``turnrl.support.openmp``)."""
        release_pool()
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        """Stop the loop and its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


def _trainer_sampling(args: Any) -> SamplingParams:
    """SamplingParams from a GRPOConfig: temperature, top-p, top-k, max_completion_length per turn."""
    if getattr(args, "min_p", None):
        raise ValueError("GRPOConfig.min_p is not supported by turnrl's engines; leave it unset")
    return SamplingParams(
        temperature=float(args.temperature),
        top_p=float(args.top_p),
        top_k=int(args.top_k or 0),
        max_tokens=int(args.max_completion_length or 256),
    )


def _policy_model(trainer: Any) -> Any:
    """The trainer's model, unwrapped from distributed wrappers; PEFT models are refused."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if hasattr(model, "peft_config"):
        raise ValueError("a PEFT model's weights cannot be pushed to the embedded engine; pass engine=")
    return model


def _tokenizer(trainer: Any) -> Any:
    processing = trainer.processing_class
    return getattr(processing, "tokenizer", processing)


class TRLRollout:
    """A ``rollout_func`` for TRL's GRPOTrainer; build it with ``make_rollout_func``."""

    def __init__(
        self,
        env_factory: EnvFactory,
        samples: list[Sample],
        index: PromptIndex,
        *,
        chat: ChatConfig,
        sampling: SamplingParams | None,
        limits: Limits | None,
        concurrency: int,
        seed: int | None,
        engine: Engine | None,
        max_batch_size: int,
        reward_fn: RewardFn | None,
        out_path: Path | None,
    ) -> None:
        self.samples = samples
        self.trajectories: list[Trajectory] = []  # the last call's, one per prompt entry, in order
        self._env_factory = env_factory
        self._index = index
        self._chat = chat
        self._sampling = sampling
        self._limits = limits
        self._concurrency = concurrency
        self._seed = seed
        self._engine = engine
        self._owns_engine = engine is None
        self._max_batch_size = max_batch_size
        self._reward_fn = reward_fn
        self._writer = JsonlWriter(out_path) if out_path else None
        self._spec: RolloutSpec | None = None
        self._synced_step: int | None = None
        self._calls: Counter[tuple[str, int]] = Counter()
        self._loop: _LoopThread | None = None

    @property
    def engine(self) -> Engine | None:
        """The engine the rollouts run on (the embedded one exists after the first call)."""
        return self._engine

    def dataset(self) -> Any:
        """A ``datasets.Dataset`` of the samples: ``prompt`` (their chat messages, the first carrying the
        sample id, which maps each prompt back to its sample exactly) and ``turnrl_id``."""
        from datasets import Dataset

        return Dataset.from_list([{"prompt": tag_prompt(s), ID_COLUMN: s.id} for s in self.samples])

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """Run one trajectory per prompt entry with the trainer's current weights; TRL's output dict."""
        if self._loop is None:
            self._loop = _LoopThread()
        spec = self._prepare(trainer)
        mode = "train" if trainer.model.training else "eval"
        step = int(trainer.state.global_step)
        self._calls[(mode, step)] += 1
        offset = int(trainer.accelerator.process_index) * len(prompts)  # distinct indices on every process
        jobs: list[tuple[Sample, int]] = []
        seen: Counter[str] = Counter()
        for prompt in prompts:
            sample = self._index.lookup(prompt)
            jobs.append((sample, offset + seen[sample.id]))
            seen[sample.id] += 1
        if self._seed is not None:  # new seeds every call; repeatable for a (seed, mode, step, call)
            base = zlib.crc32(f"{self._seed}/{mode}/{step}/{self._calls[(mode, step)]}".encode())
            spec = dataclasses.replace(spec, sampling=dataclasses.replace(spec.sampling, seed=base))
        self.trajectories = self._loop.run(self._rollout(trainer, spec, jobs))
        for traj in self.trajectories:
            traj.info["trl_step"] = step
            if self._writer:
                self._writer.write(traj)
        return self._output(jobs, spec)

    def close(self) -> None:
        """Stop the embedded engine (an engine passed in is left running), the loop and the writer."""
        if self._loop is not None:
            if self._engine is not None and self._owns_engine:
                self._loop.run(self._engine.close())
                self._engine, self._spec = None, None  # a later call starts a fresh one
            self._loop.stop()
            self._loop = None
        if self._writer:
            self._writer.close()

    def __enter__(self) -> TRLRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _prepare(self, trainer: Any) -> RolloutSpec:
        """The rollout spec, built at the first call from the trainer's tokenizer and settings."""
        if self._spec is not None:
            return self._spec
        sampling = self._sampling or _trainer_sampling(trainer.args)
        trainer_temperature = float(getattr(trainer, "temperature", trainer.args.temperature))
        if abs((sampling.temperature or 1.0) - trainer_temperature) > 1e-6:
            raise ValueError(
                f"sampling temperature {sampling.temperature} differs from the trainer's "
                f"{trainer_temperature}: the trainer's logprobs would not be the sampling distribution's"
            )
        limits = self._limits or Limits(max_response_tokens=trainer.args.max_completion_length)
        tokenizer = _tokenizer(trainer)
        if self._engine is None:
            self._engine = self._embedded_engine(trainer, tokenizer)
        self._spec = RolloutSpec(
            env_factory=self._env_factory,
            engine=self._engine,
            encoder=ChatEncoder(tokenizer, self._chat.template_kwargs),
            sampling=sampling,
            limits=limits,
            check=self._chat.check,
            rewards=Rewards(default=self._reward_fn),
        )
        return self._spec

    def _embedded_engine(self, trainer: Any, tokenizer: Any) -> Engine:
        """turnrl's embedded engine serving a copy of the trainer's model."""
        from turnrl.engines.hf import HFEngine

        served = copy.deepcopy(_policy_model(trainer)).requires_grad_(False)
        for module in served.modules():
            # Trainers patch ``forward`` per instance (TRL's fused logprob head, accelerate's output
            # casts) with closures over the original model's forward, which a deep copy keeps: the copy
            # would run the trainer's model. The class's own forward is what the engine needs.
            module.__dict__.pop("forward", None)
        self._synced_step = int(trainer.state.global_step)
        return HFEngine(served, tokenizer, max_batch_size=self._max_batch_size)

    async def _sync_weights(self, trainer: Any) -> None:
        """Push the trainer's weights into the embedded engine when the trainer's step has moved."""
        step = int(trainer.state.global_step)
        if not self._owns_engine or step == self._synced_step:
            return
        from turnrl.engines.hf import HFEngine

        assert isinstance(self._engine, HFEngine)
        state = {k: v.detach() for k, v in _policy_model(trainer).state_dict().items()}
        await self._engine.update_weights(state, version=step)
        self._synced_step = step

    async def _rollout(
        self, trainer: Any, spec: RolloutSpec, jobs: list[tuple[Sample, int]]
    ) -> list[Trajectory]:
        """Every job as its own task under the concurrency bound; a failing one never takes the rest down."""
        await self._sync_weights(trainer)
        gate = asyncio.Semaphore(self._concurrency)

        async def one(sample: Sample, index: int) -> Trajectory:
            async with gate:
                try:
                    return await run_trajectory(sample, spec, index)
                except Exception as exc:
                    return failed_trajectory(
                        sample, index, f"internal: {describe(exc)}", StopReason.INTERNAL_ERROR
                    )

        return list(await asyncio.gather(*(one(s, k) for s, k in jobs)))

    def _output(self, jobs: list[tuple[Sample, int]], spec: RolloutSpec) -> dict[str, list[Any]]:
        """TRL's rollout output. A trajectory without response tokens becomes one masked end token
        with reward None, which TRL treats as unscorable (advantage 0)."""
        tokenizer = spec.encoder.template.tokenizer
        end = next((i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None), 0)
        out: dict[str, list[Any]] = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}
        for key in (REWARD_KEY, SAMPLE_ID_KEY, STOP_KEY, TURNS_KEY):
            out[key] = []
        for traj, (sample, _) in zip(self.trajectories, jobs, strict=True):
            ok = bool(traj.response_ids)
            out["prompt_ids"].append(list(traj.prompt_ids) or _plain_prompt(spec, sample, end))
            out["completion_ids"].append(list(traj.response_ids) if ok else [end])
            out["logprobs"].append(list(traj.rollout_logprobs) if ok else [0.0])
            out["env_mask"].append(list(traj.loss_mask) if ok else [0])
            out[REWARD_KEY].append(traj.reward if ok else None)
            out[SAMPLE_ID_KEY].append(traj.group_id)
            out[STOP_KEY].append(traj.stop_reason.value)
            out[TURNS_KEY].append(traj.num_turns)
        return out


def _plain_prompt(spec: RolloutSpec, sample: Sample, end: int) -> list[int]:
    """The sample's prompt encoded without tools, for a trajectory that failed before encoding its own."""
    try:
        return spec.encoder.conversation().encode_prompt(sample.prompt)
    except Exception:
        return [end]


def _env_source(env: EnvConfig | str | EnvFactory) -> tuple[EnvFactory, EnvEntry]:
    """The env factory, and the entry whose data an absent ``data`` falls back to."""
    if callable(env) and not isinstance(env, str):
        return env, EnvEntry(env)
    config = EnvConfig(name=env) if isinstance(env, str) else env
    entry = resolve_env(config.name)
    return build_env_factory(config, entry), entry


def _samples(
    data: DataConfig | Sequence[Sample | Mapping[str, Any]] | None, entry: EnvEntry
) -> tuple[list[Sample], PromptIndex]:
    """The samples, indexed by their prompts (and by each row's own prompt, e.g. before a system prompt)."""
    raw: list[Any] = []  # each row's own prompt
    if data is None or isinstance(data, DataConfig):
        samples = load_samples(data or DataConfig(), entry)
    elif all(isinstance(d, Sample) for d in data):
        samples = [d for d in data if isinstance(d, Sample)]
    elif all(isinstance(d, Mapping) for d in data):
        rows = [dict(d) for d in data if isinstance(d, Mapping)]
        samples, raw = to_samples(rows, "rollout data"), [row.get("prompt") for row in rows]
    else:
        raise TypeError("data must be a DataConfig, samples, or row mappings (not a mix)")
    index = PromptIndex()
    for sample in samples:
        index.add(sample)
    for sample, row_prompt in zip(samples, raw, strict=False):
        if row_prompt is not None:
            index.add(sample, row_prompt)
    return samples, index


def make_rollout_func(
    env: EnvConfig | str | EnvFactory,
    data: DataConfig | Sequence[Sample | Mapping[str, Any]] | None = None,
    *,
    chat: ChatConfig | None = None,
    sampling: SamplingParams | None = None,
    limits: Limits | None = None,
    concurrency: int = 32,
    seed: int | None = 0,
    engine: Engine | None = None,
    max_batch_size: int = 32,
    reward_fn: RewardFn | None = None,
    out_path: str | Path | None = None,
) -> TRLRollout:
    """A ``rollout_func`` for ``GRPOTrainer`` running turnrl trajectories of ``env`` on ``data``.

    ``env``: an ``EnvConfig``, a registered name or ``module:Class``, or a factory ``sample -> Env``.
    ``data``: a ``DataConfig``, samples, or data rows; None: the env's own data. ``sampling`` None
    takes the trainer's (temperature, top_p, top_k, max_completion_length per turn); its temperature
    must equal the trainer's. ``limits`` None: turnrl's defaults with ``max_response_tokens`` set to
    the trainer's ``max_completion_length``. ``engine`` None: the embedded engine on a copy of the
    trainer's model, synced every step; an engine passed in is used as is (its weights are yours to
    update). ``reward_fn`` overrides reward routing. ``out_path`` appends every trajectory to a JSONL
    file (``turnrl view`` reads it).
    """
    factory, entry = _env_source(env)
    samples, index = _samples(data, entry)
    return TRLRollout(
        factory,
        samples,
        index,
        chat=chat or ChatConfig(),
        sampling=sampling,
        limits=limits,
        concurrency=concurrency,
        seed=seed,
        engine=engine,
        max_batch_size=max_batch_size,
        reward_fn=reward_fn,
        out_path=Path(out_path) if out_path else None,
    )


def turnrl_reward(
    completions: list[Any], turnrl_reward: list[float | None] | None = None, **kwargs: Any
) -> list[float | None]:
    """TRL reward function: the turnrl trajectory rewards the rollout passed through its extra keys.

    Where the dataset has ``rollout.dataset()``'s ``turnrl_id`` column, every row is checked against
    the sample its prompt was mapped to. Logs the mean model turns and the truncated share.
    """
    if turnrl_reward is None:
        raise ValueError(
            f"no {REWARD_KEY!r} among the reward inputs: train with rollout_func=make_rollout_func(...)"
        )
    if len(turnrl_reward) != len(completions):
        raise ValueError(f"{len(turnrl_reward)} turnrl rewards for {len(completions)} completions")
    rows, mapped = kwargs.get(ID_COLUMN), kwargs.get(SAMPLE_ID_KEY)
    if rows is not None and mapped is not None:
        for row, sample_id in zip(rows, mapped, strict=True):
            if str(row) != sample_id:
                raise ValueError(f"dataset row {row!r} was rolled out as sample {sample_id!r}")
    log_metric: Callable[[str, float], None] | None = kwargs.get("log_metric")
    turns, stops = kwargs.get(TURNS_KEY), kwargs.get(STOP_KEY)
    if log_metric is not None and turns and stops:
        log_metric("turnrl/num_turns", sum(turns) / len(turns))
        truncated = sum(StopReason(s).truncated for s in stops)
        log_metric("turnrl/truncated", truncated / len(stops))
    return list(turnrl_reward)
