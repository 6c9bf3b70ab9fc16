"""The trajectory viewer: a page built from real rollouts, driven in real headless Chromium."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from parts import missing

from turnrl.chat.encoder import ChatEncoder
from turnrl.engines.scripted import Reply, ScriptedEngine, ScriptedReply
from turnrl.env.tool_env import ToolEnv
from turnrl.rollout.collector import collect
from turnrl.rollout.spec import RolloutSpec
from turnrl.testing import EchoEnv
from turnrl.tools import FunctionTool
from turnrl.tools.builtin import calculator
from turnrl.types import Limits, Message, Sample, SamplingParams, StopReason
from turnrl.viewer import ViewerError, load_run_tokenizer, make_server, write_viewer
from turnrl.viewer.page import to_script_json, turn_messages

CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'
IMAGE = (
    "data:image/svg+xml;base64,"
    + base64.b64encode(
        b'<svg xmlns="http://www.w3.org/2000/svg" width="120" height="72">'
        b'<rect width="120" height="72" fill="#4a8"/><circle cx="60" cy="36" r="24" fill="#fc3"/></svg>'
    ).decode()
)
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
]


# ---------------------------------------------------------------- a real run directory


def varied(tokenizer: Any, text: str) -> ScriptedReply:
    """A reply whose logprobs spread over the heat map's range."""
    count = len(tokenizer.encode(text, add_special_tokens=False))
    return ScriptedReply(text=text, logprobs=[-((i * 0.73) % 6.5) for i in range(count)])


class RewritingEnv(EchoEnv):
    """Edits an observation it already returned: the bug the end-of-trajectory check exists to
    catch (the conversation no longer renders to the tokens the model was given)."""

    def __init__(self, sample: Sample) -> None:
        super().__init__(sample, done_after=3)
        self.sent: list[Message] = []

    def format_observation(self, observation: Any) -> list[Message]:
        messages = super().format_observation(observation)
        if self.sent:
            self.sent[0]["content"] = "Edited afterwards."
        self.sent = messages
        return messages


async def rollout(
    tokenizer: Any, out: Path, samples: list[Sample], replies: list[Reply], env: Any, **limits: Any
) -> None:
    """Append one scripted rollout per sample to ``out``."""
    spec = RolloutSpec(
        env_factory=env,
        engine=ScriptedEngine(tokenizer, replies),
        encoder=ChatEncoder(tokenizer),
        sampling=SamplingParams(max_tokens=64),
        limits=Limits(**{"max_turns": 4, "env_timeout_s": 5.0, **limits}),
    )
    await collect(samples, spec, concurrency=1, out_path=out)


async def build_run(tokenizer: Any, run: Path, model: str) -> Path:
    """Five trajectories: tool calls and results, an image prompt, a check mismatch, max_turns, an error."""
    out = run / "trajectories.jsonl"
    tools = lambda s: ToolEnv(s, [FunctionTool(calculator)])  # noqa: E731
    calc = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "17*23+4?"}]
    replies: list[Reply] = [
        varied(tokenizer, "<think>\nFirst the product.\n</think>\n\n" + CALL.format("17*23")),
        varied(tokenizer, "<think>\nNow add.\n</think>\n\nAdding 4.\n" + CALL.format("391+4")),
        varied(tokenizer, "<think>\nDone.\n</think>\n\n<answer>395</answer>"),
    ]
    await rollout(tokenizer, out, [Sample("calc-0", calc, data_source="calc")], replies, tools)
    echo = lambda s: EchoEnv(s, done_after=2)  # noqa: E731
    story = [Sample("story-0", [{"role": "user", "content": "Describe this."}], data_source="story")]
    await rollout(tokenizer, out, story, [varied(tokenizer, "A cat."), "The end."], echo)
    mismatch = [Sample("story-1", [{"role": "user", "content": "Hi"}], data_source="story")]
    await rollout(tokenizer, out, mismatch, ["Hello", "Why?", "bye"], RewritingEnv)
    forever = [Sample("story-2", [{"role": "user", "content": "Go"}], data_source="story")]
    await rollout(tokenizer, out, forever, ["one", "two"], EchoEnv, max_turns=2)
    await rollout(tokenizer, out, [Sample("story-3", [{"role": "user", "content": "Hey"}])], ["x"], echo)
    with_image(out, "story-0/0")
    summary = {"trajectories": 5, "reward/mean": 0.4, "stop_reasons": {"env_done": 3},
               "time/turn_seconds": {"generate": {"p99": 0.2}}, "tokens/model_mean": 12.5}  # fmt: skip
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "config.yaml").write_text(yaml.safe_dump({"model": model, "output_dir": str(run)}))
    return run


