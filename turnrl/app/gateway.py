"""``turnrl gateway CONFIG``: the gateway wired from its config and served over HTTP.

The engine is built as for a rollout (embedded, vLLM, servers by URL, Ray); the chat encoder and the
tool-call parser follow the model's chat template; every completed call is appended to
``OUT/calls.jsonl`` (the output folder is locked, like a run's).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from turnrl.app.engines import build_engine
from turnrl.app.learning import LEARN_DIR, Learning, LearningGatewayConfig
from turnrl.app.output import GATEWAY, open_output, start_output
from turnrl.app.parts import build_encoder, template_parser
from turnrl.app.run import SERVERS
from turnrl.config import load_model_config, read_yaml_mapping
from turnrl.gateway.config import GatewayConfig
from turnrl.gateway.rewards import RewardDesk
from turnrl.gateway.routes import make_app
from turnrl.gateway.server import Gateway
from turnrl.gateway.serving import GatewayServer
from turnrl.gateway.serving import serve as serve_gateway
from turnrl.gateway.store import CallLog
from turnrl.support.run_folder import drop_aside, put_back, release


def load_gateway_config(path: str | Path, overrides: list[str] | None = None) -> GatewayConfig:
    """Read a gateway config, apply ``--set`` overrides, validate (one with a ``learn`` section: a
    learning gateway's)."""
    learns = "learn" in read_yaml_mapping(path) or any(o.startswith("learn.") for o in overrides or ())
    return load_model_config(path, LearningGatewayConfig if learns else GatewayConfig, overrides)


def build_gateway(config: GatewayConfig, console: Console) -> Gateway:
    """The engine, encoder, parser and call log of ``config`` (the output folder already checked)."""
    out = Path(config.output_dir)
    with console.status(f"loading {config.model}") as status:
        engine, tokenizer = build_engine(config, out / SERVERS, say=status.update)
    encoder = build_encoder(config.model, config.chat, tokenizer)
    return Gateway(engine, encoder, template_parser(tokenizer, config.tool_parser), config, CallLog(out))


async def serve(
    config: GatewayConfig,
    overwrite: bool = False,
    console: Console | None = None,
    ready: Callable[[str], None] | None = None,
    resume: bool = False,
) -> None:
    """Serve until stopped (Ctrl-C, SIGTERM); ``ready`` gets the base URL once it listens. A learning
    gateway (``learn``) also takes rewards and trains in the background; ``resume``: on the folder
    of an earlier one, from its checkpoint and the rewards it had not trained on."""
    console = console or Console(stderr=True)
    out = Path(config.output_dir)
    open_output(out, GATEWAY, config, overwrite, resume=resume)
    try:
        start_output(out, GATEWAY, config, resume=resume)
        gateway = build_gateway(config, console)
        served: GatewayServer | None = None
        learning: Learning | None = None
        learner: asyncio.Task[None] | None = None
        try:
            app = None
            if isinstance(config, LearningGatewayConfig):
                desk = RewardDesk(gateway, out / LEARN_DIR, config.learn.expire_s)
                learning = Learning(config, gateway, desk, console, resume)
                await learning.start()
                app = make_app(gateway, desk, [learning.metrics])
            # a learning gateway stops itself on Ctrl-C or SIGTERM, so that an update under way ends
            # before the process does (uvicorn would re-raise the signal once it stopped serving)
            served = await serve_gateway(gateway, config.host, config.port, signals=learning is None, app=app)
            if learning is not None:
                learner = asyncio.create_task(learning.run())
                _stop_on_signals(served)
                console.print(f"learning from rewards posted to {served.url}/v1/rewards")
            url = served.url
            console.print(f"serving {gateway.model} at {url}/v1 (a session per API key, or {url}/s/NAME/v1)")
            console.print(f"writing {out / 'calls.jsonl'}")
            if gateway.keys is None:
                console.print(
                    f"[yellow]serving without API keys: anyone who reaches {url} can call any session"
                    " (set api_keys or api_keys_file)[/yellow]"
                )
            if ready is not None:
                ready(url)
            await served.task
        finally:
            if learning is not None:
                await learning.stop(learner)
                learning.desk.close()
            if served is not None:
                await served.close()
            if gateway.log is not None:
                gateway.log.close()
            await gateway.engine.close()
            _settle_replaced(out, gateway.counts["calls"] > 0, console)
    finally:
        release(out)


def _stop_on_signals(served: GatewayServer) -> None:
    """Ctrl-C and SIGTERM end serving (and the ``serve`` that awaits it) in this loop."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread, or Windows
            loop.add_signal_handler(sig, lambda: setattr(served.server, "should_exit", True))


def _settle_replaced(out: Path, served: bool, console: Console) -> None:
    """The calls an --overwrite set aside: gone once this gateway recorded a call of its own, else
    put back (a gateway that answered nothing replaced nothing)."""
    if served:
        drop_aside(out)
    elif put_back(out, GATEWAY.outputs):
        console.print(f"{out}: this gateway recorded no call, so the calls it replaced are put back")
