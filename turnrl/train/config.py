"""Typed ``turnrl train`` configuration: the run sections of ``turnrl.config`` plus the learning ones."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from turnrl.config import (
    DataConfig,
    EnvConfig,
    HFEngineConfig,
    RolloutConfig,
    RunSections,
    VLLMEngineConfig,
    load_model_config,
)
from turnrl.config import Strict as _Strict
from turnrl.train.advantages import ESTIMATORS, AdvantageOptions
from turnrl.train.loss import POLICY_LOSSES, LossOptions

Tracker = Literal["none", "tensorboard", "wandb", "trackio", "mlflow"]


class OverlongConfig(_Strict):
    """DAPO's overlong reward shaping and filtering (see ``turnrl.train.shaping``)."""

    max_tokens: int = Field(ge=1)
    """A trajectory's model tokens (every turn) at which the penalty is full."""
    buffer: int = Field(0, ge=0)
    """The penalty ramps up over the last this many tokens (0: a step)."""
    penalty: float = Field(1.0, ge=0)
    """The full penalty, subtracted from the reward."""
    mask_truncated: bool = False
    """A trajectory cut by a length limit carries no loss."""

    @model_validator(mode="after")
    def _buffer_fits(self) -> OverlongConfig:
        if self.buffer > self.max_tokens:
            raise ValueError(f"overlong.buffer ({self.buffer}) is larger than overlong.max_tokens")
        return self


class DynamicSamplingConfig(_Strict):
    """DAPO's dynamic sampling: groups with all-equal rewards are dropped and more prompts rolled
    out until the step has ``prompts_per_step`` varied groups (see ``turnrl.train.shaping``)."""

    max_rounds: int = Field(3, ge=1)
    """Rollout rounds per step at most (the first included)."""


class AlgorithmConfig(_Strict):
    """What is learned from a batch: advantages, samples, loss."""

    advantage: str = "grpo"
    """A name in turnrl.train.advantages.ESTIMATORS: grpo, rloo, reward_to_go."""
    normalize_std: bool = True
    """grpo and reward_to_go: divide by the group's std."""
    gamma: float = Field(1.0, ge=0, le=1)
    """reward_to_go: the discount over later turns."""
    samples: Literal["trajectory", "turn", "inference"] = "trajectory"
    """trajectory: one sample per trajectory; turn: one sample per model turn on its exact context (step-
    wise); inference: one per model turn on the context the chat template renders at inference time
    (past reasoning dropped, etc.)."""
    loss_turns: Literal["all", "last"] = "all"
    """all: train every model turn; last: train only each trajectory's last model turn."""
    loss: str = "ppo"
    """A name in turnrl.train.loss.POLICY_LOSSES: ppo, pg, cispo."""
    clip_low: float = Field(0.2, ge=0, le=1)
    """PPO's lower clip: the ratio is kept above 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0)
    """PPO's upper clip: the ratio is kept below 1 + clip_high (DAPO's clip-higher: raise it)."""
    importance: Literal["none", "tis", "mis"] = "tis"
    """Rollout correction against the engine's logprobs: none, tis (truncated weights) or mis (masked)."""
    tis_cap: float = Field(2.0, gt=0)
    """importance tis: the truncated importance weight's cap."""
    mis_low: float = Field(0.5, ge=0)
    """importance mis: tokens whose importance ratio is below this are masked."""
    mis_high: float = Field(2.0, gt=0)
    """importance mis: tokens whose importance ratio is above this are masked."""
    kl_coef: float = Field(0.0, ge=0)
    """The KL penalty's weight; above 0 a frozen reference model is loaded."""
    recompute_old_logprobs: bool = True
    """Recompute the behaviour policy's logprobs before the update; false: the rollout's own."""
    max_staleness: int = Field(0, ge=0)
    """Train on tokens sampled up to this many weight versions back."""
    offpolicy_tokens: Literal["correct", "mask"] = "correct"
    """Tokens of a turn that a weight update split (partial rollout, overlapped training) sampled by the older
    weights: kept and corrected by the importance weights, or masked (no loss)."""
    train_on_failures: bool = False
    """Train on trajectories an engine, env or internal error ended."""
    overlong: OverlongConfig | None = None
    """DAPO's overlong shaping and filtering (None: off)."""
    dynamic_sampling: DynamicSamplingConfig | None = None
    """DAPO's dynamic sampling (None: off)."""

    @field_validator("advantage")
    @classmethod
    def _known_advantage(cls, name: str) -> str:
        if name not in ESTIMATORS:
            raise ValueError(f"unknown advantage estimator {name!r} (known: {', '.join(sorted(ESTIMATORS))})")
        return name

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        if name not in POLICY_LOSSES:
            raise ValueError(f"unknown loss {name!r} (known: {', '.join(sorted(POLICY_LOSSES))})")
        return name

    def advantage_options(self) -> AdvantageOptions:
        """The estimators' options."""
        return AdvantageOptions(normalize_std=self.normalize_std, gamma=self.gamma)

    def loss_options(self) -> LossOptions:
        """The loss's options."""
        return LossOptions(
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            importance=self.importance,
            tis_cap=self.tis_cap,
            mis_low=self.mis_low,
            mis_high=self.mis_high,
            kl_coef=self.kl_coef,
        )


