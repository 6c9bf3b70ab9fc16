"""The ``turnrl`` command: rollout, train, serve, check-template, view, config."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from rich.console import Console

from turnrl.rollout.failures import RunFailed
from turnrl.support import stopping
from turnrl.types import EngineError

USER_ERRORS: tuple[type[Exception], ...] = (ValueError, FileNotFoundError, ImportError, OSError, EngineError)
TRAIN_SECTIONS = ("algorithm", "optim", "train", "eval", "warm_start")
GATEWAY_ONLY = {  # top-level keys of a gateway config that no run config has
    *("host", "port", "any_model", "api_keys", "api_keys_file", "served_name"),
    *("max_session_tokens", "max_session_calls", "tool_parser", "learn"),
}


def _fresh(output_dir: str, holds_run: Callable[[Path], bool], console: Console) -> str:
    """The output folder of a new run, locked for this process: a folder that holds an earlier run,
    or that another live run writes, is left alone and the next free ``-2``, ``-3``... is used."""
    from turnrl.support.run_folder import claim_free, holder

    out = Path(output_dir)
    fresh = claim_free(out, holds_run)
    if fresh != out:
        why = (
            "holds an earlier run"
            if holds_run(out)
            else f"is being written by another run (PID {holder(out)})"
        )
        console.print(f"{out} {why}: writing to {fresh} (--resume continues it, --overwrite replaces it)")
    return str(fresh)


def _resume_hint(args: argparse.Namespace, output_dir: str, holds_run: Callable[[Path], bool]) -> None:
    """Remember the command that continues this run, said if it stops early with work on disk."""
    sets = [s for s in args.set if not s.startswith("output_dir=")] + [f"output_dir={output_dir}"]
    words = ["turnrl", args.command, args.config, *(w for s in sets for w in ("--set", s)), "--resume"]
    args.resume_hint = lambda: shlex.join(words) if holds_run(Path(output_dir)) else None


def _demo_model_for(model: str, console: Console) -> None:
    """Build the demo model once, before the first run that names it."""
    from turnrl.models import SMOLLM2_PLAY

    if model != SMOLLM2_PLAY:
        return
    from turnrl.app.demo_model import build_demo_model, is_built

    if not is_built():
        console.print(f"building {SMOLLM2_PLAY} once (a supervised warm start, a few minutes)")
        build_demo_model(console.print)


def _demo_model(args: argparse.Namespace, console: Console) -> int:
    from turnrl.app.demo_model import build_demo_model, is_built
    from turnrl.models import SMOLLM2_PLAY

    if is_built():
        console.print(f"{SMOLLM2_PLAY} is built")
    path = build_demo_model(console.print)
    console.print(f"{SMOLLM2_PLAY}: {path}")
    return 0


def _rollout(args: argparse.Namespace, console: Console) -> int:
    from turnrl.app.output import ROLLOUT, holds_run
    from turnrl.app.run import SUMMARY, TRAJECTORIES, run
    from turnrl.config import load_config
    from turnrl.rollout.report import print_summary

    config = load_config(args.config, args.set)
    _demo_model_for(config.model, console)
    if not (args.resume or args.overwrite):
        out = _fresh(config.output_dir, functools.partial(holds_run, kind=ROLLOUT), console)
        config = config.model_copy(update={"output_dir": out})
    _resume_hint(args, config.output_dir, functools.partial(holds_run, kind=ROLLOUT))
    summary = run(config, overwrite=args.overwrite, resume=args.resume, console=console)
    print_summary(summary, console)
    console.print(f"wrote {Path(config.output_dir) / TRAJECTORIES} and {SUMMARY}")
    return 0


def _train(args: argparse.Namespace, console: Console) -> int:
    from turnrl.app.output import TRAINING, holds_run
    from turnrl.app.training import train
    from turnrl.train import load_train_config
    from turnrl.train.data_parallel import launched_rank, launched_ranks

    config = load_train_config(args.config, args.set)
    _demo_model_for(config.model, console)
    if not (args.resume or args.overwrite or launched_ranks() > 1):  # ranks must agree on the folder
        holds = functools.partial(holds_run, kind=TRAINING)
        config = config.model_copy(update={"output_dir": _fresh(config.output_dir, holds, console)})
    _resume_hint(args, config.output_dir, functools.partial(holds_run, kind=TRAINING))
    train(config, overwrite=args.overwrite, resume=args.resume, console=console)
    if launched_rank() == 0:  # rank 0 reports for all
        console.print(f"wrote {config.output_dir} (metrics.jsonl, rewards.png, checkpoints)")
    return 0


def _gateway(args: argparse.Namespace, console: Console) -> int:
    from turnrl.app.gateway import load_gateway_config, serve
    from turnrl.app.output import GATEWAY, holds_run

    config = load_gateway_config(args.config, args.set)
    _demo_model_for(config.model, console)
    if not args.overwrite and not args.resume:
        out = _fresh(config.output_dir, functools.partial(holds_run, kind=GATEWAY), console)
        config = config.model_copy(update={"output_dir": out})
    asyncio.run(serve(config, overwrite=args.overwrite, console=console, resume=args.resume))
    return 0


def _eval(args: argparse.Namespace, console: Console) -> int:
    from turnrl.app.eval_run import EVAL_FILE, evaluate
    from turnrl.train import load_train_config

    config = load_train_config(args.config, args.set, purpose="eval")
    _demo_model_for(config.model, console)
    out = evaluate(config, args.checkpoint, args.out, console, per_prompt=args.per_prompt)
    console.print(f"wrote {out / EVAL_FILE} and {Path(EVAL_FILE).with_suffix('.json').name}")
    return 0


def _serve(args: argparse.Namespace, console: Console) -> int:
    from turnrl.app.serve import main as serve_main

    return serve_main(args.serve_args)


def _check_template(args: argparse.Namespace, console: Console) -> int:
    from turnrl.chat.report import check_template
    from turnrl.models import load_tokenizer

    tools = None
    if args.tools:
        from turnrl.tools.config import load_tools_config

        tools = [t.schema for t in load_tools_config(args.tools)]
    kwargs = json.loads(args.template_kwargs) if args.template_kwargs else {}
    report = check_template(load_tokenizer(args.model), tools=tools, template_kwargs=kwargs, name=args.model)
    print(report.text())
    return 0 if report.safe else 1


def _view(args: argparse.Namespace, console: Console) -> int:
    from turnrl.viewer import load_run_tokenizer, serve, write_viewer

    run_dir = Path(args.run_dir)
    tokenizer = load_run_tokenizer(run_dir)
    if args.serve:
        serve(run_dir, port=args.port, tokenizer=tokenizer)
        return 0
    out = write_viewer(run_dir, Path(args.out) if args.out else None, tokenizer)
    console.print(f"wrote {out} (open it in a browser; it needs no network)")
    return 0


def _validate(args: argparse.Namespace, console: Console) -> int:
    from turnrl.rollout.validate import Invalid, validate_run

    try:
        count = validate_run(Path(args.run_dir))
    except Invalid as exc:
        console.print(f"invalid: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 1
    console.print(f"{count} trajectories, all valid (schema as in docs/trajectories.md)")
    return 0


def _check_tasks(args: argparse.Namespace, console: Console) -> int:
    from turnrl.tasks import TaskError, check_tasks, load_tasks
    from turnrl.tasks.check import check_record, describe_check
    from turnrl.tasks.dockerfile import NEEDS_CONTAINER

    podman = shlex.split(args.podman) if args.podman else None
    try:
        tasks = load_tasks(args.dir, container=podman is not None)
    except TaskError as exc:
        if podman is None and NEEDS_CONTAINER in str(exc) and "compose" not in str(exc):
            raise TaskError(f"{exc}; turnrl check-tasks --podman checks it in containers") from None
        raise
    console.print(
        f"checking {len(tasks)} tasks under {args.dir}: each one's tests untouched, then after its solution"
    )
    checks = []
    out = Path(args.out) if args.out else None
    keep = Path(args.keep) if args.keep else None
    for check in check_tasks(tasks, keep=keep, podman=podman, image=args.image):
        checks.append(check)
        console.print(describe_check(check), markup=False, highlight=False, soft_wrap=True)
        if out is not None:
            with out.open("a" if len(checks) > 1 else "w", encoding="utf-8") as f:
                f.write(json.dumps(check_record(check)) + "\n")
    dropped = [c.task for c in checks if not c.ok]
    seconds = sum(c.seconds for c in checks)
    summary = (
        f"{len(checks)} tasks: {len(checks) - len(dropped)} to keep, {len(dropped)} to drop ({seconds:.1f} s)"
    )
    console.print(summary + (f": {', '.join(dropped)}" if dropped else ""), markup=False, highlight=False)
    return 1 if dropped else 0


def _config(args: argparse.Namespace, console: Console) -> int:
    import yaml
    from pydantic import BaseModel

    from turnrl.app.config_docs import field_docs, render
    from turnrl.app.learning import LearningGatewayConfig
    from turnrl.config import RunConfig, dump_config, load_model_config, read_yaml_mapping
    from turnrl.gateway.config import GatewayConfig
    from turnrl.train.config import TrainConfig

    kinds: dict[str, type[BaseModel]] = {"rollout": RunConfig, "train": TrainConfig, "gateway": GatewayConfig}
    name = args.kind or "rollout"
    if args.config and args.kind is None:
        keys = set(read_yaml_mapping(args.config))
        if keys & set(TRAIN_SECTIONS):
            name = "train"
        elif "env" not in keys and keys & GATEWAY_ONLY:  # a `turnrl gateway` config has no env
            name = "gateway"
        if name == "gateway" and "learn" in keys:
            kinds["gateway"] = LearningGatewayConfig
    kind = kinds[name]
    if args.config:
        resolved = load_model_config(args.config, kind, args.set)
        print(f"# {args.config} as `turnrl {name}` reads it")
        print(yaml.safe_dump(dump_config(resolved), sort_keys=False).rstrip())
        if args.schema:
            print()
    if args.schema or not args.config:
        print(f"# every key of a `turnrl {name}` config")
        print(render(field_docs(kind)))
    return 0


def _add_check_tasks(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``check-tasks`` command's arguments."""
    tasks = sub.add_parser(
        "check-tasks",
        help="run each task's solution in the sandbox: its tests must fail without it, pass with it",
    )
    tasks.add_argument("dir", help="a task folder (Harbor or SWE-style), or a folder of them")
    tasks.add_argument("--keep", help="keep each check's folders under this folder (default: removed)")
    tasks.add_argument("--out", help="also write one JSON line per task here (with the tests' output)")
    tasks.add_argument(
        "--podman",
        metavar="COMMAND",
        help="check in podman containers of each task's image (its whole Dockerfile built), run by"
        " COMMAND: 'podman', or with podman's options ('podman --runtime /path/to/runc')",
    )
    tasks.add_argument("--image", help="with --podman: the image of tasks that name none (SWE-style ones)")
    tasks.set_defaults(func=_check_tasks)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser."""
    parser = argparse.ArgumentParser(prog="turnrl", description="Exact-token multi-turn RL rollouts.")
    sub = parser.add_subparsers(dest="command", required=True)
    roll = sub.add_parser("rollout", help="run an env against a model and write trajectories.jsonl")
    roll.add_argument("config", help="YAML run config")
    roll.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    roll.add_argument("--overwrite", action="store_true", help="replace the run in output_dir")
    roll.add_argument("--resume", action="store_true", help="skip (prompt, sample) pairs already on disk")
    roll.set_defaults(func=_rollout)
    tr = sub.add_parser("train", help="GRPO on multi-turn trajectories with the embedded engine")
    tr.add_argument("config", help="YAML train config")
    tr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    tr.add_argument("--overwrite", action="store_true", help="replace the run in output_dir")
    tr.add_argument("--resume", action="store_true", help="continue from the last checkpoint in output_dir")
    tr.set_defaults(func=_train)
    ev = sub.add_parser("eval", help="mean reward and pass@k on a train config's held-out set (eval.data)")
    ev.add_argument("config", help="YAML train config")
    ev.add_argument("--checkpoint", help="a checkpoint of the run (checkpoints/step_N) or a model folder")
    ev.add_argument("--out", help="where to write eval.jsonl and eval.json (default CHECKPOINT/eval)")
    ev.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    ev.add_argument(
        "--per-prompt", action="store_true", help="also a row per prompt: pass@k per task of a task set"
    )
    ev.set_defaults(func=_eval)
    gw = sub.add_parser("gateway", help="serve a model on the OpenAI API and record token-exact sessions")
    gw.add_argument("config", help="YAML gateway config (model, engine, sampling, output_dir, port)")
    gw.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    gw.add_argument("--overwrite", action="store_true", help="replace the calls in output_dir")
    gw.add_argument("--resume", action="store_true", help="go on in output_dir, from its checkpoint")
    gw.set_defaults(func=_gateway)
    srv = sub.add_parser("serve", help="start this node's engines on Ray and register them", add_help=False)
    srv.add_argument("serve_args", nargs=argparse.REMAINDER, help="see `turnrl serve --help`")
    srv.set_defaults(func=_serve)
    chk = sub.add_parser("check-template", help="is this model's chat template safe for delta encoding?")
    chk.add_argument("model", help="HF id, local folder, or a shipped name (tiny-qwen3, smollm2-135m)")
    chk.add_argument("--tools", help="tool config YAML to put in the system prompt")
    chk.add_argument("--template-kwargs", help="JSON, e.g. '{\"enable_thinking\": false}'")
    chk.set_defaults(func=_check_template)
    view = sub.add_parser("view", help="write a static HTML viewer of a run's trajectories")
    view.add_argument(
        "run_dir",
        help="a folder with trajectories.jsonl (a rollout's output_dir) or calls.jsonl (a gateway's)",
    )
    view.add_argument("--out", help="where to write the page (default RUN_DIR/view.html)")
    view.add_argument("--serve", action="store_true", help="serve the page on 127.0.0.1 instead")
    view.add_argument("--port", type=int, default=0, help="port for --serve (default: any free port)")
    view.set_defaults(func=_view)
    check = sub.add_parser("validate", help="check a run's trajectories against the documented record")
    check.add_argument(
        "run_dir",
        help="a run's folder (trajectories.jsonl, or a training run's rollouts/ and eval/) or a file",
    )
    check.set_defaults(func=_validate)
    _add_check_tasks(sub)
    demo = sub.add_parser("demo-model", help="build smollm2-135m-play: SmolLM2 warm-started (offline)")
    demo.set_defaults(func=_demo_model)
    cfg = sub.add_parser(
        "config", help="show a resolved config, and every key with its type, default and doc"
    )
    cfg_sub = cfg.add_subparsers(dest="action", required=True)
    show = cfg_sub.add_parser(
        "show", help="the config as it is read (defaults filled in); no CONFIG: the schema"
    )
    show.add_argument("config", nargs="?", help="YAML config (rollout, train or gateway)")
    show.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    show.add_argument(
        "--kind", choices=["rollout", "train", "gateway"], help="read it as this (default: guessed)"
    )
    show.add_argument("--schema", action="store_true", help="also list every key with its doc")
    show.set_defaults(func=_config)
    return parser


def _hint(args: argparse.Namespace) -> str | None:
    hint = getattr(args, "resume_hint", None)
    return hint() if hint is not None else None


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (a scheduler, `kill`) stops a run as Ctrl-C does: in-flight work is cancelled, servers
    and env workers are stopped, what finished stays on disk. It calls the SIGINT handler in place
    (asyncio's, which cancels the running command) rather than raising SIGINT, which a process
    started in the background of a script ignores."""
    stopping.handled()
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:  # SIGINT ignored (or left to the OS): stop all the same
        raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Entry point: one clear line on bad input, non-zero exit."""
    words = sys.argv[1:] if argv is None else list(argv)
    if words[:1] == ["serve"]:  # its own options, --help included
        from turnrl.app.serve import main as serve_main

        return serve_main(words[1:])
    args = build_parser().parse_args(words)
    console = Console(stderr=True)
    signal.signal(signal.SIGTERM, _on_sigterm)
    stopping.enforce(lambda: _hint(args))  # a stop that does not finish is forced
    try:
        return int(args.func(args, console))
    except RunFailed as exc:
        print(f"turnrl: error: {exc}", file=sys.stderr)
        hint = _hint(args)
        if hint:
            print(f"turnrl: what finished is on disk; once fixed, continue with: {hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        hint = _hint(args)
        console.print("interrupted; what finished is on disk" + (f"; continue with: {hint}" if hint else ""))
        return 130
    except USER_ERRORS as exc:
        if os.environ.get("TURNRL_DEBUG"):
            raise
        print(f"turnrl: error: {exc}", file=sys.stderr)
        hint = _hint(args)
        if hint and isinstance(exc, OSError):
            print(f"turnrl: what finished is on disk; once fixed, continue with: {hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