def with_image(path: Path, traj_id: str) -> None:
    """Give one trajectory a VLM-style prompt (text and image parts), as a VLM run will write it."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    image = [{"type": "text", "text": "Describe </script><b>this</b>."}, {"type": "image", "image": IMAGE}]
    for traj in lines:
        if traj["id"] == traj_id:
            traj["messages"][0]["content"] = image
    path.write_text("".join(json.dumps(t) + "\n" for t in lines))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer: Any, tiny_qwen3_dir: Path) -> Path:
    """A run directory holding real trajectories, summary.json and config.yaml."""
    import asyncio

    run = tmp_path_factory.mktemp("run")
    return asyncio.run(build_run(qwen3_tokenizer, run, str(tiny_qwen3_dir)))


def trajectories(run: Path) -> dict[str, dict[str, Any]]:
    lines = (run / "trajectories.jsonl").read_text().splitlines()
    return {t["id"]: t for t in map(json.loads, lines)}


def embedded(page: Path) -> dict[str, Any]:
    """The JSON a written page carries."""
    html = page.read_text()
    start = html.index('id="turnrl-data">') + len('id="turnrl-data">')
    return dict(json.loads(html[start : html.index("</script>", start)]))


# ---------------------------------------------------------------- the page, without a browser


def test_run_has_every_case(run_dir: Path) -> None:
    trajs = trajectories(run_dir)
    assert len(trajs) == 5
    assert trajs["calc-0/0"]["stop_reason"] == StopReason.NO_TOOL_CALL and trajs["calc-0/0"]["num_turns"] == 3
    assert trajs["story-1/0"]["metrics"]["check/ok"] is False and trajs["story-1/0"]["info"]["check"]["diff"]
    assert trajs["story-2/0"]["stop_reason"] == StopReason.MAX_TURNS


def test_page_is_self_contained_and_escaped(run_dir: Path, qwen3_tokenizer: Any, tmp_path: Path) -> None:
    page = write_viewer(run_dir, tmp_path / "v.html", tokenizer=qwen3_tokenizer)
    html = page.read_text()
    assert "http://" not in html and "https://" not in html and "<link" not in html
    assert html.count("</script>") == 2 and "</b>" not in html  # content cannot close the data block
    data = embedded(page)
    assert [t["id"] for t in data["trajectories"]] == list(trajectories(run_dir))
    assert data["run"]["model"] and data["summary"]["trajectories"] == 5
    calc = data["trajectories"][0]
    assert calc["prompt_messages"] == 2 and len(calc["turn_messages"]) == len(calc["turns"])
    assert data["tokens"][str(calc["response_ids"][0])] == qwen3_tokenizer.decode(calc["response_ids"][:1])
    assert write_viewer(run_dir) == run_dir / "view.html"
    assert embedded(run_dir / "view.html")["tokens"] is None


def test_script_json_and_message_spans() -> None:
    text = to_script_json({"a": "</script><!-- & \u2028", "b": float("nan")})
    assert "<" not in text and "&" not in text
    assert json.loads(text) == {"a": "</script><!-- & \u2028", "b": None}
    roles = ["user", "assistant", "tool", "tool", "assistant"]
    messages = [{"role": role} for role in roles]
    turns = [{"role": "assistant"}, {"role": "tool"}, {"role": "assistant"}]
    assert turn_messages(messages, turns) == [[1, 2], [2, 4], [4, 5]]
    assert turn_messages([{"role": "user"}], [{"role": "assistant"}]) == []


def test_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ViewerError, match="no run directory"):
        write_viewer(tmp_path / "missing")
    with pytest.raises(ViewerError, match=r"no trajectories\.jsonl"):
        write_viewer(tmp_path)
    path = tmp_path / "trajectories.jsonl"
    path.write_text("\n")
    with pytest.raises(ViewerError, match="holds no trajectories"):
        write_viewer(tmp_path)
    good = {"id": "a/0", "response_ids": [1], "loss_mask": [1], "turns": []}
    path.write_text(json.dumps(good) + "\n{oops\n")
    with pytest.raises(ViewerError, match=r"trajectories\.jsonl:2: not valid JSON") as err:
        write_viewer(tmp_path)
    assert "\n" not in str(err.value)
    path.write_text(json.dumps({"id": "a/0"}) + "\n")
    with pytest.raises(ViewerError, match=":1: not a trajectory"):
        write_viewer(tmp_path)
    path.write_text(json.dumps({**good, "loss_mask": []}) + "\n")
    with pytest.raises(ViewerError, match=":1: loss_mask and response_ids differ"):
        write_viewer(tmp_path)


def test_run_tokenizer_is_loaded_offline_or_none(run_dir: Path, tmp_path: Path) -> None:
    assert load_run_tokenizer(run_dir) is not None
    assert load_run_tokenizer(tmp_path) is None
    (tmp_path / "config.yaml").write_text("model: /no/such/model\n")
    assert load_run_tokenizer(tmp_path) is None


def test_server_answers_with_the_page(run_dir: Path) -> None:
    with make_server(run_dir) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}/"
            with urllib.request.urlopen(url, timeout=5) as response:
                assert response.status == 200 and b"turnrl-data" in response.read()
        finally:
            server.shutdown()
            thread.join(5)


# ---------------------------------------------------------------- real headless Chromium


def chromium_path() -> str | None:
    """The Chromium to drive: $TURNRL_CHROMIUM, else chromium on PATH."""
    for candidate in (os.environ.get("TURNRL_CHROMIUM"), "chromium", "chromium-browser"):
        found = shutil.which(candidate) if candidate else None
        if found:
            return found
    return None


def high_fd(fd: int) -> int:
    """``fd`` moved to 10 or above, so mapping pipes onto fds 3 and 4 cannot clobber them."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return moved


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (it reads fd 3, writes fd 4)."""

    def __init__(self, exe: str, profile: Path, width: int = 1400, height: int = 1000) -> None:
        to_browser, self._out = map(high_fd, os.pipe())
        self._in, from_browser = map(high_fd, os.pipe())
        wiring = f'exec "$0" "$@" 3<&{to_browser} 4>&{from_browser} {to_browser}<&- {from_browser}>&-'
        args = [*CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"]
        self.log = (profile.parent / "chromium.log").open("wb")
        self.proc = subprocess.Popen(
            ["bash", "-c", wiring, exe, *args],
            pass_fds=(to_browser, from_browser),
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
        )
        os.close(to_browser)
        os.close(from_browser)
        self._buffer = b""
        self._id = 0
        self.session: str | None = None
        try:
            self._attach(width, height)
        except BaseException:
            self.close()
            raise

    def _attach(self, width: int, height: int) -> None:
        """Open a page, talk to it from now on, and size its viewport."""
        target = self.call("Target.createTarget", url="about:blank", timeout=30)["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        size = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
        self.call("Emulation.setDeviceMetricsOverride", **size)

    def call(self, method: str, timeout: float = 15.0, **params: Any) -> dict[str, Any]:
        """Send one command (to the page once attached) and wait for its answer."""
        self._id += 1
        message: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if self.session:
            message["sessionId"] = self.session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._out, data) :]
        deadline = time.monotonic() + timeout
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))

    def _receive(self, deadline: float) -> dict[str, Any]:
        """The next message (answer or event) from the browser."""
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("chromium did not answer in time")
            if select.select([self._in], [], [], left)[0]:
                chunk = os.read(self._in, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed the DevTools pipe")
                self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return dict(json.loads(message))

    def js(self, expression: str) -> Any:
        """Evaluate JavaScript in the page; its JSON-able value."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"page error: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str) -> None:
        """Navigate and wait until the new page has drawn itself."""
        self.js("document.body && delete document.body.dataset.ready")
        self.call("Page.navigate", url=url)
        self.wait_for("document.body && document.body.dataset.ready === '1'")

    def wait_for(self, condition: str, timeout: float = 10.0) -> None:
        """Poll a JavaScript condition until it is true."""
        deadline = time.monotonic() + timeout
        while not self.js(f"!!({condition})"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"still false: {condition}")
            time.sleep(0.05)

    def click(self, selector: str) -> None:
        """A real mouse click in the middle of the first element matching ``selector``."""
        x, y = self.js(
            f"(() => {{ const el = document.querySelector({json.dumps(selector)});"
            " el.scrollIntoView({block: 'center'}); const r = el.getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def type(self, selector: str, text: str) -> None:
        """Click into a field and type ``text``."""
        self.click(selector)
        self.call("Input.insertText", text=text)

    def choose(self, selector: str, value: str) -> None:
        """Pick an option of a <select>, as a user's choice would (a change event)."""
        self.set_value(selector, value, "change")

    def clear(self, selector: str) -> None:
        """Empty a text field, as a user's delete would (an input event)."""
        self.set_value(selector, "", "input")

    def set_value(self, selector: str, value: str, event: str) -> None:
        """Set a form field's value and fire ``event`` on it."""
        self.js(
            f"(() => {{ const el = document.querySelector({json.dumps(selector)});"
            f" el.value = {json.dumps(value)};"
            f" el.dispatchEvent(new Event('{event}', {{bubbles: true}})); }})()"
        )

    def count(self, selector: str) -> int:
        """How many elements match ``selector``."""
        return int(self.js(f"document.querySelectorAll({json.dumps(selector)}).length"))

    def text(self, selector: str) -> str:
        """The visible text of the first element matching ``selector``."""
        return str(self.js(f"document.querySelector({json.dumps(selector)}).innerText"))

    def screenshot(self, path: Path, full_page: bool = False) -> Path:
        """Save a PNG of the viewport (or the whole page)."""
        shot = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=full_page)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def close(self) -> None:
        """Close the browser; kill it if it lingers."""
        self.session = None
        with contextlib.suppress(Exception):
            self.call("Browser.close", timeout=5)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        os.close(self._in)
        os.close(self._out)
        self.log.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chromium]:
    """One headless Chromium for the module; skipped when there is none, unless CI says it must be."""
    exe = chromium_path()
    if exe is None:
        missing("no chromium: bash scripts/install_browser.sh installs it")
    chromium = Chromium(exe, tmp_path_factory.mktemp("browser") / "profile")
    try:
        yield chromium
    finally:
        chromium.close()