class LoraSettings(_Strict):
    """LoRA adapters (peft) instead of full-parameter training."""

    r: int = Field(8, ge=1)
    """The adapters' rank."""
    alpha: int = Field(16, ge=1)
    """The adapters' scale is alpha / r."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """The modules that get adapters."""


class OptimConfig(_Strict):
    """AdamW with linear warm-up, then a constant rate."""

    lr: float = Field(1e-6, gt=0)
    """The learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's betas."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global grad norm."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warm-up."""
    trainable: list[str] = Field(default_factory=list)
    """Regexes of parameter names to train (empty: all)."""
    lora: LoraSettings | None = None
    """Train LoRA adapters only (needs peft); exclusive with trainable."""

    @model_validator(mode="after")
    def _one_way_to_choose(self) -> OptimConfig:
        if self.lora is not None and self.trainable:
            raise ValueError("optim.lora and optim.trainable exclude each other: LoRA trains its adapters")
        return self


class TrainLoopConfig(_Strict):
    """How long, how much per step, and what to write."""

    steps: int = Field(10, ge=1)
    """Training steps (one rollout batch each)."""
    prompts_per_step: int = Field(8, ge=1)
    """Groups per step."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per pass (at most one per micro-batch)."""
    micro_batch_tokens: int = Field(4096, ge=1)
    """Tokens per forward/backward (padding included)."""
    pack: bool | Literal["auto"] = "auto"
    """Samples end to end in one row, no padding (text models; images always go in padded rows); auto: where
    the attention kernel takes variable lengths (flash attention), else padded rows."""
    share_prefix_tokens: int = Field(32, ge=0)
    """Padded rows that begin with the same at least this many tokens (a GRPO group's prompt) share a micro-
    batch, and the model runs that prefix once for all of them (0: every row runs its own)."""
    logprob_chunk: int = Field(256, ge=1)
    """Positions projected through lm_head at a time."""
    logprob_keep_mib: float = Field(512.0, ge=0)
    """MiB of a micro-batch's vocabulary probabilities kept from the forward pass, so the backward does not
    recompute them (0: recompute every chunk; the bound is then one chunk)."""
    precision: Literal["float32", "bfloat16"] = "float32"
    """bfloat16: the policy's forward and backward under bfloat16 autocast (mixed precision:
    weights, optimizer state and the vocabulary projection stay float32)."""
    save_every: int = Field(10, ge=0)
    """Steps between checkpoints (0: only at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    """The newest this many are kept."""
    save_optimizer: bool = True
    """Keep AdamW's moments in checkpoints; false: none (a third the size; a resume restarts them)."""
    save_rollouts: bool = False
    """Write every step's trajectories to rollouts/step_K.jsonl."""
    overlap: bool = False
    """Roll out ahead while the trainer steps (needs algorithm.max_staleness >= 1)."""
    max_inflight_groups: int | None = Field(None, ge=1)
    """With overlap: groups in flight at most (None: max_staleness steps' worth)."""
    oversample_groups: int = Field(0, ge=0)
    """Without overlap: roll out this many groups more than prompts_per_step and stop the slowest once
    prompts_per_step are complete (their trajectories end as aborted and are not trained on)."""
    fsdp: bool = False
    """Under torchrun: shard the policy, its gradients and AdamW moments across the ranks (FSDP2);
    false: every rank holds the whole policy (data-parallel, gradients all-reduced)."""
    device: str | None = None
    """Where the policy trains (under torchrun, cuda becomes cuda:LOCAL_RANK); None: the embedded engine's
    device, or with vLLM servers cuda when torch sees a GPU, else cpu."""
    tracker: Tracker = "none"
    """Also log to this tracker (it must be installed)."""
    plot: bool = True
    """Reward curve PNG at the end (needs matplotlib)."""


