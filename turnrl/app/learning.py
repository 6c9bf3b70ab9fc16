"""A learning gateway: it serves as any gateway and trains the model it serves from the rewards its
users give (``POST /v1/rewards``), in the background, without a separate rollout farm.

A step starts once ``learn.sessions_per_step`` rewarded sessions are ready (``RewardDesk``):

1. sessions whose tokens are more than ``algorithm.max_staleness`` weight versions old are left
   out (counted: ``stale``);
2. each session's advantage is its reward minus its task's baseline, a running mean of that task's
   rewards (``Baselines``): live traffic does not come in groups, so no group mean is there to
   subtract; every model turn of the session's branches gets it;
3. the update (``turnrl.train.update``: recomputed old logprobs, the importance correction against
   the logprobs the tokens were sampled with, ``ppo_epochs`` x ``mini_batches`` optimizer steps),
   in the learner (a process of its own, or a thread: ``learn.learner``) while the gateway goes on
   serving;
4. with ``learn.hold_back``, the new weights' held-out reward against the served ones': more than
   ``margin`` worse and they are held back (the policy goes back to the served weights, counted);
5. the new weights go into the serving engine (``learn.swap``): through ``Gateway.update_weights``
   (calls generating finish under the old weights, new ones wait, so no reply mixes versions), or
   between two decode steps with the calls under way going on (no pause); every token keeps its
   version either way;
6. a checkpoint (policy, optimizer, baselines, the sessions trained on) every ``train.save_every``
   steps; a gateway started again on its folder (``--resume``) serves the checkpoint's weights and
   trains the rewarded sessions the checkpoint had not (none lost, none trained twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any

from pydantic import model_validator
from rich.console import Console

from turnrl.app.learner import CHECKPOINT, LearnerSpec, start_learner
from turnrl.config import HFEngineConfig, VLLMEngineConfig
from turnrl.gateway.config import GatewayConfig
from turnrl.gateway.rewards import RewardDesk
from turnrl.gateway.server import Gateway
from turnrl.record.writer import JsonlWriter
from turnrl.support.errors import describe
from turnrl.support.imports import import_object
from turnrl.train.batch import TrainSample, build_samples
from turnrl.train.config import LearnConfig, learner_device
from turnrl.types import Trajectory, Weights, as_updatable, weight_version


class LearningGatewayConfig(GatewayConfig):
    """A ``turnrl gateway`` that learns: it serves as any gateway, takes rewards for its sessions at
    ``POST /v1/rewards`` and trains the served model on them in the background (``learn``)."""

    learn: LearnConfig
    """How it learns from the rewards."""

    @model_validator(mode="after")
    def _engine_it_can_update(self) -> LearningGatewayConfig:
        if not isinstance(self.engine, HFEngineConfig | VLLMEngineConfig):
            raise ValueError(
                f"a learning gateway serves its new weights from the embedded engine (hf) or vLLM servers "
                f"(vllm): engine.kind {self.engine.kind!r} cannot take them"
            )
        if self.sampling.seed is not None:
            raise ValueError("set the gateway's top-level seed instead of sampling.seed")
        return self


LEARN_DIR = "learn"
STOP_WAIT_S = 120.0  # at most this long for an update under way when the gateway stops
WEIGHTS_DIR = "weights"  # what vLLM servers load a step's weights from


class Baselines:
    """Per task, a running mean of its rewards (``b = decay * b + (1 - decay) * r``)."""

    def __init__(self, decay: float, values: dict[str, float] | None = None) -> None:
        self.decay = decay
        self.values = dict(values or {})

    def advantage(self, task: str, reward: float) -> float:
        """``reward`` minus its task's baseline before it (a new task: the mean of every task's, 0
        at first); the baseline then takes the reward in."""
        base = self.values.get(task, statistics.fmean(self.values.values()) if self.values else 0.0)
        self.values[task] = self.decay * base + (1 - self.decay) * reward
        return reward - base


class Learning:
    """The learning beside a gateway: the rewards desk it trains from, the baselines, the steps; the
    policy and its optimizer live in the learner (``turnrl.app.learner``, ``learn.learner``)."""

    def __init__(
        self,
        config: LearningGatewayConfig,
        gateway: Gateway,
        desk: RewardDesk,
        console: Console,
        resume: bool = False,
    ) -> None:
        self.config, self.gateway, self.desk, self.console = config, gateway, desk, console
        self.resume = resume
        self.engine = as_updatable(gateway.engine)  # the embedded engine, or vLLM servers
        learn = config.learn
        self.folder = Path(config.output_dir) / LEARN_DIR
        saved = self.folder / CHECKPOINT
        resumed = resume and (saved / "state.pt").is_file()
        spec = LearnerSpec(
            str(saved / "model") if resumed else config.model,
            learner_device(learn.train.device, config.engine),
            learn,
            config.sampling,
            gateway.encoder,
            str(saved) if resumed else None,
        )
        self.learner = start_learner(spec)
        self.baselines = Baselines(learn.baseline_decay)
        self.step = 0
        self.version = 0  # the served weights' version a resume goes on from
        self.trained: set[str] = set()  # sessions the policy has learned from (in its checkpoint)
        self.counts: dict[str, float] = {"stale": 0, "held_back": 0, "served_steps": 0, "failed_steps": 0}
        self.last: dict[str, float] = {}
        self.holds_back = learn.hold_back is not None
        self.served_score: float | None = None
        self._metrics = JsonlWriter(self.folder / "metrics.jsonl")
        self._updating: asyncio.Future[dict[str, float]] | None = None  # the update of a step
        if resumed:
            self._restore(self.learner.call("restored"))

    async def start(self) -> None:
        """Before serving: a resumed learner's weights into the engine, the rewarded sessions it had
        not trained on back in the queue, and the served weights' held-out score."""
        if self.version:  # the checkpoint's weights, under the version they were served as
            await self.engine.update_weights(await self._weights(), version=self.version)
        if self.resume:  # the rewards of an earlier life of this folder, not trained on yet
            self.desk.restore()
            self.desk.ready = [s for s in self.desk.ready if _name(s) not in self.trained]
        if self.holds_back:
            self.served_score = await self.learner.run("score")
            self.console.print(f"learn: held-out reward of the served weights {self.served_score:.3f}")

    async def run(self) -> None:
        """Learn for as long as the gateway serves: a step whenever enough rewarded sessions are
        ready; sessions past ``expire_s`` without a reward dropped meanwhile."""
        learn = self.config.learn
        every = min(5.0, learn.expire_s / 4, learn.finished_s / 4 if learn.reward else 5.0)
        score = import_object(learn.reward, "learn.reward") if learn.reward else None
        while True:
            if score is not None:
                await self.desk.score_finished(score, learn.finished_s)
            self.desk.expire()
            while self._ready() >= learn.sessions_per_step:
                try:
                    await self.learn_step()
                except Exception as exc:  # the gateway goes on serving the weights it has
                    self.counts["failed_steps"] += 1
                    self.console.print(f"[red]learn: a step failed: {describe(exc)}[/red]")
            self.desk.arrived.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(every):
                    await self.desk.arrived.wait()

    async def learn_step(self) -> dict[str, float]:
        """One step on the first ``sessions_per_step`` ready sessions that are not stale (the stale
        ones left out first); its metrics ({} and no step when none is ready)."""
        t0 = time.perf_counter()
        learn = self.config.learn
        version = weight_version(self.engine)
        self._ready()
        sessions = self.desk.take(learn.sessions_per_step)
        if not sessions:
            return {}
        trajs = [t for s in sessions for t in s]
        advantages = []
        for session in sessions:
            advantage = self.baselines.advantage(session[0].group_id, session[0].score)
            advantages += [[advantage] * max(t.num_turns, 1) for t in session]
        samples = build_samples(learn.algorithm.samples, trajs, advantages, learn.algorithm.loss_turns)
        samples = [s for s in samples if any(s.advantages)]
        tokens = sum(sum(s.loss_mask) for s in samples)
        metrics: dict[str, float] = {}
        left_out: dict[str, str] = {}
        try:
            if samples:
                metrics = await self._update(samples, tokens)
                left_out = {_name(s): "held_back" for s in sessions} if metrics.pop("held_back") else {}
        except Exception:  # the learner's error, or its end: these sessions are not trained on
            self.desk.learned(sessions, self.step + 1, {_name(s): "failed" for s in sessions})
            raise
        self.step += 1
        self.trained |= {_name(s) for s in sessions}
        if learn.train.save_every and self.step % learn.train.save_every == 0:
            await self._save()
        self.desk.learned(sessions, self.step, left_out)
        rewards = [s[0].score for s in sessions]
        self.last = metrics | {
            "step": self.step,
            "sessions": len(sessions),
            "reward_mean": statistics.fmean(rewards),
            "tokens": tokens,
            "staleness_max": max(version - _oldest(s) for s in sessions),
            "weight_version": weight_version(self.engine),
            "seconds": time.perf_counter() - t0,
        }
        self._metrics.write_record(self.last | {"time": time.time()})
        self.console.print(
            f"learn: step {self.step}, {len(sessions)} sessions, reward {self.last['reward_mean']:.3f}, "
            f"serving version {self.last['weight_version']} ({self.last['seconds']:.1f} s)"
        )
        return self.last

    async def _update(self, samples: list[TrainSample], tokens: int) -> dict[str, float]:
        """The update, then the held-out check, then the swap; the update's metrics, and whether its
        weights were held back (``held_back``: 1.0)."""
        self._updating = asyncio.ensure_future(self.learner.run("update", samples, tokens, self.holds_back))
        metrics: dict[str, float] = await asyncio.shield(self._updating)
        if await self._worse():
            await self.learner.run("put_back")
            return metrics | {"held_back": 1.0}
        await self._serve()
        return metrics | {"held_back": 0.0}

    def _ready(self) -> int:
        """How many rewarded sessions a step can learn from: the ready ones whose tokens are more than
        ``max_staleness`` versions older than the served weights are left out first (counted, and
        written as left out with the last step), so that a step under heavy traffic takes only what
        it can still correct for."""
        limit = weight_version(self.engine) - self.config.learn.algorithm.max_staleness
        stale = [s for s in self.desk.ready if _oldest(s) < limit]
        if stale:
            self.desk.ready = [s for s in self.desk.ready if _oldest(s) >= limit]
            self.counts["stale"] += len(stale)
            self.desk.learned(stale, self.step, {_name(s): "stale" for s in stale})
        return len(self.desk.ready)

    async def _worse(self) -> bool:
        """Whether the held-out check holds the new weights back (their score against the served
        weights')."""
        hold = self.config.learn.hold_back
        if hold is None or self.served_score is None:
            return False
        score = await self.learner.run("score")
        if score < self.served_score - hold.margin:
            self.counts["held_back"] += 1
            self.console.print(
                f"learn: step {self.step + 1} held back: held-out reward {score:.3f} against "
                f"{self.served_score:.3f} served (margin {hold.margin})"
            )
            return True
        self.served_score = score
        return False

    async def _serve(self) -> None:
        """The policy's weights into the serving engine, between calls."""
        weights = await self._weights()  # the copy too: not on the serving loop

        async def load() -> None:
            await self.engine.update_weights(weights)

        if self.config.learn.swap == "in_flight":
            await load()  # between two decode steps: the calls under way go on
        else:
            await self.gateway.update_weights(load)
        self.counts["served_steps"] += 1

    def metrics(self) -> list[str]:
        """Prometheus lines: steps, held back, stale sessions, the last step's reward and staleness."""
        return [
            f"turnrl_learn_steps_total {self.step}",
            f"turnrl_learn_served_steps_total {int(self.counts['served_steps'])}",
            f"turnrl_learn_held_back_total {int(self.counts['held_back'])}",
            f"turnrl_learn_sessions_stale_total {int(self.counts['stale'])}",
            f"turnrl_learn_failed_steps_total {int(self.counts['failed_steps'])}",
            f"turnrl_learn_weight_version {weight_version(self.engine)}",
            f"turnrl_learn_reward_mean {self.last.get('reward_mean', 0.0)}",
            f"turnrl_learn_staleness_max {self.last.get('staleness_max', 0)}",
        ]

    async def _save(self) -> None:
        """The checkpoint (``turnrl.app.learner``), with the gateway's side of it."""
        state = {
            "step": self.step,
            "version": weight_version(self.engine),
            "baselines": self.baselines.values,
            "trained": sorted(self.trained),
            "counts": self.counts,
        }
        await self.learner.run("save", str(self.folder), state)

    def _restore(self, state: dict[str, Any]) -> None:
        self.baselines = Baselines(self.config.learn.baseline_decay, state["baselines"])
        self.step, self.version, self.trained = (
            int(state["step"]),
            int(state["version"]),
            set(state["trained"]),
        )
        self.counts.update(state["counts"])
        self.console.print(f"learn: resumed at step {self.step} ({len(self.trained)} sessions trained on)")

    async def _weights(self) -> Weights:
        """The policy's weights as the serving engine takes them: a copy for the embedded engine and
        for vLLM servers that take them by collective, else a checkpoint folder (``learn/weights``,
        rewritten each time) that the servers read."""
        servers = self.config.engine
        # the learner's weights reach the gateway in CPU memory: NCCL is not for them
        by_file = isinstance(servers, VLLMEngineConfig) and servers.sync_way(on_gpu=False) == "file"
        folder = str(self.folder / WEIGHTS_DIR) if by_file else None
        weights: Weights = await self.learner.run("weights", folder)
        return weights

    async def stop(self, task: asyncio.Task[None] | None) -> None:
        """Stop learning (``task``: its ``run``): an update under way ends first (its thread cannot be
        stopped midway; bounded by ``STOP_WAIT_S``), then the metrics file is closed."""
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._updating is not None and not self._updating.done():
            self.console.print("learn: stopping once the update under way ends")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STOP_WAIT_S):
                    await asyncio.gather(self._updating, return_exceptions=True)
        self.learner.close()
        self._metrics.close()


def _name(session: list[Trajectory]) -> str:
    branch = session[0].branch
    return branch.session if branch is not None else session[0].id


def _oldest(session: list[Trajectory]) -> int:
    """The oldest weight version among a session's sampled tokens."""
    return min((v for t in session for v in t.policy_versions if v >= 0), default=0)
