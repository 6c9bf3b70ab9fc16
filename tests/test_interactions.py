"""Simulated users (verl's interactions): by code and by a second model (embedded engine, and an
OpenAI-compatible chat endpoint on a real llama.cpp server), beside tools in one trajectory, with
exact tokens on the Qwen3 template; bad configs and bad users are one line or a stop reason."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from parts import await_part, missing

from turnrl.app import LLMUser, chat_model
from turnrl.chat.encoder import ChatEncoder
from turnrl.engines.scripted import ScriptedEngine
from turnrl.env.builtin.tool_config import ConfiguredToolEnv
from turnrl.env.interaction import InteractionError, load_interactions
from turnrl.rollout.loop import RolloutSpec, run_trajectory
from turnrl.types import Limits, Sample, SamplingParams, StopReason

REPO = Path(__file__).resolve().parents[1]
TOOLS = str(REPO / "examples" / "tools" / "calculator.yaml")


class Tutor:
    """A verl-style interaction: checks the answer against the row's ground truth."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.name = config.get("name", "tutor")
        self.solved: dict[str, bool] = {}
        self.finalized: list[str] = []

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        assert instance_id is not None
        self.solved[instance_id] = False
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        answer = re.findall(r"<answer>(.*?)</answer>", messages[-1]["content"])
        if answer and answer[-1].strip() == str(kwargs["ground_truth"]):
            self.solved[instance_id] = True
            return True, "Correct, well done!", 1.0, {"attempts": len(messages)}
        return False, "That is not right. Check your arithmetic and try again.", 0.0, {}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        return float(self.solved[instance_id])

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self.finalized.append(instance_id)


def write_yaml(tmp_path: Path, entries: list[dict[str, Any]]) -> str:
    path = tmp_path / "interaction.yaml"
    path.write_text(yaml.safe_dump({"interaction": entries}))
    return str(path)


def call(expression: str) -> str:
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>\n{body}\n</tool_call>"


def spec(tokenizer: Any, replies: Any, env: Any, **limits: Any) -> RolloutSpec:
    return RolloutSpec(
        env_factory=env,
        engine=ScriptedEngine(tokenizer, replies),
        encoder=ChatEncoder(tokenizer, {"enable_thinking": False}),
        sampling=SamplingParams(max_tokens=64),
        limits=Limits(**{"max_turns": 6, **limits}),
    )


def sample(name: str | None = "tutor", truth: str = "42", tools: list[str] | None = None) -> Sample:
    kwargs = {"ground_truth": truth} | ({"name": name} if name else {})
    prompt = [{"role": "user", "content": "What is 6 * 7? Use the calculator."}]
    return Sample("s", prompt, tools=tools, metadata={"extra_info": {"interaction_kwargs": kwargs}})


async def test_a_code_user_and_tools_interleave_in_one_exact_trajectory(
    qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    config = write_yaml(tmp_path, [{"name": "tutor", "class_name": "test_interactions.Tutor"}])
    env = lambda s: ConfiguredToolEnv(s, TOOLS, interaction_config=config)  # noqa: E731
    replies = [call("6 * 8"), "<answer>48</answer>", call("6 * 7"), "<answer>42</answer>", "unused"]
    traj = await run_trajectory(sample(tools=["calculator"]), spec(qwen3_tokenizer, replies, env))
    assert traj.stop_reason is StopReason.ENV_DONE and traj.num_turns == 4, traj.error
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant", "user",
                                                   "assistant", "tool", "assistant"]  # fmt: skip
    assert traj.messages[4]["content"].startswith("That is not right")
    assert traj.turn_rewards == [0.0, 0.0, 0.0, 1.0] and traj.reward == 1.0  # calculate_score
    assert traj.info["num_user_turns"] == 2 and traj.info["num_tool_calls"] == 2
    assert traj.turns[-1].info["interaction"] == "tutor"
    assert traj.turns[-1].info["final_observation"] == "dropped"  # "Correct, well done!" came with done
    assert traj.metrics["check/ok"] is True and traj.metrics["check/mismatches"] == 0
    tutor = load_interactions(config)  # a fresh load: the env's is cached per file version
    assert isinstance(tutor["tutor"], Tutor)


