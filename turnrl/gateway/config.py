"""The ``turnrl gateway`` config: the model and engine it serves, sampling it forces, where it writes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, model_validator

from turnrl.config import ChatConfig, EngineConfig, HFEngineConfig, Strict
from turnrl.types import SamplingParams


class GatewayConfig(Strict):
    """A ``turnrl gateway`` server: an OpenAI-compatible endpoint that records token-exact sessions."""

    model: str
    """HF id in the local cache, a local folder, or a shipped name (tiny-qwen3, smollm2-135m...)."""
    engine: EngineConfig = Field(default_factory=HFEngineConfig)
    """The engine that generates."""
    chat: ChatConfig = Field(default_factory=ChatConfig)
    """Chat template options."""
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    """Sampling forced on every call, whatever the client sends (a client's max_tokens may only
    lower ``max_tokens``)."""
    max_session_tokens: Annotated[int, Field(ge=16)] = 32768
    """A branch's tokens (prompt + replies + what the client added) never exceed this: a call that
    would is refused with the API's context-length error."""
    max_session_calls: Annotated[int, Field(ge=1)] | None = None
    """A session's calls: the next one is refused with an HTTP 400 that says so (None: no limit)."""
    seed: int = 0
    """Each call's seed derives from it, the session, the branch and the call."""
    output_dir: str = "runs/gateway"
    """Where ``calls.jsonl`` (every completed call, appended as it completes) is written."""
    host: str = "127.0.0.1"
    """The address the server listens on (loopback by default)."""
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    """The port (0: any free one, said at start)."""
    any_model: bool = True
    """Answer a call whatever model it names: an agent keeps the model name it has, unchanged.
    false: a call that names another model than ``model`` (or ``served_name``) gets a 404."""
    api_keys: list[str] = Field(default_factory=list)
    """Keys a call must carry (``Authorization: Bearer KEY`` or ``x-api-key``); a session belongs to
    the key that made it. Empty: any call is served (said at start). ``api_keys_file``: more, one a line."""
    api_keys_file: str | None = None
    """A file of keys, one a line (blank lines and ``#`` comments skipped), added to ``api_keys``."""
    tool_parser: str | None = None
    """The tool-call format replies are parsed in (hermes, llama3_json, ...); default: the chat
    template's own. Where the template renders no tools (SmolLM2's), a call with tools is refused
    (400) unless this is set: then the agent's own prompt is taken to teach the model this format,
    and its tools pass (counted in /metrics as tools the template did not render)."""
    served_name: str | None = None
    """The model name clients use (default: ``model``); ``/v1/models`` lists it."""

    @model_validator(mode="after")
    def _check_keys_file(self) -> GatewayConfig:
        self.all_keys()
        return self

    def all_keys(self) -> list[str]:
        """``api_keys`` and those of ``api_keys_file`` (read now: a changed file counts at start)."""
        keys = list(self.api_keys)
        if self.api_keys_file:
            try:
                lines = Path(self.api_keys_file).read_text(encoding="utf-8").splitlines()
            except OSError as exc:
                raise ValueError(f"api_keys_file {self.api_keys_file!r}: {exc.strerror or exc}") from None
            found = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
            if not found:
                raise ValueError(f"api_keys_file {self.api_keys_file!r} holds no key")
            keys += found
        return keys
