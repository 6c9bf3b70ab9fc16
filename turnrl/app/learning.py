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
   in a worker thread while the gateway goes on serving;
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
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from pydantic import model_validator
from rich.console import Console
from transformers.utils import logging as hf_logging

from turnrl.app.parts import load_samples
from turnrl.config import HFEngineConfig, VLLMEngineConfig
from turnrl.engines.hf import HFEngine
from turnrl.engines.vllm import save_weights
from turnrl.gateway.config import GatewayConfig
from turnrl.gateway.rewards import RewardDesk
from turnrl.gateway.server import Gateway
from turnrl.models.loading import load_model
from turnrl.record.writer import JsonlWriter
from turnrl.support.errors import describe
from turnrl.support.heap import learner_thread
from turnrl.support.imports import import_object
from turnrl.train.batch import batches_of, build_samples, packs
from turnrl.train.config import AlgorithmConfig, LearnConfig, OptimConfig, TrainLoopConfig, learner_device
from turnrl.train.logprobs import shares_prefixes
from turnrl.train.update import Learner, make_optimizer, trainable_parameters, update
from turnrl.types import SamplingParams, Trajectory, Weights, as_updatable, weight_version


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


T = TypeVar("T")
LEARN_DIR = "learn"
STOP_WAIT_S = 120.0  # at most this long for an update under way when the gateway stops
CHECKPOINT = "checkpoint"
WEIGHTS_DIR = "weights"  # what vLLM servers load a step's weights from


