"""Weight sync: the policy's new weights into the engines that roll out.

The embedded engine takes a state dict (with LoRA: the adapted layers, merged) between two decode
steps. vLLM servers load the whole model, pushed once for all of them (by the first rank under
torchrun: the servers are shared): broadcast to their workers (``engine.weight_sync: collective``)
or written as a checkpoint they load (``file``); turns in flight pause around the load
(``servers_load``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from turnrl.config import VLLMEngineConfig
from turnrl.engines.hf import HFEngine
from turnrl.engines.vllm import save_weights, scratch_weights_dir
from turnrl.train.data_parallel import barrier
from turnrl.train.fsdp import full_state_dict
from turnrl.train.lora import full_weights, is_lora, merged_state, serving_weights
from turnrl.train.state import Run
from turnrl.types import as_abortable, as_following, as_updatable, weight_version


async def push_weights(run: Run) -> None:
    """Put the policy's weights into the engine (a collective under FSDP: every rank gathers)."""
    learner = run.learner
    weights = _gathered_weights(learner.policy) if learner.sharded else None
    if isinstance(run.engine, HFEngine):
        await run.engine.update_weights(
            weights or serving_weights(learner.policy), strict=not is_lora(learner.policy)
        )
        return
    servers, on_gpu = run.config.engine, next(learner.policy.parameters()).is_cuda
    collective = isinstance(servers, VLLMEngineConfig) and servers.sync_way(on_gpu=on_gpu) == "collective"
    if run.ranks.main and collective:
        run.pushed = weights or full_weights(learner.policy)  # broadcast to the servers' workers
    elif run.ranks.main:
        if run.weights_dir is None:
            chosen = servers.weights_dir if isinstance(servers, VLLMEngineConfig) else None
            run.weights_dir = Path(chosen) if chosen else scratch_weights_dir()
        # in a worker thread: the rollouts of overlapped training go on meanwhile
        await asyncio.to_thread(save_weights, weights or full_weights(learner.policy), run.weights_dir)
    await servers_load(run)


def _gathered_weights(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The sharded policy's whole weights, on every rank (a collective); LoRA adapters merged in."""
    state = full_state_dict(policy)
    return merged_state(state, policy) if is_lora(policy) else state


async def servers_load(run: Run) -> None:
    """The servers load the weights in ``run.pushed`` (by collective) or ``run.weights_dir``.
    Overlapped training: every rank's turns in flight stop where they are (each rank aborts its own
    requests; their tokens are kept) and go on from their last token under the new weights (a
    partial rollout); with ``keep_in_flight`` the servers freeze them instead and they go on in the
    same requests, and no turn starts meanwhile.
    Under torchrun the first rank updates once every rank has paused; the others then take up the
    version the servers report."""
    control, ranks = run.spec.control, run.ranks
    new = weight_version(run.engine) + 1
    failure: BaseException | None = None  # raised once every rank has passed both barriers
    try:
        try:
            engine = run.config.engine
            if control is not None and isinstance(engine, VLLMEngineConfig) and engine.keep_in_flight:
                control.hold()
            elif control is not None:
                await control.pause(as_abortable(run.engine))
        except Exception as exc:
            failure = exc
        await asyncio.to_thread(barrier, ranks)  # every rank has paused; the checkpoint is written
        if ranks.main and failure is None:
            try:
                pushed, run.pushed = run.pushed, None
                await as_updatable(run.engine).update_weights(pushed or run.weights_dir or "")
            except Exception as exc:
                failure = exc
        await asyncio.to_thread(barrier, ranks)  # the servers serve the new weights (or failed to)
        if failure is not None:
            raise failure
        if not ranks.main:
            await as_following(run.engine).follow_weights(new)
    finally:
        if control is not None:
            control.resume(weight_version(run.engine))
