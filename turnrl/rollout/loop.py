"""The turn loop: one trajectory, model and env taking turns, exact tokens throughout.

``_episode`` is the outline, read top to bottom; the model's side of a turn is in ``generation``,
the env's in ``env_turns``, the end of an episode in ``finish``. What one episode carries from turn
to turn travels as one ``Play``.
"""

from __future__ import annotations

import dataclasses

from turnrl.record.episode import Episode
from turnrl.record.seeds import env_seed, request_seed
from turnrl.rollout import env_turns
from turnrl.rollout.finish import finish
from turnrl.rollout.generation import model_turn
from turnrl.rollout.spec import Play, RolloutSpec, TurnHook
from turnrl.support.errors import describe
from turnrl.types import Sample, StopReason, Trajectory

__all__ = ["TURN_LOOP", "RolloutSpec", "TurnHook", "TurnLoop", "env_seed", "request_seed", "run_trajectory"]


async def run_trajectory(sample: Sample, spec: RolloutSpec, sample_index: int = 0) -> Trajectory:
    """Run one episode of ``sample`` and return its exact token record. Never raises: env and
    engine failures, and bugs, end the trajectory with a stop reason and the error."""
    sample = dataclasses.replace(sample, seed=env_seed(spec.sampling.seed, sample, sample_index))
    ep = Episode(sample, sample_index)
    if spec.env_factory is None:
        return ep.fail(StopReason.ENV_ERROR, "env: the rollout spec has no env_factory (and no runner)")
    try:
        env = spec.env_factory(sample)
    except (
        Exception,
        SystemExit,
        KeyboardInterrupt,
    ) as exc:  # a trajectory that cannot start still comes back
        return ep.fail(StopReason.ENV_ERROR, f"env: {describe(exc)}")
    try:
        return await _episode(Play(ep, env, spec))
    except Exception as exc:  # a bug in turnrl or in a hook ends this trajectory only
        return ep.fail(StopReason.INTERNAL_ERROR, f"internal: {describe(exc)}")
    finally:
        await env_turns.close(env, spec.limits.env_timeout_s)


class TurnLoop:
    """The turn loop as a ``Runner``: one trajectory per group member (``run_trajectory``), its env
    from the spec's ``env_factory``; what runs a member when the spec names no runner of its own."""

    async def __call__(self, sample: Sample, index: int, spec: RolloutSpec) -> list[Trajectory]:
        return [await run_trajectory(sample, spec, index)]

    async def close(self) -> None:
        """Nothing to stop: each env is closed with its trajectory."""


TURN_LOOP = TurnLoop()


async def _episode(play: Play) -> Trajectory:
    """The turns of one episode, top to bottom."""
    ep, spec = play.ep, play.spec
    # 1. Reset the env: it gives the prompt messages (and the tools, via env.tools).
    prompt = await env_turns.reset(play)
    # 2. Encode the prompt once; from here on, tokens are only appended.
    try:
        play.conv = spec.encoder.conversation(play.env.tools)
        encoded = play.conv.prompt(prompt)
    except Exception as exc:  # e.g. the chat template rejects the prompt or the tools
        return ep.fail(StopReason.ENV_ERROR, f"prompt: {describe(exc)}")
    ep.prompt_ids = encoded.ids
    ep.record.start(encoded)
    while ep.running:
        # 3. Generate within the budget; keep the sampled tokens exactly.
        turn = await model_turn(play)
        if turn is None:
            break
        # 4. Let the env act on the model's text (tools run here), retrying failures.
        result = await env_turns.env_step(play, turn)
        if result is None:
            break
        # 5. Stop when the env is done (its last observation appended only if limits say so)
        #    or the model has used its turns.
        if result.done:
            env_turns.final_observation(play, result, turn)
            ep.end(result.stop_reason or StopReason.ENV_DONE)
        elif turn.finish_reason == "length":  # a cut turn the env was given (limits.step_cut_turns)
            cut_short = turn.end - turn.start < spec.sampling.max_tokens  # by the token budget left
            ep.end(StopReason.TOKEN_BUDGET if cut_short else StopReason.LENGTH)
        elif ep.record.num_model_turns >= spec.limits.max_turns:
            ep.end(StopReason.MAX_TURNS)
        else:
            # 6. Append the observation as delta tokens (mask 0) with its images, unless it
            #    would overflow: then nothing of it is appended and the budget ends the episode.
            env_turns.observe(play, result, turn.env_retries)
    # 7. Finalize: trajectory, reward (env still alive), sanity check, metrics.
    return await finish(play)
