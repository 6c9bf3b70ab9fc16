"""What the gateway refuses before it works: calls without the right key (a 401 in the API's schema,
counted), bodies past the limit however they are sent, malformed fields and nesting (400, never
500); and what ``turnrl gateway --overwrite`` does with the calls it replaced."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_fixtures import TOOLS, gateway_for, serving

from turnrl.app.gateway import _settle_replaced
from turnrl.engines.scripted import ScriptedEngine
from turnrl.gateway.routes import MAX_BODY_BYTES
from turnrl.harness.process import check_command

CHAT = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_a_gateway_with_keys_answers_a_missing_or_wrong_key_with_a_401(
    qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("# team keys\nkey-b\n")
    engine = ScriptedEngine(qwen3_tokenizer, ["Hi."] * 4)
    gateway = gateway_for(engine, qwen3_tokenizer, tmp_path, api_keys=["key-a"], api_keys_file=str(keys))
    with serving(gateway) as url:
        chat = f"{url}/s/mine/v1/chat/completions"
        assert httpx.post(chat, json=CHAT).status_code == 401
        wrong = httpx.post(chat, json=CHAT, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(chat, json=CHAT, headers={"Authorization": "Bearer key-a"}).status_code == 200
        taken = httpx.post(chat, json=CHAT, headers={"Authorization": "Bearer key-b"})  # a's session
        assert taken.status_code == 401 and "belongs to another API key" in taken.json()["error"]["message"]
        anthropic = {"model": "tiny-qwen3", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        refused = httpx.post(f"{url}/v1/messages", json=anthropic, headers={"x-api-key": "nope"})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        ok = httpx.post(f"{url}/v1/messages", json=anthropic, headers={"x-api-key": "key-b"})  # from the file
        assert ok.status_code == 200
        metrics = httpx.get(f"{url}/metrics").text
    assert "turnrl_gateway_unauthorized_total 4" in metrics
    assert sorted(gateway.sessions) == ["key-b", "mine"]  # nothing recorded for refused calls
    assert gateway.sessions["mine"].calls == 1


def test_an_empty_keys_file_is_one_line(tmp_path: Path) -> None:
    from turnrl.gateway.config import GatewayConfig

    (tmp_path / "keys.txt").write_text("# none yet\n")
    with pytest.raises(ValueError, match="holds no key"):
        GatewayConfig(model="tiny-qwen3", api_keys_file=str(tmp_path / "keys.txt"))


def test_a_chunked_body_past_the_limit_is_refused_as_it_arrives(qwen3_tokenizer: Any, tmp_path: Path) -> None:
    """A body with no Content-Length, 8x the limit: the gateway stops keeping it at the limit (this
    process's peak memory grows by less than the body), answers 413 and goes on."""
    gateway = gateway_for(ScriptedEngine(qwen3_tokenizer, ["Hi."]), qwen3_tokenizer, tmp_path)
    size = 8 * MAX_BODY_BYTES
    piece = b" " * (1 << 20)

    def chunks() -> Iterator[bytes]:
        for _ in range(size // len(piece)):
            yield piece

    with serving(gateway) as url:
        Path("/proc/self/clear_refs").write_text("5")  # the peak resident size starts again from here
        before = _peak_mb()
        try:
            answer = httpx.post(f"{url}/v1/chat/completions", content=chunks(), timeout=60)
            assert answer.status_code == 413
        except httpx.TransportError:  # the server answered and closed while the client still sent
            pass
        grown = _peak_mb() - before
        assert grown < size / 2**20 / 2, grown  # 256 MiB sent; well under half of it ever held
        assert httpx.post(f"{url}/v1/chat/completions", json=CHAT).status_code == 200  # and goes on


def _peak_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) / 1024


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({**CHAT, "stop": 5}, "stop must be a string or a list of strings"),
        ({**CHAT, "stop": ["ok", 5]}, "stop must be a string or a list of strings"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
)
def test_malformed_fields_and_nesting_are_400s(
    qwen3_tokenizer: Any, tmp_path: Path, body: Any, said: str
) -> None:
    gateway = gateway_for(ScriptedEngine(qwen3_tokenizer, ["Hi."]), qwen3_tokenizer, tmp_path)
    with serving(gateway) as url:
        if isinstance(body, str):
            answer = httpx.post(f"{url}/v1/chat/completions", content=body.encode())
        else:
            answer = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert answer.status_code == 400 and said in answer.json()["error"]["message"]


def test_overwritten_calls_go_once_the_new_gateway_served_and_come_back_if_it_did_not(tmp_path: Path) -> None:
    from rich.console import Console

    from turnrl.support.run_folder import set_aside

    said = io.StringIO()
    console = Console(file=said)
    for served in (True, False):
        out = tmp_path / f"served-{served}"
        out.mkdir()
        (out / "calls.jsonl").write_text("old\n")
        assert set_aside(out, ["calls.jsonl"])  # what --overwrite does at start
        if served:
            (out / "calls.jsonl").write_text("new\n")
        _settle_replaced(out, served, console)
        assert not (out / ".replaced").exists()
        assert (out / "calls.jsonl").read_text() == ("new\n" if served else "old\n")
    assert "recorded no call, so the calls it replaced are put back" in said.getvalue()


def test_a_python_callable_agent_whose_module_is_missing_is_found_before_the_model_loads() -> None:
    problem = check_command("no_such_agent_module:main")
    assert problem is not None and problem.startswith("env.command: no module named 'no_such_agent_module'")
    assert check_command("json:dumps") is None


def test_tools_the_template_cannot_render_are_refused_or_passed_by_tool_parser_never_dropped(
    qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    """A template that renders no tools (SmolLM2's own) drops them: a call with
    tools gets a 400 that names the fix; with ``tool_parser`` set the agent's prompt is taken to
    teach the format, the call is answered and its textual calls come back as tool calls; both
    counted in /metrics. Qwen3's template renders them."""
    import copy

    from openai import BadRequestError, OpenAI

    from turnrl.chat.encoder import ChatEncoder
    from turnrl.models import resolve_model

    smollm2_tokenizer = copy.deepcopy(qwen3_tokenizer)  # Qwen3's tokens, SmolLM2's shipped template
    smollm2_tokenizer.chat_template = resolve_model("smollm2-135m").chat_template
    assert not ChatEncoder(smollm2_tokenizer).renders_tools and ChatEncoder(qwen3_tokenizer).renders_tools
    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "alpha"}}\n</tool_call>'
    asked = [{"role": "user", "content": "What is alpha?"}]
    for parser in (None, "hermes"):
        out = tmp_path / str(parser)
        gateway = gateway_for(
            ScriptedEngine(smollm2_tokenizer, [call]), smollm2_tokenizer, out, tool_parser=parser
        )
        with serving(gateway) as url:
            client = OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
            if parser is None:
                with pytest.raises(BadRequestError, match=r"renders no tools.*set the gateway's tool_parser"):
                    client.chat.completions.create(model="m", messages=asked, tools=TOOLS)  # type: ignore[arg-type]
            else:
                reply = client.chat.completions.create(model="m", messages=asked, tools=TOOLS)  # type: ignore[arg-type]
                assert reply.choices[0].message.tool_calls[0].function.name == "lookup"  # type: ignore[index]
            metrics = httpx.get(f"{url}/metrics").text
        if parser is None:
            assert 'turnrl_gateway_dropped_tools_total{type="unrendered"} 1' in metrics
        else:
            assert "turnrl_gateway_unrendered_tools_total 1" in metrics