@dataclass(frozen=True)
class UpdatePlan:
    """The sections the update reads (``turnrl.train.update.UpdateSections``)."""

    algorithm: AlgorithmConfig
    optim: OptimConfig
    train: TrainLoopConfig
    sampling: SamplingParams


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
    """The learner beside a gateway: its policy and optimizer, the rewards desk it trains from."""

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
        device = learner_device(learn.train.device, config.engine)
        hf_logging.disable_progress_bar()  # checkpoints are saved while serving: no bars in its log
        policy = load_model(str(saved / "model") if resumed else config.model, device=device)
        trainable_parameters(policy, learn.optim.trainable)
        optimizer, scheduler = make_optimizer(
            [p for p in policy.parameters() if p.requires_grad], learn.optim
        )
        plan = UpdatePlan(learn.algorithm, learn.optim, learn.train, config.sampling)
        self.learner = Learner(plan, policy, None, gateway.encoder.template.tokenizer, optimizer, scheduler)
        self.baselines = Baselines(learn.baseline_decay)
        self.step = 0
        self.version = 0  # the served weights' version a resume goes on from
        self.trained: set[str] = set()  # sessions the policy has learned from (in its checkpoint)
        self.counts: dict[str, float] = {"stale": 0, "held_back": 0, "served_steps": 0, "failed_steps": 0}
        self.last: dict[str, float] = {}
        self.held_out = load_samples(learn.hold_back.data, None) if learn.hold_back else []
        self.served_score: float | None = None
        self._metrics = JsonlWriter(self.folder / "metrics.jsonl")
        self._updating: asyncio.Future[dict[str, float]] | None = None  # the update thread of a step
        self._executor = learner_thread("turnrl-learner", _lower_priority, (learn.nice,))
        if resumed:
            self._restore(saved)

    async def start(self) -> None:
        """Before serving: a resumed learner's weights into the engine, the rewarded sessions it had
        not trained on back in the queue, and the served weights' held-out score."""
        if self.version:  # the checkpoint's weights, under the version they were served as
            await self.engine.update_weights(await self._in_learner(self._weights), version=self.version)
        if self.resume:  # the rewards of an earlier life of this folder, not trained on yet
            self.desk.restore()
            self.desk.ready = [s for s in self.desk.ready if _name(s) not in self.trained]
        if self.held_out:
            self.served_score = await self._in_learner(self.score)
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
            while len(self.desk.ready) >= learn.sessions_per_step:
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
        """One step on the first ``sessions_per_step`` ready sessions; its metrics."""
        t0 = time.perf_counter()
        learn = self.config.learn
        sessions = self.desk.take(learn.sessions_per_step)
        version = weight_version(self.engine)
        fresh = [s for s in sessions if _oldest(s) >= version - learn.algorithm.max_staleness]
        self.counts["stale"] += len(sessions) - len(fresh)
        left_out = {_name(s): "stale" for s in sessions if s not in fresh}
        trajs = [t for s in fresh for t in s]
        advantages = []
        for session in fresh:
            advantage = self.baselines.advantage(session[0].group_id, session[0].score)
            advantages += [[advantage] * max(t.num_turns, 1) for t in session]
        samples = build_samples(learn.algorithm.samples, trajs, advantages, learn.algorithm.loss_turns)
        samples = [s for s in samples if any(s.advantages)]
        tokens = sum(sum(s.loss_mask) for s in samples)
        metrics: dict[str, float] = {}
        if samples:
            policy = self.learner.policy
            share = learn.train.share_prefix_tokens if shares_prefixes(policy) else 0
            parts = batches_of(
                samples,
                learn.train.micro_batch_tokens,
                self.learner.pad_id,
                packs(learn.train.pack, policy),
                share,
            )
            batches = [part.to(policy.device) for part in parts]
            kept = await self._in_learner(self._snapshot) if self.held_out else None
            self._updating = asyncio.ensure_future(self._in_learner(update, self.learner, batches, tokens))
            metrics = await asyncio.shield(self._updating)
            if await self._worse(kept):
                policy.load_state_dict(kept)
                left_out |= {_name(s): "held_back" for s in fresh}
            else:
                await self._serve()
        self.step += 1
        self.trained |= {_name(s) for s in sessions}
        if learn.train.save_every and self.step % learn.train.save_every == 0:
            await self._in_learner(self._save)
        self.desk.learned(sessions, self.step, left_out)
        rewards = [s[0].score for s in sessions]
        self.last = metrics | {
            "step": self.step,
            "sessions": len(sessions),
            "reward_mean": statistics.fmean(rewards),
            "tokens": tokens,
            "staleness_max": max((version - _oldest(s) for s in fresh), default=0),
            "weight_version": weight_version(self.engine),
            "seconds": time.perf_counter() - t0,
        }
        self._metrics.write_record(self.last | {"time": time.time()})
        self.console.print(
            f"learn: step {self.step}, {len(sessions)} sessions, reward {self.last['reward_mean']:.3f}, "
            f"serving version {self.last['weight_version']} ({self.last['seconds']:.1f} s)"
        )
        return self.last

    async def _worse(self, kept: dict[str, torch.Tensor] | None) -> bool:
        """Whether the held-out check holds these new weights back (``kept``: the served ones)."""
        hold = self.config.learn.hold_back
        if hold is None or kept is None or self.served_score is None:
            return False
        score = await self._in_learner(self.score)
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
        weights = await self._in_learner(self._weights)  # the copy too: not on the serving loop

        async def load() -> None:
            await self.engine.update_weights(weights)

        if self.config.learn.swap == "in_flight":
            await load()  # between two decode steps: the calls under way go on
        else:
            await self.gateway.update_weights(load)
        self.counts["served_steps"] += 1

    def score(self) -> float:
        """The policy's mean held-out reward: a greedy reply to each held-out prompt."""
        hold = self.config.learn.hold_back
        assert hold is not None
        reward = import_object(hold.reward, "learn.hold_back.reward")
        policy, conv = self.learner.policy, self.gateway.encoder.conversation(None)
        values = []
        was_training = policy.training
        policy.eval()
        try:
            with torch.no_grad():
                for sample in self.held_out:
                    ids = torch.tensor([conv.encode_prompt(sample.prompt)], device=policy.device)
                    out = policy.generate(ids, max_new_tokens=hold.max_tokens, do_sample=False)
                    text, _ = conv.assistant_text(out[0, ids.shape[1] :].tolist())
                    values.append(float(reward(sample, text)))
        finally:
            policy.train(was_training)
        return statistics.fmean(values)

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

    def _save(self) -> None:
        """The checkpoint, replaced whole (a crash leaves the old one or the new one)."""
        tmp, final, old = (self.folder / f"{CHECKPOINT}{suffix}" for suffix in (".tmp", "", ".old"))
        shutil.rmtree(tmp, ignore_errors=True)
        self.learner.policy.save_pretrained(tmp / "model")
        state = {
            "step": self.step,
            "version": weight_version(self.engine),
            "optimizer": self.learner.optimizer.state_dict(),
            "scheduler": self.learner.scheduler.state_dict(),
            "baselines": self.baselines.values,
            "trained": sorted(self.trained),
            "counts": self.counts,
        }
        torch.save(state, tmp / "state.pt")
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)

    def _restore(self, saved: Path) -> None:
        state = torch.load(saved / "state.pt", weights_only=False)
        self.learner.optimizer.load_state_dict(state["optimizer"])
        self.learner.scheduler.load_state_dict(state["scheduler"])
        self.baselines = Baselines(self.config.learn.baseline_decay, state["baselines"])
        self.step, self.version, self.trained = (
            int(state["step"]),
            int(state["version"]),
            set(state["trained"]),
        )
        self.counts.update(state["counts"])
        self.console.print(f"learn: resumed at step {self.step} ({len(self.trained)} sessions trained on)")

    def _snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the policy's weights."""
        return {k: v.detach().clone() for k, v in self.learner.policy.state_dict().items()}

    def _weights(self) -> Weights:
        """The policy's weights as the serving engine takes them: a copy for the embedded engine, a
        checkpoint folder (``learn/weights``, rewritten each time) that vLLM servers read."""
        if isinstance(self.gateway.engine, HFEngine):
            return self._snapshot()
        return save_weights(self.learner.policy.state_dict(), self.folder / WEIGHTS_DIR)

    async def _in_learner(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` on the learner's own thread, at ``learn.nice`` (its OpenMP workers, made by
        it, inherit that), so that serving keeps the CPU it needs."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, work, *args)

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
        self._executor.shutdown(wait=False)
        self._metrics.close()


def _lower_priority(nice: int) -> None:
    """Run the calling thread (and the threads it starts) at ``nice``."""
    with contextlib.suppress(OSError, AttributeError):  # a platform without per-thread priorities
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def _name(session: list[Trajectory]) -> str:
    branch = session[0].branch
    return branch.session if branch is not None else session[0].id


def _oldest(session: list[Trajectory]) -> int:
    """The oldest weight version among a session's sampled tokens."""
    return min((v for t in session for v in t.policy_versions if v >= 0), default=0)