def shot_path(tmp_path: Path, name: str) -> Path:
    """Where a screenshot goes: $TURNRL_SCREENSHOT_DIR when set (to look at it), else the test's tmp."""
    folder = Path(os.environ.get("TURNRL_SCREENSHOT_DIR") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def assert_looks_drawn(png: Path, width: int, height: int) -> None:
    """A real picture of the page: right size, many colors (heat map, badges), not a blank sheet."""
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    try:
        from PIL import Image
    except ImportError:
        assert png.stat().st_size > 20_000
        return
    with Image.open(png) as image:
        assert image.size == (width, height)
        colors = image.convert("RGB").getcolors(maxcolors=1 << 20) or []
    assert len(colors) > 200
    assert max(count for count, _ in colors) < 0.9 * width * height  # no single color covers the page
    saturated = [rgb for _, rgb in colors if isinstance(rgb, tuple) and max(rgb) - min(rgb) > 60]
    assert len(saturated) > 20  # the heat map and the badges


def test_viewer_in_chromium(run_dir: Path, qwen3_tokenizer: Any, browser: Chromium, tmp_path: Path) -> None:
    trajs = trajectories(run_dir)
    page = write_viewer(run_dir, tmp_path / "view.html", tokenizer=qwen3_tokenizer)
    browser.open(page.as_uri())
    assert browser.count(".traj-row") == 5 and browser.text("#count") == "5 of 5 trajectories"
    assert "trajectories5" in browser.text("#summary").replace(" ", "").replace("\n", "")
    # the first screen: reward, stop reasons, turns, errors; timings and the rest folded behind a click
    first = browser.text("#summary")
    assert "reward/mean" in first and "stop_reasons" in first and "time/" not in first
    assert browser.js("document.querySelector('#more-metrics').open") is False
    assert "more metrics" in browser.text("#more-metrics summary")
    assert "time/turn_seconds" in browser.js("document.querySelector('#more-metrics').textContent")
    # filters narrow the list, and widen it again
    browser.choose("#f-stop", "max_turns")
    assert browser.count(".traj-row") == 1 and browser.text("#count").startswith("1 of 5")
    browser.choose("#f-stop", "")
    browser.choose("#f-source", "story")
    assert browser.count(".traj-row") == 3
    browser.choose("#f-source", "")
    browser.type("#f-rmin", "0.5")
    assert browser.count(".traj-row") == sum(1 for t in trajs.values() if t["reward"] >= 0.5)
    browser.clear("#f-rmin")
    browser.type("#f-search", "391+4")
    assert browser.count(".traj-row") == 1
    browser.clear("#f-search")
    assert browser.count(".traj-row") == 5
    # clicking a trajectory shows its turns: tokens told apart by the loss mask, a heat map, tools
    calc = trajs["calc-0/0"]
    browser.click('.traj-row[data-id="calc-0/0"]')
    browser.wait_for("document.querySelector('#detail h2').textContent === 'calc-0/0'")
    assert browser.count("#detail .turn") == len(calc["turns"]) == 5
    assert browser.count("#detail .turn .tok-model") == sum(calc["loss_mask"])
    assert browser.count("#detail .turn .tok-env") == len(calc["loss_mask"]) - sum(calc["loss_mask"])
    colors = browser.js("[...document.querySelectorAll('.tok-model')].map((e) => e.style.backgroundColor)")
    assert len(set(colors)) > 5 and all(c.startswith("rgb") for c in colors)  # colored by logprob
    title = browser.js("document.querySelector('.tok-model').title")
    assert title.startswith(f"id {calc['response_ids'][0]} ") and "logprob" in title
    calls = browser.js("[...document.querySelectorAll('.call')].map((e) => e.innerText)")
    assert len(calls) == 2 and "calculator" in calls[0] and "17*23" in calls[0] and "391" in calls[0]
    assert browser.count(".tool-result") == 2 and not browser.count("#check.bad")
    # each model turn's step info (the tool's metrics) is there to open
    with_info = [turn for turn in calc["turns"] if turn["role"] == "assistant" and turn["info"]]
    assert browser.count("#detail .step-info") == len(with_info) == 2
    assert "num_tool_calls" in browser.js("document.querySelector('.step-info pre').textContent")
    browser.screenshot(shot_path(tmp_path, "viewer-tools.png"))
    # the image prompt is drawn inline, the check diff of a mismatching trajectory is shown
    browser.click('.traj-row[data-id="story-0/0"]')
    assert browser.count("#detail .prompt img") == 1 and "</b>" in browser.text("#detail .prompt")
    # the env's last answer came with done=True and was dropped: the page says so on that turn
    assert browser.count("#detail .final-dropped") == 1
    assert browser.text("#detail .final-dropped") == "final observation dropped"
    browser.click('.traj-row[data-id="story-1/0"]')
    assert browser.count("#check.bad .diff") == 1
    assert "Edited afterwards" in browser.text("#check .diff") and "text" in browser.text("#check")
    png = browser.screenshot(shot_path(tmp_path, "viewer-check.png"))
    assert_looks_drawn(png, 1400, 1000)


def test_viewer_without_tokenizer_in_chromium(run_dir: Path, browser: Chromium, tmp_path: Path) -> None:
    calc = trajectories(run_dir)["calc-0/0"]
    page = write_viewer(run_dir, tmp_path / "plain.html")
    browser.open(page.as_uri() + "#" + "calc-0%2F0")
    browser.wait_for("document.querySelector('#detail h2').textContent === 'calc-0/0'")
    assert browser.count(".tok") == 0
    assert browser.count("#detail .seg-model") == calc["num_turns"]
    assert browser.count("#detail .seg-env") == len(calc["turns"]) - calc["num_turns"]
    assert browser.count(".call") == 2
    browser.screenshot(shot_path(tmp_path, "viewer-plain.png"))
