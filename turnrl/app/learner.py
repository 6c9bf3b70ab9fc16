"""A learning gateway's learner: the policy it trains and its optimizer, and where they live
(``learn.learner``).

``process`` (the default): a process of its own, started with the gateway (spawned, at
``learn.nice``, ended with it). It shares nothing with serving: not the interpreter's lock, which a
learner thread at nice 19 can hold while the scheduler gives it no CPU to let go of it; not the
OpenMP worker pool; not the C heap. A learner killed for memory takes its steps with it, not the
gateway: they fail, counted, and serving goes on. A step's weights come back through one
shared-memory block per dtype, not one file descriptor per tensor. Its torch threads are
``learn.threads`` (half the cores by default) and its OpenMP workers sleep between parallel
regions; while it computes, the gateway holds a spare OpenMP worker so that the engine's workers
spin less (``SpareWorkers``): where serving keeps every core busy, a learner without both ended no
step in 5 minutes (docs/learning.md).

``thread``: one thread of the gateway's process, at ``learn.nice``: it starts at once and shares
the gateway's memory (no second copy of the interpreter and libraries, nothing sent between
processes).

Either way the gateway calls the same ``PolicyLearner`` methods by name (``call``, or ``run`` from
the event loop), one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers.utils import logging as hf_logging

from turnrl.app.parts import load_samples
from turnrl.chat.encoder import ChatEncoder
from turnrl.engines.process import die_with_parent
from turnrl.engines.vllm import save_weights
from turnrl.models.loading import load_model
from turnrl.support.cpus import usable_cores
from turnrl.support.errors import describe
from turnrl.support.heap import learner_thread
from turnrl.support.imports import import_object
from turnrl.support.openmp import SpareWorkers
from turnrl.train.batch import TrainSample, batches_of, packs
from turnrl.train.config import AlgorithmConfig, LearnConfig, OptimConfig, TrainLoopConfig
from turnrl.train.logprobs import shares_prefixes
from turnrl.train.update import Learner, make_optimizer, trainable_parameters, update
from turnrl.types import SamplingParams, Weights

CHECKPOINT = "checkpoint"
START_TIMEOUT_S = 600.0  # a learner process that has not loaded its policy by then is stopped


@dataclass(frozen=True)
class UpdatePlan:
    """The sections the update reads (``turnrl.train.update.UpdateSections``)."""

    algorithm: AlgorithmConfig
    optim: OptimConfig
    train: TrainLoopConfig
    sampling: SamplingParams


@dataclass(frozen=True)
class LearnerSpec:
    """What a learner is built from (sent to its process as it is)."""

    model: str  # the policy's weights: the served model, or a resumed checkpoint's model folder
    device: str
    learn: LearnConfig
    sampling: SamplingParams
    encoder: ChatEncoder  # the gateway's: the held-out check's prompts and replies
    resume_from: str | None = None  # a checkpoint folder whose optimizer and state it takes up


class PolicyLearner:
    """The policy, its optimizer, and what the gateway asks of them."""

    def __init__(self, spec: LearnerSpec) -> None:
        learn = spec.learn
        hf_logging.disable_progress_bar()  # checkpoints are saved while serving: no bars in its log
        policy = load_model(spec.model, device=spec.device)
        trainable_parameters(policy, learn.optim.trainable)
        optimizer, scheduler = make_optimizer(
            [p for p in policy.parameters() if p.requires_grad], learn.optim
        )
        plan = UpdatePlan(learn.algorithm, learn.optim, learn.train, spec.sampling)
        self.learner = Learner(plan, policy, None, spec.encoder.template.tokenizer, optimizer, scheduler)
        self.spec = spec
        self.held_out = load_samples(learn.hold_back.data, None) if learn.hold_back else []
        self.kept: dict[str, torch.Tensor] | None = None  # the served weights, while a step is checked
        self._restored: dict[str, Any] = {}
        if spec.resume_from is not None:
            state = torch.load(Path(spec.resume_from) / "state.pt", weights_only=False)
            optimizer.load_state_dict(state.pop("optimizer"))
            scheduler.load_state_dict(state.pop("scheduler"))
            self._restored = state

    def restored(self) -> dict[str, Any]:
        """The gateway's side of the checkpoint it resumed from (``save``'s ``state``; {} if none)."""
        return self._restored

    def update(self, samples: list[TrainSample], tokens: int, keep: bool) -> dict[str, float]:
        """A step's update on ``samples`` (``tokens`` loss tokens); ``keep``: the weights before it are
        kept for ``put_back``."""
        learn, policy = self.spec.learn, self.learner.policy
        share = learn.train.share_prefix_tokens if shares_prefixes(policy) else 0
        parts = batches_of(
            samples,
            learn.train.micro_batch_tokens,
            self.learner.pad_id,
            packs(learn.train.pack, policy),
            share,
        )
        self.kept = self.state_dict() if keep else None
        return update(self.learner, [part.to(policy.device) for part in parts], tokens)

    def put_back(self) -> None:
        """The weights kept before the last update, back in the policy (a held-back step)."""
        assert self.kept is not None, "no weights were kept"
        self.learner.policy.load_state_dict(self.kept)
        self.kept = None

    def score(self) -> float:
        """The policy's mean held-out reward: a greedy reply to each held-out prompt."""
        hold = self.spec.learn.hold_back
        assert hold is not None
        reward = import_object(hold.reward, "learn.hold_back.reward")
        policy, conv = self.learner.policy, self.spec.encoder.conversation(None)
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

    def weights(self, folder: str | None) -> Weights:
        """The policy's weights as the serving engine takes them: a copy (``folder`` None: the
        embedded engine), or a checkpoint written to ``folder`` (rewritten each time) that vLLM
        servers read."""
        if folder is None:
            return self.state_dict()
        return str(save_weights(self.learner.policy.state_dict(), folder))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the policy's weights."""
        return {k: v.detach().clone() for k, v in self.learner.policy.state_dict().items()}

    def save(self, folder: str, state: dict[str, Any]) -> None:
        """A checkpoint in ``folder/checkpoint``, replaced whole (a crash leaves the old one or the
        new one): the policy, its optimizer and schedule, and the gateway's ``state``."""
        tmp, final, old = (Path(folder) / f"{CHECKPOINT}{suffix}" for suffix in (".tmp", "", ".old"))
        shutil.rmtree(tmp, ignore_errors=True)
        self.learner.policy.save_pretrained(tmp / "model")
        optim = {
            "optimizer": self.learner.optimizer.state_dict(),
            "scheduler": self.learner.scheduler.state_dict(),
        }
        torch.save(state | optim, tmp / "state.pt")
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)

    def niceness(self) -> int:
        """The nice value the learner's work runs at."""
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def threads(self) -> int:
        """The torch threads the learner's work runs on."""
        return torch.get_num_threads()


