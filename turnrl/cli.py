"""The ``turnrl`` command: rollout, check-template."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console

USER_ERRORS: tuple[type[Exception], ...] = (ValueError, FileNotFoundError, ImportError, OSError)


def _rollout(args: argparse.Namespace, console: Console) -> int:
    from turnrl.config import load_config
    from turnrl.rollout.report import print_summary
    from turnrl.rollout.runner import SUMMARY, TRAJECTORIES, run

    config = load_config(args.config, args.set)
    summary = run(config, overwrite=args.overwrite, resume=args.resume, console=console)
    print_summary(summary, console)
    console.print(f"wrote {Path(config.output_dir) / TRAJECTORIES} and {SUMMARY}")
    return 0


def _train(args: argparse.Namespace, console: Console) -> int:
    from turnrl.train import load_train_config, train

    config = load_train_config(args.config, args.set)
    final = train(config, overwrite=args.overwrite, resume=args.resume, console=console)
    console.print(json.dumps(final, indent=2, default=str))
    console.print(f"wrote {config.output_dir} (metrics.jsonl, checkpoints)")
    return 0


def _check_template(args: argparse.Namespace, console: Console) -> int:
    from turnrl.chat.report import check_template

    tools = None
    if args.tools:
        from turnrl.tools.config import load_tools_config

        tools = [t.schema for t in load_tools_config(args.tools)]
    kwargs = json.loads(args.template_kwargs) if args.template_kwargs else {}
    report = check_template(args.model, tools=tools, template_kwargs=kwargs)
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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser."""
    parser = argparse.ArgumentParser(prog="turnrl", description="Exact-token multi-turn RL rollouts.")
    sub = parser.add_subparsers(dest="command", required=True)
    roll = sub.add_parser("rollout", help="run an env against a model and write trajectories.jsonl")
    roll.add_argument("config", help="YAML run config")
    roll.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    roll.add_argument("--overwrite", action="store_true", help="replace an existing trajectories.jsonl")
    roll.add_argument("--resume", action="store_true", help="skip (prompt, sample) pairs already on disk")
    roll.set_defaults(func=_rollout)
    tr = sub.add_parser("train", help="GRPO on multi-turn trajectories with the embedded engine")
    tr.add_argument("config", help="YAML train config")
    tr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    tr.add_argument("--overwrite", action="store_true", help="replace an existing run in output_dir")
    tr.add_argument("--resume", action="store_true", help="continue from the last checkpoint in output_dir")
    tr.set_defaults(func=_train)
    chk = sub.add_parser("check-template", help="is this model's chat template safe for delta encoding?")
    chk.add_argument("model", help="HF id, local folder, or a shipped name (tiny-qwen3, smollm2-135m)")
    chk.add_argument("--tools", help="tool config YAML to put in the system prompt")
    chk.add_argument("--template-kwargs", help="JSON, e.g. '{\"enable_thinking\": false}'")
    chk.set_defaults(func=_check_template)
    view = sub.add_parser("view", help="write a static HTML viewer of a run's trajectories")
    view.add_argument("run_dir", help="a folder with trajectories.jsonl (the output_dir of a rollout)")
    view.add_argument("--out", help="where to write the page (default RUN_DIR/view.html)")
    view.add_argument("--serve", action="store_true", help="serve the page on 127.0.0.1 instead")
    view.add_argument("--port", type=int, default=0, help="port for --serve (default: any free port)")
    view.set_defaults(func=_view)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point: one clear line on bad input, non-zero exit."""
    args = build_parser().parse_args(argv)
    console = Console(stderr=True)
    try:
        return int(args.func(args, console))
    except KeyboardInterrupt:
        console.print("interrupted; finished trajectories are on disk")
        return 130
    except USER_ERRORS as exc:
        if os.environ.get("TURNRL_DEBUG"):
            raise
        print(f"turnrl: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