class EvalConfig(_Strict):
    """Held-out evaluation: a fixed prompt set, at the start, every ``every`` steps, and at the end."""

    data: DataConfig | None = None
    """The held-out prompts (None: no evaluation)."""
    every: int = Field(5, ge=0)
    """Steps between evaluations (0: only at the start and the end)."""
    group_size: int = Field(1, ge=1)
    """Trajectories per prompt (pass@k needs k of them)."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature (0: greedy; the same seeds at every evaluation)."""
    k: list[int] = Field(default_factory=lambda: [1])
    """pass@k is reported for each k (each at most group_size)."""
    pass_reward: float = 1.0
    """A trajectory passes when its reward is at least this."""

    @field_validator("k")
    @classmethod
    def _positive(cls, value: list[int]) -> list[int]:
        if any(k < 1 for k in value):
            raise ValueError(f"eval.k holds a k below 1: {value}")
        return sorted(set(value))

    @model_validator(mode="after")
    def _enough_samples(self) -> EvalConfig:
        if self.k and max(self.k) > self.group_size:
            raise ValueError(
                f"eval.k asks for pass@{max(self.k)} but eval.group_size is {self.group_size}: "
                f"set eval.group_size to at least {max(self.k)}"
            )
        return self


class WarmStartConfig(_Strict):
    """Optional supervised warm-start before RL: demonstrations replayed through the env (see ``sft``)."""

    demos: str
    """A "module:function": sample -> the assistant texts of a demonstrated episode."""
    data: DataConfig = Field(default_factory=DataConfig)
    """The demonstrated prompts."""
    epochs: int = Field(1, ge=1)
    """Passes over the demonstrations."""
    batch_size: int = Field(8, ge=1)
    """Demonstrated episodes per optimizer step."""
    lr: float = Field(1e-5, gt=0)
    """The learning rate."""


class TrainConfig(RunSections):
    """A whole ``turnrl train`` run: the shared run sections, then what is learned and how."""

    rollout: RolloutConfig = Field(default_factory=lambda: RolloutConfig(group_size=4))
    """Group size (trajectories per prompt, at least 2 for GRPO) and concurrency."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantages, samples, loss."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """The optimizer."""
    train: TrainLoopConfig = Field(default_factory=TrainLoopConfig)
    """Steps, batch sizes, checkpoints, tracking."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation."""
    warm_start: WarmStartConfig | None = None
    """A supervised warm start before RL (None: none)."""
    output_dir: str = "runs/train"
    """Where metrics.jsonl, checkpoints and rollouts go."""

    @model_validator(mode="after")
    def _trainable_setup(self, info: ValidationInfo) -> TrainConfig:
        if (info.context or {}).get("purpose") == "eval":
            return self  # `turnrl eval` only rolls out: any engine, any group size
        if not isinstance(self.engine, HFEngineConfig | VLLMEngineConfig):
            raise ValueError(
                f"turnrl train needs an engine whose weights it updates: engine.kind {self.engine.kind!r} "
                "is not one (use kind: hf or vllm)"
            )
        if isinstance(self.engine, VLLMEngineConfig) and self.engine.in_process:
            raise ValueError("turnrl train uses vLLM servers: set engine.in_process false")
        if self.engine.ray.enabled or (isinstance(self.env, EnvConfig) and self.env.ray.enabled):
            raise ValueError(
                "turnrl train runs in one process: set engine.ray.enabled and env.ray.enabled false"
            )
        if self.rollout.group_size < 2:
            raise ValueError(
                "rollout.group_size must be at least 2: advantages compare a prompt's trajectories"
            )
        if self.train.overlap and self.algorithm.max_staleness < 1:
            raise ValueError(
                "train.overlap rolls out while the trainer steps, so tokens are one version old or more: "
                "set algorithm.max_staleness to at least 1"
            )
        if isinstance(self.engine, HFEngineConfig) and self.train.device not in (None, self.engine.device):
            raise ValueError(
                f"train.device {self.train.device!r} is not engine.device {self.engine.device!r}: the "
                "embedded engine samples from a copy of the policy on its device (set only engine.device)"
            )
        if self.train.overlap and self.train.oversample_groups:
            raise ValueError(
                "train.oversample_groups is for the synchronous trainer: the overlapped one already "
                "trains on the groups that finish first (set it to 0 with train.overlap)"
            )
        if self.train.oversample_groups and self.algorithm.dynamic_sampling is not None:
            raise ValueError(
                "train.oversample_groups and algorithm.dynamic_sampling exclude each other: "
                "dynamic sampling already refills the step with more groups"
            )
        return self


def policy_device(config: TrainConfig) -> str:
    """Where the policy trains: ``train.device``, else the embedded engine's device, else (vLLM
    servers) cuda when torch sees a GPU, else cpu."""
    return learner_device(config.train.device, config.engine)