class LearnerHost(Protocol):
    """Where the ``PolicyLearner`` lives; its methods are called by name, one at a time."""

    def call(self, method: str, *args: Any) -> Any:
        """``method(*args)`` on the learner; blocks until it returns (its error raised here)."""
        ...

    async def run(self, method: str, *args: Any) -> Any:
        """``call`` without blocking the event loop."""
        ...

    def close(self) -> None:
        """Stop the learner (its process, its thread)."""
        ...


def start_learner(spec: LearnerSpec) -> LearnerHost:
    """The learner ``spec.learn.learner`` says, started and its policy loaded."""
    return ThreadLearner(spec) if spec.learn.learner == "thread" else ProcessLearner(spec)


class ThreadLearner:
    """The learner on one thread of the gateway's process, at ``learn.nice``."""

    def __init__(self, spec: LearnerSpec) -> None:
        self._executor = learner_thread("turnrl-learner", lower_priority, (spec.learn.nice,))
        self._core = self._executor.submit(PolicyLearner, spec).result()

    def call(self, method: str, *args: Any) -> Any:
        return self._executor.submit(getattr(self._core, method), *args).result()

    async def run(self, method: str, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, getattr(self._core, method), *args
        )

    def close(self) -> None:
        self._executor.shutdown(wait=False)


class LearnerError(RuntimeError):
    """The learner's own error, or its process's end."""