async def test_the_only_interaction_is_chosen_when_the_row_names_none(
    qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    config = write_yaml(tmp_path, [{"class_name": "test_interactions.Tutor", "config": {}}])
    env = lambda s: ConfiguredToolEnv(s, interaction_config=config)  # noqa: E731
    traj = await run_trajectory(sample(None), spec(qwen3_tokenizer, ["<answer>42</answer>"], env))
    assert traj.stop_reason is StopReason.ENV_DONE and traj.reward == 1.0


@pytest.fixture(scope="module")
def smollm2_user() -> LLMUser:
    return LLMUser(
        {
            "name": "customer",
            "model": "smollm2-135m",
            "persona": "You are a customer. Your order {order_id} arrived broken. Ask for a refund.",
            "max_user_turns": 2,
            "sampling": {"temperature": 0.0, "max_tokens": 24},
        }
    )


async def test_a_user_played_by_a_second_embedded_model(qwen3_tokenizer: Any, smollm2_user: LLMUser) -> None:
    from turnrl.env.tool_env import ToolEnv

    env = lambda s: ToolEnv(s, [], interactions={"customer": smollm2_user})  # noqa: E731
    replies = ["Hello! How can I help you today?", "I am sorry to hear that. What is your order number?",
               "Thank you: a refund for A-17 is on its way."]  # fmt: skip
    row = Sample(
        "c", [{"role": "user", "content": "Hi."}], metadata={"interaction_kwargs": {"order_id": "A-17"}}
    )
    before = dict(smollm2_user.stats)
    traj = await run_trajectory(row, spec(qwen3_tokenizer, replies, env, final_observation=True))
    # max_user_turns 2: the user writes two messages after the row's own, the agent answers each
    assert traj.stop_reason is StopReason.ENV_DONE and traj.num_turns == 3
    users = [m["content"] for m in traj.messages if m["role"] == "user"][1:]
    assert len(users) == 2 and all(isinstance(u, str) and u for u in users)
    assert smollm2_user.stats["calls"] - before["calls"] == 2  # none generated to be thrown away
    assert smollm2_user.stats["completion_tokens"] > before["completion_tokens"]
    assert [t.info["interaction_meta"]["user_turn"] for t in traj.turns if t.role == "assistant"] == [1, 2, 2]
    assert traj.turns[-1].role == "assistant"  # the agent's answer to the user's last message ends it
    assert traj.metrics["check/ok"] is True and traj.metrics["check/mismatches"] == 0


def _llama_server_or_skip() -> None:
    from turnrl.engines.servers import find_llama_server

    await_part("install_server")
    if find_llama_server() is None:
        missing("llama-server not installed: run scripts/install_server.sh")


async def test_a_user_on_an_openai_compatible_chat_endpoint(qwen3_tokenizer: Any, tmp_path: Path) -> None:
    _llama_server_or_skip()
    from turnrl.engines.servers import LlamaServer
    from turnrl.env.tool_env import ToolEnv
    from turnrl.models import resolve_model

    spec_ = resolve_model("smollm2-135m")
    gguf = Path(spec_.path) / str(spec_.gguf_file) if spec_.gguf_file else Path(spec_.path)
    server = LlamaServer(
        gguf, parallel=2, ctx_size=4096, extra_args=["--jinja"], log_path=tmp_path / "llama.log"
    )
    server.start()
    try:
        persona = {"persona": "You are a curious student.", "max_user_turns": 1}
        sampling = {"temperature": 0.0, "max_tokens": 16}
        user = LLMUser({"base_url": f"{server.url}/v1", **persona, "sampling": sampling})
        endpoint = chat_model({"base_url": f"{server.url}/v1"})
        direct = await endpoint.chat([{"role": "user", "content": "Hi"}], 8)
        await endpoint.close()
        assert direct.text and direct.completion_tokens > 0
        env = lambda s: ToolEnv(s, [], interactions={"user": user})  # noqa: E731
        teach = Sample("o", [{"role": "user", "content": "Teach me."}])
        replies = ["What would you like to learn?", "Good question: let us start."]
        traj = await run_trajectory(teach, spec(qwen3_tokenizer, replies, env))
        assert traj.stop_reason is StopReason.ENV_DONE and user.stats["calls"] == 1
        assert user.stats["completion_tokens"] > 0 and traj.metrics["check/ok"] is True
        # the same server as a token engine (turnrl's own openai kind, llama.cpp dialect) behind
        # SmolLM2's chat template: a user on a server engine kind
        engine = {"kind": "openai", "urls": [server.url], "dialect": "llamacpp"}
        tokens = chat_model({"model": "smollm2-135m", "engine": engine, "sampling": sampling})
        reply = await tokens.chat([{"role": "user", "content": "Say hello."}])
        assert reply.text and reply.completion_tokens > 0 and reply.prompt_tokens > 5
        await user.model.close()
    finally:
        server.stop()


class Broken(Tutor):
    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        return "not a tuple"


async def test_a_user_that_answers_garbage_ends_the_trajectory_with_the_reason(
    qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    config = write_yaml(tmp_path, [{"name": "b", "class_name": "test_interactions.Broken"}])
    env = lambda s: ConfiguredToolEnv(s, interaction_config=config)  # noqa: E731
    traj = await run_trajectory(
        sample("b"), spec(qwen3_tokenizer, ["hello"], env, max_env_retries_per_turn=0)
    )
    assert traj.stop_reason is StopReason.ENV_ERROR and traj.response_ids
    assert (
        traj.error is not None
        and "interaction 'b' returned str, expected (done, text, score, meta)" in traj.error
    )
    unknown = await run_trajectory(sample("nobody"), spec(qwen3_tokenizer, ["hello"], env))
    assert unknown.stop_reason is StopReason.ENV_ERROR
    assert unknown.error is not None and "names interaction 'nobody'; known: b" in unknown.error


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([{"name": "x", "class_name": "no_such_mod.User"}], "no module named 'no_such_mod'"),
        ([{"name": "x"}], "interaction[0] needs a 'class_name'"),
        ([{"name": "x", "class_name": "builtins.dict"}], "has no start_interaction, generate_response"),
        ([{"name": "x", "class_name": "test_interactions.Tutor"}] * 2, "two interactions are named 'x'"),
        ([{"class_name": "turnrl.app.LLMUser", "config": {"persona": "p"}}], "needs 'model'"),
    ],
)
def test_bad_interaction_configs_are_one_line(
    tmp_path: Path, entries: list[dict[str, Any]], message: str
) -> None:
    with pytest.raises((InteractionError, ValueError)) as info:
        load_interactions(write_yaml(tmp_path, entries))
    assert message in str(info.value) and "\n" not in str(info.value)
