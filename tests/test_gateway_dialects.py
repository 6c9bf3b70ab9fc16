"""The gateway's dialect seam: every API it speaks is one object registered in ``dialects.DIALECTS``,
its routes made from the registry; a dialect added there is served like the built-in ones, its
errors in its own schema; the Responses API's memory is its dialect's, one per gateway."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_fixtures import gateway_for, serving

from turnrl.engines.scripted import ScriptedEngine
from turnrl.gateway import dialects
from turnrl.gateway.call import ApiError, Incoming, Outgoing
from turnrl.gateway.routes import make_app
from turnrl.gateway.server import Gateway


class PlainText:
    """A dialect of its own: ``{"say": TEXT}`` in, ``{"heard": REPLY}`` out."""

    paths: tuple[str, ...] = ("/v1/plain",)
    counted: bool = True

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return {"plain_error": str(error), "status": error.status}

    async def serve(self, call: Incoming) -> Outgoing:
        from turnrl.gateway.call import ChatRequest

        if not isinstance(call.body, dict) or not isinstance(call.body.get("say"), str):
            raise ApiError(400, "say what? ('say' must be text)")
        asked = ChatRequest("", [{"role": "user", "content": call.body["say"]}], None, 16)
        done = await call.answer(call.session, asked)
        return {"heard": done.reply.message.get("content")}


def test_every_dialects_paths_are_served_at_the_root_and_under_a_session(
    qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    gateway = gateway_for(ScriptedEngine(qwen3_tokenizer, []), qwen3_tokenizer, tmp_path)
    served = {getattr(route, "path", "") for route in make_app(gateway).routes}
    paths = [path for dialect in dialects.dialects(gateway) for path in dialect.paths]
    assert {"/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"} <= set(
        paths
    )
    for path in paths:
        assert path in served and f"/s/{{session}}{path}" in served


def test_a_dialect_added_to_the_registry_is_served_and_recorded_like_the_others(
    qwen3_tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dialects, "DIALECTS", (*dialects.DIALECTS, lambda gateway: PlainText()))
    gateway = gateway_for(ScriptedEngine(qwen3_tokenizer, ["Hello there."]), qwen3_tokenizer, tmp_path)
    with serving(gateway) as url:
        heard = httpx.post(f"{url}/s/mine/v1/plain", json={"say": "hi"}, timeout=30)
        refused = httpx.post(f"{url}/v1/plain", json={"say": 3}, timeout=30)
        chat = httpx.post(
            f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}, timeout=30
        )
    assert heard.status_code == 200 and heard.json() == {"heard": "Hello there."}
    assert refused.status_code == 400 and refused.json()["plain_error"].startswith("say what?")
    assert chat.status_code != 404  # the built-in dialects are still there
    [branch] = gateway.sessions["mine"].branches
    assert branch.trajectory("mine").response_ids  # the call went through the session's record


def test_the_responses_memory_is_one_gateways(qwen3_tokenizer: Any, tmp_path: Path) -> None:
    def gateway() -> Gateway:
        return gateway_for(
            ScriptedEngine(qwen3_tokenizer, ["One.", "Two.", "Three."]), qwen3_tokenizer, tmp_path
        )

    first, second = gateway(), gateway()
    body = {"model": "tiny-qwen3", "input": "hi"}
    with serving(first) as one, serving(second) as other:
        answer = httpx.post(f"{one}/v1/responses", json=body, timeout=30).json()
        more = {**body, "previous_response_id": answer["id"]}
        again = httpx.post(f"{one}/v1/responses", json=more, timeout=30)
        elsewhere = httpx.post(f"{other}/v1/responses", json=more, timeout=30)
        under_session = httpx.post(f"{one}/s/{answer['id'][:8]}/v1/responses", json=more, timeout=30)
    assert again.status_code == 200
    assert under_session.status_code == 200  # one memory at the root and under /s/{session}
    assert elsewhere.status_code == 404 and "previous_response_id" in elsewhere.json()["error"]["message"]
