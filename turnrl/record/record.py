"""The growing token record of one trajectory: ids, mask, logprobs and turn spans, appended in place."""

from __future__ import annotations

from dataclasses import dataclass, field

from turnrl.chat.encoder import Encoded
from turnrl.types import Generation, Message, Turn
from turnrl.vision.buffer import MultimodalBuffer, first_images
from turnrl.vision.content import count_images
from turnrl.vision.processor import ImageInput


@dataclass
class ResponseRecord:
    """Response tokens as they are appended; every append is O(new tokens)."""

    sequence: list[int] = field(default_factory=list)  # prompt + response: what the engine conditions on
    response_ids: list[int] = field(default_factory=list)  # model and env tokens
    loss_mask: list[int] = field(default_factory=list)  # 1 model, 0 env/template
    rollout_logprobs: list[float] = field(default_factory=list)  # 0.0 where mask is 0
    policy_versions: list[int] = field(default_factory=list)  # per token; -1 where mask is 0
    turns: list[Turn] = field(default_factory=list)  # spans in order
    messages: list[Message] = field(default_factory=list)  # the conversation so far
    num_model_turns: int = 0  # model turns so far
    reported: int = 0  # turns already passed to the per-turn hook
    images: list[ImageInput] = field(default_factory=list)  # every image so far: what the engine sees
    multimodal: MultimodalBuffer = field(default_factory=MultimodalBuffer)  # training inputs, per turn

    def start(self, prompt: Encoded) -> None:
        """Begin with the encoded prompt and its images."""
        self.sequence = list(prompt.ids)
        self.messages = list(prompt.messages)
        self.images = list(prompt.images)
        self.multimodal.append(prompt.inputs)

    def add_model(self, gen: Generation, text: str, seconds: float, versions: list[int]) -> Turn:
        """Append the engine's tokens exactly as sampled (mask 1)."""
        if len(gen.logprobs) != len(gen.token_ids):
            raise ValueError(f"engine returned {len(gen.token_ids)} tokens but {len(gen.logprobs)} logprobs")
        start = len(self.response_ids)
        self.response_ids += gen.token_ids
        self.sequence += gen.token_ids
        self.loss_mask += [1] * len(gen.token_ids)
        self.rollout_logprobs += gen.logprobs
        self.policy_versions += versions
        turn = Turn(
            "assistant", start, len(self.response_ids), text, {"generate": seconds}, gen.finish_reason
        )
        self.turns.append(turn)
        self.num_model_turns += 1
        return turn

    def add_env(self, obs: Encoded, text: str, seconds: float, retries: int) -> None:
        """Append inserted tokens (mask 0) for observation messages, with their images."""
        ids, messages = obs.ids, obs.messages
        self.images += obs.images
        self.multimodal.append(obs.inputs)
        start = len(self.response_ids)
        self.response_ids += ids
        self.sequence += ids
        self.loss_mask += [0] * len(ids)
        self.rollout_logprobs += [0.0] * len(ids)
        self.policy_versions += [-1] * len(ids)
        role = "+".join(dict.fromkeys(str(m.get("role")) for m in messages))
        self.turns.append(
            Turn(role, start, len(self.response_ids), text, {"encode": seconds}, None, None, retries)
        )
        self.messages += messages


def fork_record(record: ResponseRecord, prompt_len: int, end: int, messages: int) -> ResponseRecord:
    """The first ``end`` tokens of ``record`` (prompt included) as a record of their own, with the
    turns that end by then and the first ``messages`` messages: where a forked branch starts."""
    cut = end - prompt_len
    turns = [t for t in record.turns if t.end <= cut]
    kept = list(record.messages[:messages])
    images = count_images(kept)
    multimodal = MultimodalBuffer()
    multimodal.append(first_images(record.multimodal.merge(), images) if images else {})
    return ResponseRecord(
        sequence=record.sequence[:end],
        response_ids=record.response_ids[:cut],
        loss_mask=record.loss_mask[:cut],
        rollout_logprobs=record.rollout_logprobs[:cut],
        policy_versions=record.policy_versions[:cut],
        turns=list(turns),
        messages=kept,
        num_model_turns=sum(1 for t in turns if t.role == "assistant"),
        reported=len(turns),
        images=record.images[:images],
        multimodal=multimodal,
    )
