"""Warm-ups for ``env.preload`` ("module:function" entries are called once in the fork server, after
its imports): what a client does lazily on its first use, done once instead of once per run."""

from __future__ import annotations

import importlib
import os
from typing import Any


def openai() -> None:
    """Make and drop an openai SDK client: its HTTP stack and chat resources import on first use
    (~55 ms of each run's CPU otherwise); and share one SSL context among the run's clients
    (``ssl_context``)."""
    import openai as sdk

    ssl_context()
    client = sdk.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="warm-up", max_retries=0)
    _ = client.chat.completions, client.responses
    client.close()


def anthropic() -> None:
    """Make and drop an anthropic SDK client (its messages resource imports on first use); and
    share one SSL context among the run's clients (``ssl_context``)."""
    import anthropic as sdk

    ssl_context()
    client = sdk.Anthropic(base_url="http://127.0.0.1:9", api_key="warm-up", max_retries=0)
    _ = client.messages
    client.close()


def _cert_variables() -> tuple[str | None, str | None]:
    return os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")


def ssl_context() -> None:
    """httpx and httpx2 (under the openai and anthropic SDKs) build an SSL context for every client
    they make, parsing the whole CA bundle (~45 ms of CPU), even for the gateway's plain-HTTP URL.
    Build the default one here, once per package: a run's clients made with the default
    verification get it while the run's ``SSL_CERT_FILE`` and ``SSL_CERT_DIR`` are what they were
    here; any other verification, client certificate or CA variable builds its own context as
    before. Nothing happens for a package that is not installed or builds its contexts elsewhere."""
    for package in ("httpx", "httpx2"):
        try:
            default = importlib.import_module(f"{package}._transports.default")
        except ImportError:
            continue
        _share(default)


def _share(default: Any) -> None:
    """Make ``default.create_ssl_context`` hand out one context for the default verification."""
    make = getattr(default, "create_ssl_context", None)
    if make is None or getattr(make, "shared", False):
        return
    built_for = _cert_variables()
    shared = make()

    def create(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        variables = _cert_variables() if trust_env else (None, None)
        if verify is True and cert is None and variables == built_for:
            return shared
        return make(verify=verify, cert=cert, trust_env=trust_env)

    create.shared = True  # type: ignore[attr-defined]
    default.create_ssl_context = create