def learner_device(device: str | None, engine: object) -> str:
    """``device`` when set, else the embedded engine's (``engine``: an engine config), else cuda
    when torch sees a GPU, else cpu (a learning gateway's learner, as ``policy_device``)."""
    if device:
        return device
    if isinstance(engine, HFEngineConfig):
        return engine.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_train_config(
    path: str | Path, overrides: list[str] | None = None, purpose: str = "train"
) -> TrainConfig:
    """Read a YAML train config, apply ``--set`` overrides, validate (for ``purpose`` "eval":
    without what only training needs, such as an engine whose weights it updates)."""
    return load_model_config(path, TrainConfig, overrides, {"purpose": purpose})


class HoldBackConfig(_Strict):
    """A held-out check after each learning step: new weights that score worse are not served."""

    data: DataConfig
    """The held-out prompts (each row's ``prompt``: the messages a call sends)."""
    reward: str
    """``module:function`` scoring one reply: fn(prompt_messages, reply_text, row) -> float."""
    margin: float = Field(0.1, ge=0)
    """New weights whose mean held-out reward is more than this below the served weights' are held
    back: the gateway keeps serving the last good ones, and the learner goes on from those."""
    max_tokens: int = Field(64, ge=1)
    """Tokens per held-out reply."""


class LearnConfig(_Strict):
    """How a learning gateway trains the model it serves, from the rewards its users give."""

    sessions_per_step: int = Field(8, ge=1)
    """Rewarded sessions a step trains on (a step starts once this many are ready)."""
    baseline_decay: float = Field(0.9, ge=0, lt=1)
    """Each task's baseline is a running mean of its rewards: ``b = decay * b + (1 - decay) * r``
    after each reward; a session's advantage is its reward minus its task's baseline before it (a
    task's first reward is measured against the mean baseline of every task so far, 0 at first)."""
    expire_s: float = Field(3600.0, gt=0)
    """A session with no reward this long after its last call is dropped (counted, never trained)."""
    reward: str | None = None
    """``module:function`` that scores a finished session: fn(messages) -> float | None, with the
    conversation as its client saw it (its last branch's messages, the last reply included). A
    number is the session's reward (its task: its first user message); None leaves it to a reward
    posted over HTTP, or to expiry. None here: rewards come over HTTP only."""
    finished_s: float = Field(30.0, gt=0)
    """With ``reward``: a session is finished once it has had no call for this long."""
    algorithm: AlgorithmConfig = Field(default_factory=lambda: AlgorithmConfig(max_staleness=4))
    """The loss and its importance correction; ``max_staleness``: a session whose tokens are older than
    this many weight versions is not trained on (counted). ``advantage`` is not read: the baseline is."""
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    """The optimizer."""
    train: TrainLoopConfig = Field(default_factory=TrainLoopConfig)
    """The update's sizes and precision (``micro_batch_tokens``, ``ppo_epochs``, ``mini_batches``,
    ``precision``, ``save_every``, ``keep_checkpoints``), ``device`` (where the learner trains; None:
    the embedded engine's device, or with vLLM servers cuda when torch sees a GPU, else cpu);
    ``steps`` and ``prompts_per_step`` are not read (a step starts when rewards are ready)."""
    hold_back: HoldBackConfig | None = None
    """A held-out check that keeps a worse step from being served (None: every step is served)."""
    swap: Literal["between_calls", "in_flight"] = "between_calls"
    """How a step's weights reach the serving engine. ``between_calls``: calls generating finish
    under the old weights while new calls wait, then the weights change (no reply spans two
    versions; serving pauses for the longest reply under way). ``in_flight``: they change between
    two decode steps, calls generating go on under the new ones with the KV they have (no pause; a
    reply may span two versions, each token's version recorded and the importance correction
    applied, as in overlapped training)."""
    learner: Literal["thread", "process"] = "process"
    """Where the policy and its optimizer live. ``process``: a process of its own, started with the
    gateway and ended with it: it shares no interpreter lock, OpenMP pool or heap with serving, and
    a learner killed for memory fails its steps, not the gateway (docs/learning.md). ``thread``: a
    thread of the gateway's process: it starts at once and holds no second copy of the libraries."""
    threads: int | None = Field(None, ge=1)
    """With ``learner: process``: the learner's torch threads. None: half the cores this process may
    use, at least 1. A learner at nice 19 whose OpenMP team is as wide as the machine waits at every
    barrier for a thread the scheduler gives to serving; a narrower team takes what serving leaves."""
    nice: int = Field(19, ge=0, le=19)
    """The learner runs at this nice value: 19 takes only the CPU that serving leaves (where the
    learner has cores or a device of its own, it changes nothing); 0: the same as serving."""

    @model_validator(mode="after")
    def _one_process(self) -> LearnConfig:
        if self.train.overlap or self.train.fsdp or self.train.oversample_groups:
            raise ValueError("learn.train: overlap, fsdp and oversample_groups are for turnrl train")
        if self.optim.lora is not None:
            raise ValueError("learn.optim.lora: a learning gateway trains the whole model (set trainable)")
        return self
