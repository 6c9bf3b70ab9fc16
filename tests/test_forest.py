"""A session's forest trains what was sampled, once: a real openai-SDK agent against the random tiny
Qwen3 at temperature 1 on the embedded engine, whose replies are all cut at max_tokens, and which
retries, asks for two replies and goes on from the second, edits and compacts. Every token the
engine sampled is matched, by its exact context, to the positions that train it in the samples the
trainer builds: each exactly once, the replies the agent did not go on from never."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from gateway_fixtures import gateway_for, serving
from openai import OpenAI

from turnrl.gateway import Reason, read_branches
from turnrl.gateway.forest import train_once
from turnrl.train.advantages import compute_advantages
from turnrl.train.batch import build_samples
from turnrl.types import Trajectory

SYSTEM = {"role": "system", "content": "You are terse."}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def run_agent(url: str) -> None:
    """The agent's calls: cut replies continued, a retry, two replies of which it takes the second, an
    edit and a compaction."""
    client = OpenAI(base_url=f"{url}/v1", api_key="forest", max_retries=0)

    def ask(messages: list[dict[str, Any]], n: int = 1) -> list[dict[str, Any]]:
        reply = client.chat.completions.create(model="tiny-qwen3", messages=messages, n=n)  # type: ignore[arg-type]
        assert all(c.finish_reason == "length" for c in reply.choices)  # every reply is cut
        return [c.message.model_dump(exclude_none=True) for c in reply.choices]

    start = [SYSTEM, user("Count to three.")]
    [a] = ask(start)  # call 0
    asked = [*start, a, user("Go on.")]
    ask(asked)  # call 1: its reply is dropped, the same request sent again
    [b] = ask(asked)  # call 2: the retry
    [c] = ask([*asked, b, user("And?")])  # call 3
    _, d1 = ask([*asked, b, user("And?"), c, user("Two ways?")], n=2)  # calls 4 and 5
    ask([*asked, b, user("And?"), c, user("Two ways?"), d1, user("The second, then.")])  # call 6
    ask([*start, a, user("Go on, slowly.")])  # call 7: an edit after the first reply
    ask([user("Summary so far: counting. Go on.")])  # call 8: compacted, the system prompt dropped


def trained_positions(trajs: list[Trajectory], mode: str) -> Counter[tuple[int, ...]]:
    """How many times each (context + token) is trained in the samples the trainer builds."""
    for traj in trajs:
        traj.reward = 1.0 if traj.branch.index % 2 else 0.0  # any advantages that are not all zero
    samples = build_samples(mode, trajs, compute_advantages("grpo", trajs))
    out: Counter[tuple[int, ...]] = Counter()
    for sample in samples:
        for i, m in enumerate(sample.loss_mask):
            if m:
                out[tuple(sample.input_ids[: i + 1])] += 1
    return out


@pytest.fixture(scope="module")
def session(tiny_qwen3_dir: Path, qwen3_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from turnrl.app.engines import hf_engine
    from turnrl.config import HFEngineConfig

    tmp_path = tmp_path_factory.mktemp("forest")
    engine = hf_engine(str(tiny_qwen3_dir), HFEngineConfig())
    sampling = {"max_tokens": 6, "temperature": 1.0}
    gateway = gateway_for(engine, qwen3_tokenizer, tmp_path, sampling=sampling)
    with serving(gateway) as url:
        run_agent(url)
    # the engine calls whose replies the agent did not go on from: the reply it sent the request
    # again after (the first branch's last), the first of the two it got (the retry branch's last),
    # and the last of the line it left to edit a message before it (the sample branch's last)
    first, retry, sample = gateway.sessions["forest"].branches[:3]
    ends = (first.sequence, retry.sequence, sample.sequence)
    unchosen = {k for k, (prompt, sampled) in enumerate(gateway.engine.seen) if prompt + sampled in ends}
    assert len(unchosen) == 3
    return gateway, unchosen, tmp_path / "calls.jsonl"


def test_cut_replies_continue_and_each_branch_says_why(session: Any) -> None:
    gateway, _, _ = session
    branches = gateway.sessions["forest"].branches
    assert [(b.reason, b.parent, b.calls) for b in branches] == [
        (Reason.FIRST, None, 2),  # each cut reply continued, none a branch of its own
        (Reason.RETRY, 0, 3),  # the retry, then the first of the two replies
        (Reason.SAMPLE, 1, 2),  # the second of the two, then the call that goes on from it
        (Reason.EDIT, 0, 1),
        (Reason.COMPACTION, 3, 1),  # a summary without the system prompt is a compaction
    ]


@pytest.mark.parametrize("mode", ["trajectory", "turn"])
def test_every_sampled_token_is_trained_once_and_unchosen_replies_never(session: Any, mode: str) -> None:
    gateway, unchosen, calls = session
    seen = gateway.engine.seen
    for trajs in (read_branches(calls), _live(gateway)):
        weights = trained_positions(trajs, mode)
        expected: Counter[tuple[int, ...]] = Counter()
        for k, (prompt, sampled) in enumerate(seen):
            for i in range(len(sampled)):
                expected[tuple(prompt + sampled[: i + 1])] = 0 if k in unchosen else 1
        assert sum(len(s) for _, s in seen) == len(expected)  # each sampled token has its own context
        assert {key: weights[key] for key in expected} == dict(expected)
        assert set(weights) <= set(expected)  # nothing else is trained
        assert sum(t.branch.unchosen_tokens for t in trajs) == sum(len(seen[k][1]) for k in unchosen)


def test_self_contained_branches_train_their_trunk_again(session: Any) -> None:
    _, _, calls = session
    own = read_branches(calls, self_contained=True)
    once = read_branches(calls)
    assert [t.input_ids for t in own] == [t.input_ids for t in once]
    trunk = sum(t.branch.trunk_tokens for t in once)
    unchosen = sum(t.branch.unchosen_tokens for t in once)
    assert trunk > 0 and sum(map(sum, (t.loss_mask for t in own))) == (
        sum(map(sum, (t.loss_mask for t in once))) + trunk + unchosen
    )


def test_a_trunk_whose_branch_is_left_out_is_trained_by_the_first_branch_that_holds_it(session: Any) -> None:
    gateway, unchosen, calls = session
    trajs = read_branches(calls, self_contained=True)
    trajs[1].exclude = "not_reinforced"  # the retry branch (reinforce: last, skip_system)
    train_once(trajs)
    weights = trained_positions([t for t in trajs if not t.exclude], "trajectory")
    retry = gateway.sessions["forest"].branches[1]
    own = [k for k, where in enumerate(gateway.engine.where) if where == "forest/1"]
    for k in own:  # the retry's replies: the sample branch, which copied them, trains them
        prompt, sampled = gateway.engine.seen[k]
        assert weights[tuple(prompt + sampled)] == (0 if k in unchosen else 1)
    assert len(own) == retry.calls + 1 == 4  # and the second reply of its n=2 call


def _live(gateway: Any) -> list[Trajectory]:
    """The session's branches as the harness hands them to training."""
    trajs = [b.trajectory("forest") for b in gateway.sessions["forest"].branches]
    train_once(trajs)
    return trajs
