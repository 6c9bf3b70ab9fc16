"""The two kinds of env a run may have, told apart in one place (``env_kind``): an env that turnrl's
turn loop plays (``LoopEnv``), or an agent that already exists, run by a harness (``HarnessEnv``).
Each says its title, builds its inputs, checks them before any model loads, and completes the
rollout spec (a harness sets the spec's ``runner``, wired here to a gateway that serves the spec's
engine)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from turnrl.app.parts import RunError, build_env_factory, template_parser
from turnrl.app.preflight import check_harness, check_run
from turnrl.chat.encoder import ChatEncoder
from turnrl.config import AnyEnvConfig, EnvConfig, HarnessConfig
from turnrl.env.base import EnvFactory
from turnrl.env.registry import EnvEntry, resolve_env
from turnrl.rollout.spec import RolloutSpec
from turnrl.types import Engine, Sample

if TYPE_CHECKING:
    from turnrl.gateway.server import Gateway


@dataclass(frozen=True)
class LoopEnv:
    """An env played by the turn loop: a registry entry (its own data, maybe) and a factory."""

    env: EnvConfig

    @property
    def title(self) -> str:
        return self.env.name

    def inputs(self) -> tuple[EnvEntry | None, EnvFactory | None]:
        """The env's registry entry and factory."""
        entry = resolve_env(self.env.name)
        return entry, build_env_factory(self.env, entry)

    def check(self, samples: Sequence[Sample], factory: EnvFactory | None) -> None:
        """The prompts, and the env reset on the first sample (``preflight.check_run``)."""
        assert factory is not None  # inputs() built it
        check_run(self.env.name, samples, factory)

    def complete(self, spec: RolloutSpec, model: str, out_dir: Path) -> RolloutSpec:
        """The spec as it is: the turn loop runs every member."""
        return spec


@dataclass(frozen=True)
class HarnessEnv:
    """An agent run by a harness: no registry entry, no env to build; a runner instead."""

    env: HarnessConfig

    @property
    def title(self) -> str:
        command = self.env.command
        return command if isinstance(command, str) else " ".join(command)

    def inputs(self) -> tuple[EnvEntry | None, EnvFactory | None]:
        """Neither: the rows are the task, the agent is the env."""
        return None, None

    def check(self, samples: Sequence[Sample], factory: EnvFactory | None) -> None:
        """The prompts, the sandbox, the command and the hooks (``preflight.check_harness``)."""
        check_harness(self.env, samples)

    def complete(self, spec: RolloutSpec, model: str, out_dir: Path) -> RolloutSpec:
        """The spec with a ``HarnessRunner`` whose gateway serves the spec's engine on loopback (from
        the first run on)."""
        try:
            from turnrl.harness import HarnessRunner
            from turnrl.tasks import place as task_place  # a row that is a task: its folder and view
        except ImportError as exc:
            needs = "env.kind harness serves a gateway: pip install 'turnrl[gateway]'"
            raise RunError(f"{needs} ({exc})") from None
        gateway = harness_gateway(self.env, spec.engine, spec.encoder, model, out_dir)
        runner = HarnessRunner(self.env, gateway, out_dir, places=task_place)
        return dataclasses.replace(spec, runner=runner)


EnvKind = LoopEnv | HarnessEnv


def env_kind(env: AnyEnvConfig) -> EnvKind:
    """The kind of ``env``: the one place that tells a harness from an env."""
    return HarnessEnv(env) if isinstance(env, HarnessConfig) else LoopEnv(env)


def harness_gateway(
    env: HarnessConfig, engine: Engine, encoder: ChatEncoder, model: str, out_dir: Path
) -> Gateway:
    """The gateway a harness's runs call: the rollout's engine and encoder, the tool-call parser of
    ``env.tool_parser`` (else the chat template's), each session's budget from ``env``, any model
    name accepted (an agent keeps the one it has), sealed (a session answers its own key only), its
    records under ``out_dir/harness``."""
    from turnrl.gateway.config import GatewayConfig
    from turnrl.gateway.server import Gateway

    config = GatewayConfig(
        model=model,
        max_session_tokens=env.max_session_tokens,
        max_session_calls=env.max_calls,
        any_model=True,
        output_dir=str(out_dir / "harness"),
        tool_parser=env.tool_parser,
    )
    parser = template_parser(encoder.template.tokenizer, env.tool_parser)
    return Gateway(engine, encoder, parser, config, sealed=True)
