"""The state of one episode while it runs: its token record, why it stopped, metrics and timings.

``Episode`` owns everything the turn loop accumulates and builds the ``Trajectory`` at the end,
for a finished episode and for one that failed, so the loop itself only decides what happens next.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from turnrl.record.record import ResponseRecord
from turnrl.types import Sample, StopReason, Trajectory


@dataclass
class Episode:
    """One trajectory in the making."""

    sample: Sample  # the sample, with this trajectory's env seed
    index: int  # index in the group
    record: ResponseRecord = field(default_factory=ResponseRecord)  # tokens, mask, logprobs, turns
    prompt_ids: list[int] = field(default_factory=list)  # the encoded prompt
    stop: StopReason | None = None  # set once: why the episode ends
    error: str | None = None  # the error behind an error stop
    turn_rewards: list[float] = field(default_factory=list)  # env reward per model turn
    info: dict[str, Any] = field(default_factory=dict)  # numeric step info, summed
    failures: dict[str, int] = field(default_factory=dict)  # env failures by kind (timeout, exception type)
    timings: dict[str, float] = field(
        default_factory=lambda: {"time/generate": 0.0, "time/env": 0.0, "time/encode": 0.0}
    )
    env_retries: int = 0  # failed env attempts that a retry recovered or that ended the episode
    observations_truncated: int = 0  # observation texts cut to limits.max_observation_chars
    env_masked: int = 0  # model tokens the env marked as context (StepResult.train_turn=False)
    inference_rewrites: int = 0  # turns whose inference-time context differs from the exact prefix
    last_token_text: str | None = (
        None  # the last model turn's final token as text (None after an observation)
    )

    @property
    def running(self) -> bool:
        """Whether the episode goes on."""
        return self.stop is None

    def end(self, stop: StopReason, error: str | None = None) -> None:
        """Stop the episode (the first reason given wins)."""
        if self.stop is None:
            self.stop, self.error = stop, error

    def clock(self, key: str, since: float) -> float:
        """Add the seconds since ``since`` to timing ``key``; return them."""
        seconds = time.perf_counter() - since
        self.timings[key] += seconds
        return seconds

    def merge_info(self, step_info: dict[str, Any]) -> None:
        """Accumulate numeric step info (tool calls, errors) into the trajectory's info."""
        for key, value in step_info.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.info[key] = self.info.get(key, 0) + value

    def trajectory(self) -> Trajectory:
        """The trajectory as far as the episode got (an episode that never started: the sample's prompt)."""
        rec = self.record
        return Trajectory(
            id=f"{self.sample.id}/{self.index}",
            group_id=self.sample.id,
            data_source=self.sample.data_source,
            stop_reason=self.stop or StopReason.INTERNAL_ERROR,
            prompt_ids=self.prompt_ids,
            response_ids=rec.response_ids,
            loss_mask=rec.loss_mask,
            rollout_logprobs=rec.rollout_logprobs,
            turns=rec.turns,
            messages=rec.messages or list(self.sample.prompt),
            turn_rewards=self.turn_rewards,
            num_turns=rec.num_model_turns,
            metrics={
                "env_retries": self.env_retries,
                "env_failures": self.failures,
                **(
                    {"observations/truncated": self.observations_truncated}
                    if self.observations_truncated
                    else {}
                ),
                **({"tokens/env_masked": self.env_masked} if self.env_masked else {}),
                **({"inference/rewritten_turns": self.inference_rewrites} if self.inference_rewrites else {}),
                **self.timings,
            },
            sample_index=self.index,
            error=self.error,
            info={"num_tool_calls": 0, **self.info},  # present on every trajectory, tools or not
            policy_versions=rec.policy_versions,
            images=[image.image for image in rec.images],
            multimodal_inputs=rec.multimodal.merge(),
        )

    def fail(self, stop: StopReason, error: str) -> Trajectory:
        """End with an error now and return the trajectory as far as it got."""
        self.end(stop, error)
        return self.trajectory()


def failed_trajectory(sample: Sample, index: int, error: str, stop: StopReason) -> Trajectory:
    """The record of a trajectory that failed before its first turn (no env, no prompt)."""
    return Episode(sample, index).fail(stop, error)