class ProcessLearner:
    """The learner in a process of its own: each call goes down a pipe and its result comes back up."""

    def __init__(self, spec: LearnerSpec) -> None:
        context = torch.multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=serve_learner, args=(child, spec), name="turnrl-learner", daemon=True
        )
        with passive_openmp():
            self._process.start()
        child.close()
        self._lock = threading.Lock()
        self._spare = SpareWorkers()
        self._executor = ThreadPoolExecutor(1, "turnrl-learner-pipe")
        if not self._conn.poll(START_TIMEOUT_S):
            self.close()
            raise LearnerError(f"the learner process did not load its policy in {START_TIMEOUT_S:.0f} s")
        self._receive()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def call(self, method: str, *args: Any) -> Any:
        with self._lock, self._spare:  # the learner computes: serving's workers spin less
            try:
                self._conn.send((method, args))
            except (OSError, ValueError):  # the pipe is gone with the process
                self._gone()
            return self._receive()

    async def run(self, method: str, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.call, method, *args)

    def _receive(self) -> Any:
        try:
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            self._gone()
        if kind == "error":
            raise LearnerError(value)
        return unpack_tensors(value) if kind == "tensors" else value

    def _gone(self) -> Any:
        self._process.join(5)
        code = self._process.exitcode
        why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        raise LearnerError(f"the learner process ended ({why}); the gateway serves the weights it has")

    def close(self) -> None:
        """Close the pipe (the learner ends once its call under way does), then stop it if it has
        not ended within 10 s."""
        with contextlib.suppress(OSError):
            self._conn.close()
        self._process.join(10)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._executor.shutdown(wait=False)
        self._spare.close()


def serve_learner(conn: Connection, spec: LearnerSpec) -> None:
    """The learner process: build the learner, then answer calls until the pipe closes."""
    # a Ctrl-C in a terminal reaches the whole process group: the gateway stops on it and lets the
    # update under way end first, then closes the pipe; SIGTERM (the gateway's death, multiprocessing
    # at exit, ``close``) ends it at once
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    lower_priority(spec.learn.nice)
    torch.set_num_threads(spec.learn.threads or learner_threads())
    try:
        core = PolicyLearner(spec)
    except Exception as exc:
        conn.send(("error", f"the learner could not start: {describe(exc)}"))
        return
    conn.send(("ok", None))
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result = getattr(core, method)(*args)
        except Exception as exc:
            conn.send(("error", describe(exc)))
            continue
        is_state = (
            isinstance(result, dict) and result and all(isinstance(v, torch.Tensor) for v in result.values())
        )
        conn.send(("tensors", pack_tensors(result)) if is_state else ("ok", result))


Packed = tuple[dict[torch.dtype, torch.Tensor], list[tuple[str, torch.dtype, int, torch.Size]]]


def pack_tensors(state: dict[str, torch.Tensor]) -> Packed:
    """``state`` in one shared-memory block per dtype (sent as one handle each), and where each
    tensor lies in its block."""
    sizes: dict[torch.dtype, int] = {}
    layout = []
    for name, tensor in state.items():
        layout.append((name, tensor.dtype, sizes.get(tensor.dtype, 0), tensor.shape))
        sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel()
    blocks = {dtype: torch.empty(n, dtype=dtype).share_memory_() for dtype, n in sizes.items()}
    for (_, dtype, start, shape), tensor in zip(layout, state.values(), strict=True):
        blocks[dtype][start : start + shape.numel()].copy_(tensor.reshape(-1))
    return blocks, layout


def unpack_tensors(packed: Packed) -> dict[str, torch.Tensor]:
    """The state dict ``pack_tensors`` packed: views into its blocks."""
    blocks, layout = packed
    return {
        name: blocks[dtype][start : start + shape.numel()].view(shape) for name, dtype, start, shape in layout
    }


@contextlib.contextmanager
def passive_openmp() -> Iterator[None]:
    """Processes started inside this block have OpenMP workers that sleep between parallel regions
    (``OMP_WAIT_POLICY=PASSIVE``, read once as the library loads; unless the user set it): a
    learner's spinning workers would burn the cores serving needs, and serving's the learner's."""
    if "OMP_WAIT_POLICY" in os.environ:
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        del os.environ["OMP_WAIT_POLICY"]


def learner_threads() -> int:
    """A learner process's default torch threads: half the cores this process may use, at least 1."""
    return max(1, usable_cores() // 2)


def lower_priority(nice: int) -> None:
    """Run the calling thread (and the threads it starts) at ``nice``."""
    with contextlib.suppress(OSError, AttributeError):  # a platform without per-thread priorities
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
