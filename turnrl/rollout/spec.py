"""What a rollout is given (``RolloutSpec``) and what one episode carries from turn to turn (``Play``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from turnrl.chat.check import CheckMode
from turnrl.chat.encoder import ChatEncoder, ConversationEncoder
from turnrl.env.base import Env, EnvFactory, StoppableFactory
from turnrl.env.rewards import Rewards
from turnrl.record.episode import Episode
from turnrl.rollout.control import RolloutControl
from turnrl.types import Engine, Limits, Sample, SamplingParams, Trajectory, Turn


@dataclass
class RolloutSpec:
    """Everything a trajectory needs besides its sample."""

    env_factory: EnvFactory | None  # builds a fresh env per trajectory (None: ``runner`` runs every member)
    engine: Engine  # generates from token ids
    encoder: ChatEncoder  # the model's chat template and tokenizer
    sampling: SamplingParams  # per-turn sampling
    limits: Limits  # stop conditions
    check: CheckMode = "strict"  # sanity check of the final sequence
    rewards: Rewards = field(default_factory=Rewards)  # reward functions by data source
    on_turn: TurnHook | None = None  # called after every turn is appended (per-turn logging)
    control: RolloutControl | None = None  # pause/resume/stop for partial rollout
    mask_offpolicy: bool = False  # mask (0) model tokens sampled by an older policy than the newest
    inference_contexts: bool = False  # record each turn's context as a chat server would render it
    vocab_size: int | None = None  # sampled ids at or above it end the trajectory as engine_error
    runner: Runner | None = None  # runs each group member (a harness); None: the turn loop, loop.TURN_LOOP


class Runner(Protocol):
    """What runs a group member: the turn loop (``turnrl.rollout.loop.TurnLoop``, the default) or
    what replaces it (``turnrl.harness.HarnessRunner`` runs an agent that already exists). It never
    raises for one member: a failure is a trajectory with its stop reason."""

    async def __call__(self, sample: Sample, index: int, spec: RolloutSpec) -> list[Trajectory]:
        """Group member ``index`` of ``sample``: its trajectories (an agent run's session branches),
        all with that sample index."""
        ...

    async def close(self) -> None:
        """Stop what the runner holds (a harness's gateway and fork server, its runs' folders)."""
        ...


async def close_spec(spec: RolloutSpec) -> None:
    """Stop what the spec's parts hold besides the engine: its runner, and its env factory's workers
    (Ray actors) when it has some."""
    if spec.runner is not None:
        await spec.runner.close()
    if isinstance(spec.env_factory, StoppableFactory):
        spec.env_factory.shutdown()


TurnHook = Callable[[Sample, int, int, Turn], None]
"""Called with (sample, sample_index, turn_index, turn) as each turn completes."""


@dataclass
class Play:
    """One episode being played: its state, its env, the spec, and (once the prompt is encoded) the
    conversation's encoder. Every step of the turn loop takes this one object."""

    ep: Episode
    env: Env
    spec: RolloutSpec
    conv: ConversationEncoder | None = None

    @property
    def encoder(self) -> ConversationEncoder:
        """The conversation's encoder (set once the prompt is encoded)."""
        if self.conv is None:
            raise RuntimeError("the prompt is not encoded yet")
        return self.conv

    def notify(self) -> None:
        """Report the turns completed since the last call (a model turn once its env step is done)."""
        record, hook = self.ep.record, self.spec.on_turn
        while record.reported < len(record.turns):
            if hook is not None:
                hook(self.ep.sample, self.ep.index, record.reported, record.turns[record.reported])
            record.reported += 1
