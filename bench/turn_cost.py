"""Per-turn cost of the rollout layer, without engine or env, as history grows.

Runs the real turn loop (``run_trajectory``) with an engine that answers instantly with
pre-tokenized replies and an env that answers instantly with a tool result, and times the
rollout layer between the engine's return and its next call (decode, append, mask,
logprobs, env bookkeeping, delta-encode the observation). Side by side, in the same process:
- re-render: render the whole conversation with the chat template each turn and encode it
  (what schedulers that keep messages, not tokens, do);
- bare delta: render a fixed base with and without the new message, encode, slice (the
  seed documents' delta encoding, done naively each turn).

    .venv/bin/python bench/turn_cost.py [--turns 10 50 100] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

from transformers import AutoTokenizer

from turnrl.chat.encoder import ChatEncoder
from turnrl.chat.report import DEFAULT_TOOLS
from turnrl.env.base import Env
from turnrl.models import qwen3_tokenizer_dir
from turnrl.rollout.loop import RolloutSpec, run_trajectory
from turnrl.types import Generation, Limits, Message, Sample, SamplingParams, StepResult

TOOLS = DEFAULT_TOOLS
PROMPT: list[Message] = [
    {"role": "system", "content": "You are a careful assistant. Use the calculator."},
    {"role": "user", "content": "Add up the numbers the tool gives you, one call per turn."},
]
REPLY = (
    "<think>\nI need the next number; calling the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23+4"}}\n</tool_call>'
)
RESULT = "395 (17*23+4). Keep going: the running total is now larger than before."


class InstantEngine:
    """Answers at once with the same pre-tokenized reply; records when it returns and is called."""

    def __init__(self, reply_ids: list[int]) -> None:
        self.reply_ids = reply_ids
        self.gaps: list[float] = []
        self._returned: float | None = None

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Any = (),
        *,
        session: str | None = None,
    ) -> Generation:
        now = time.perf_counter()
        if self._returned is not None:
            self.gaps.append(now - self._returned)
        ids = list(self.reply_ids)
        gen = Generation(ids, [-0.1] * len(ids), "stop")
        self._returned = time.perf_counter()
        return gen

    async def close(self) -> None:
        return None


class InstantToolEnv(Env):
    """Returns the same tool result every turn."""

    tools = TOOLS

    async def step(self, action: str) -> StepResult:
        return StepResult(
            [{"role": "tool", "name": "calculator", "tool_call_id": "call_0", "content": RESULT}]
        )


def turnrl_costs(tokenizer: Any, turns: int) -> list[float]:
    """Seconds of rollout-layer work per turn, for each turn of one trajectory."""
    encoder = ChatEncoder(tokenizer)
    reply_ids = [*encoder.template.encode(REPLY), tokenizer.convert_tokens_to_ids("<|im_end|>")]
    engine = InstantEngine(reply_ids)
    limits = Limits(max_turns=turns, max_context_tokens=10**7, env_timeout_s=None)
    spec = RolloutSpec(
        InstantToolEnv, engine, encoder, SamplingParams(max_tokens=10**6), limits, check="disable"
    )
    asyncio.run(run_trajectory(Sample("bench", PROMPT), spec))
    return engine.gaps


def rerender_costs(tokenizer: Any, turns: int) -> list[float]:
    """Seconds per turn to re-render and re-encode the whole conversation."""
    messages = list(PROMPT)
    costs = []
    for _ in range(turns):
        messages.append({"role": "assistant", "content": REPLY})
        messages.append({"role": "tool", "name": "calculator", "tool_call_id": "call_0", "content": RESULT})
        t0 = time.perf_counter()
        text = tokenizer.apply_chat_template(
            messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
        )
        tokenizer.encode(text, add_special_tokens=False)
        costs.append(time.perf_counter() - t0)
    return costs


def bare_delta_costs(tokenizer: Any, turns: int) -> list[float]:
    """Seconds per turn for the naive delta encode: two renders of a fixed base, encode, slice."""
    base: list[Message] = [*PROMPT, {"role": "assistant", "content": "x"}]
    costs = []
    for _ in range(turns):
        obs = {"role": "tool", "name": "calculator", "tool_call_id": "call_0", "content": RESULT}
        t0 = time.perf_counter()
        prev = tokenizer.apply_chat_template(base, tools=TOOLS, tokenize=False)
        full = tokenizer.apply_chat_template(
            [*base, obs], tools=TOOLS, add_generation_prompt=True, tokenize=False
        )
        tokenizer.encode(full[len(prev) :], add_special_tokens=False)
        costs.append(time.perf_counter() - t0)
    return costs


def at_depth(costs: list[float], depth: int, window: int = 5) -> float:
    """Median cost of the turns just before ``depth`` (milliseconds)."""
    part = costs[max(0, depth - window) : depth]
    return statistics.median(part) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    longest = max(args.turns)
    methods = {"turnrl": turnrl_costs, "re-render": rerender_costs, "bare delta": bare_delta_costs}
    runs: dict[str, list[list[float]]] = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, fn in methods.items():
            runs[name].append(fn(tokenizer, longest + 1))
    print(
        f"per-turn cost (ms, median over {args.repeats} runs) at N turns of history; Qwen3 template + 1 tool"
    )
    print(f"{'method':<12}" + "".join(f"{n:>10}" for n in args.turns))
    table: dict[str, list[float]] = {}
    for name, all_costs in runs.items():
        table[name] = [statistics.median(at_depth(c, n) for c in all_costs) for n in args.turns]
        print(f"{name:<12}" + "".join(f"{v:>10.4f}" for v in table[name]))
    for other in ("re-render", "bare delta"):
        ratios = [o / t for o, t in zip(table[other], table["turnrl"], strict=True)]
        print(f"{other} / turnrl: " + "  ".join(f"{r:.1f}x" for r in ratios))
    flat = table["turnrl"][-1] / table["turnrl"][0]
    print(f"turnrl flatness (cost at {args.turns[-1]} / cost at {args.turns[0]}): {flat:.2f}")


if __name__ == "__main__":
    main()
