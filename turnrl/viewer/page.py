"""Build the trajectory viewer: one self-contained HTML page per run (or per gateway folder: every
session's branches), data embedded as JSON."""

from __future__ import annotations

import contextlib
import http.server
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnrl.gateway.store import CALLS, read_branches
from turnrl.record.codec import strict_json, trajectory_to_json
from turnrl.rollout.validate import training_files
from turnrl.viewer.assets import PAGE_CSS, PAGE_JS, PAGE_TEMPLATE

TRAJECTORIES = "trajectories.jsonl"
ROLLOUTS = "rollouts"  # a training run's saved rollouts, one step_NNNNNN.jsonl per step (train.save_rollouts)
SUMMARY = "summary.json"
CONFIG = "config.yaml"
VIEW = "view.html"
REQUIRED = ("id", "response_ids", "loss_mask", "turns")  # fields a line must have to be viewed
LOGPROB_DIGITS = 4  # logprobs are rounded to this many decimals in the page


class ViewerError(ValueError):
    """A run directory the viewer cannot show; the message is one line naming what is wrong."""


@dataclass
class Run:
    """What the viewer reads from a run directory."""

    path: Path  # the run directory
    trajectories: list[dict[str, Any]]  # one dict per line of trajectories.jsonl, in file order
    summary: dict[str, Any] | None  # summary.json, when present and readable
    config_text: str | None  # config.yaml as written, when present
    model: str | None  # the config's ``model``, when it has one


def read_run(run_dir: Path) -> Run:
    """Read trajectories, summary and config of a run; ``ViewerError`` when there is nothing to show."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ViewerError(f"no run directory at {run_dir}")
    path = run_dir / TRAJECTORIES
    if not path.is_file() and (run_dir / CALLS).is_file():  # a gateway's folder: its sessions' branches
        path = run_dir / CALLS
        trajectories = [{**trajectory_to_json(t), "line": k} for k, t in enumerate(read_branches(path), 1)]
    elif not path.is_file() and training_files(run_dir):  # a training run: saved rollouts, evaluations
        trajectories = [
            {**traj, "info": {**traj.get("info", {}), "split": split, "step": step}}
            for split, step, file in training_files(run_dir)
            for traj in _read_jsonl(file)
        ]
        path = run_dir
    elif not path.is_file():
        raise ViewerError(
            f"no {TRAJECTORIES} in {run_dir} (nor a gateway's {CALLS}, nor a training run's "
            f"{ROLLOUTS}/ or eval/)"
        )
    else:
        trajectories = list(_read_jsonl(path))
    if not trajectories:
        raise ViewerError(f"{path} holds no trajectories")
    config_text = _read_text(run_dir / CONFIG)
    return Run(run_dir, trajectories, _read_summary(run_dir / SUMMARY), config_text, _model_of(config_text))


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Each non-blank line as a trajectory dict, tagged with its line number. A last line without
    its newline that does not parse is a record cut short (a run being written, or killed): it is
    left out, as ``--resume`` drops it."""
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if not line.endswith("\n"):
                try:
                    json.loads(line)
                except json.JSONDecodeError:
                    return
            yield {**_parse_line(line, path, number), "line": number}


def _parse_line(line: str, path: Path, number: int) -> dict[str, Any]:
    """One line parsed and checked enough to be drawn."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ViewerError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ViewerError(f"{path}:{number}: expected a JSON object, got {type(data).__name__}")
    missing = [key for key in REQUIRED if key not in data]
    if missing:
        raise ViewerError(f"{path}:{number}: not a trajectory (missing {', '.join(missing)})")
    if len(data["loss_mask"]) != len(data["response_ids"]):
        raise ViewerError(f"{path}:{number}: loss_mask and response_ids differ in length")
    if not isinstance(data["turns"], list) or not all(isinstance(t, dict) for t in data["turns"]):
        raise ViewerError(f"{path}:{number}: turns is not a list of objects")
    return data


def _read_text(path: Path) -> str | None:
    """A file's text, or None when it is missing or unreadable."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _read_summary(path: Path) -> dict[str, Any] | None:
    """summary.json as a dict, or None when it is missing or not a JSON object."""
    text = _read_text(path)
    try:
        data = json.loads(text) if text else None
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def _model_of(config_text: str | None) -> str | None:
    """The ``model:`` of a run config, or None."""
    import yaml

    try:
        config = yaml.safe_load(config_text) if config_text else None
    except yaml.YAMLError:
        return None
    model = config.get("model") if isinstance(config, dict) else None
    return str(model) if model else None


def load_run_tokenizer(run_dir: Path) -> Any | None:
    """The tokenizer of the run's ``model`` (loaded offline), or None on any failure."""
    try:
        model = _model_of(_read_text(Path(run_dir) / CONFIG))
        if model is None:
            return None
        from turnrl.models import load_tokenizer

        return load_tokenizer(model)
    except Exception:
        return None


def token_texts(ids: Iterable[int], tokenizer: Any) -> dict[str, str]:
    """Each distinct id as its own text: the tokenizer's decoding, special tokens spelled out."""
    table: dict[str, str] = {}
    for token_id in ids:
        key = str(token_id)
        if key not in table:
            table[key] = _decode_one(tokenizer, int(token_id))
    return table


def _decode_one(tokenizer: Any, token_id: int) -> str:
    """One token's text; its vocabulary entry when decoding fails; ``<id>`` when both fail."""
    try:
        return str(tokenizer.decode([token_id], skip_special_tokens=False))
    except Exception:
        pass
    try:
        return str(tokenizer.convert_ids_to_tokens(token_id))
    except Exception:
        return f"<{token_id}>"


def turn_messages(messages: Sequence[dict[str, Any]], turns: Sequence[dict[str, Any]]) -> list[list[int]]:
    """``[start, end)`` into ``messages`` for each turn; the prompt is everything before the first.

    Walks back from the last message: a model turn owns one assistant message, an observation
    turn the non-assistant messages after it. Returns [] when the two do not line up.
    """
    spans: list[list[int]] = []
    end = len(messages)
    for turn in reversed(turns):
        start = end
        if turn.get("role") == "assistant":
            start -= 1
            if start < 0 or messages[start].get("role") != "assistant":
                return []
        else:
            while start > 0 and messages[start - 1].get("role") != "assistant":
                start -= 1
        spans.append([start, end])
        end = start
    return spans[::-1]


def view_model(run: Run, tokenizer: Any | None = None) -> dict[str, Any]:
    """The JSON the page is drawn from: run facts, summary, token texts and trajectories."""
    trajectories = [_prepare(t) for t in run.trajectories]
    tokens = None
    if tokenizer is not None:
        every_id = (i for t in trajectories for key in ("prompt_ids", "response_ids") for i in t.get(key, []))
        tokens = token_texts(every_id, tokenizer)
    return {
        "run": {"name": run.path.resolve().name, "path": str(run.path), "model": run.model},
        "config": run.config_text,
        "summary": run.summary,
        "tokens": tokens,
        "trajectories": trajectories,
    }


def _prepare(traj: dict[str, Any]) -> dict[str, Any]:
    """A trajectory with turn-to-message spans added and logprobs rounded."""
    out = dict(traj)
    if images := out.pop("images", None):  # a VLM run: image parts point into the images list
        out["messages"] = [_with_images(m, images) for m in out.get("messages") or []]
    spans = turn_messages(traj.get("messages") or [], traj["turns"])
    out["turn_messages"] = spans
    out["prompt_messages"] = spans[0][0] if spans else len(traj.get("messages") or [])
    out["rollout_logprobs"] = [_round(lp) for lp in traj.get("rollout_logprobs") or []]
    return out


def _with_images(message: dict[str, Any], images: Sequence[str]) -> dict[str, Any]:
    """A message whose ``{"type": "image", "image_index": k}`` parts carry image ``k`` (a data URL)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = [
        {"type": "image", "image": images[p["image_index"]]}
        if isinstance(p, dict)
        and isinstance(p.get("image_index"), int)
        and 0 <= p["image_index"] < len(images)
        else p
        for p in content
    ]
    return {**message, "content": parts}


def _round(value: Any) -> Any:
    """A float rounded for the page; non-numbers as they are."""
    return round(value, LOGPROB_DIGITS) if isinstance(value, float) and math.isfinite(value) else value


def to_script_json(data: Any) -> str:
    """JSON safe inside ``<script>``: no ``<``, ``>`` or ``&`` (so no ``</script>``), no NaN."""
    text = strict_json(data)  # NaN or infinity somewhere: the page shows them as null
    for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026")):
        text = text.replace(char, escape)
    return text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def render_html(data: dict[str, Any]) -> str:
    """The whole page: inline CSS, inline JS, data embedded as JSON."""
    title = f"turnrl · {data['run']['name']}".replace("&", "&amp;").replace("<", "&lt;")
    return (
        PAGE_TEMPLATE.replace("{{title}}", title)
        .replace("{{css}}", PAGE_CSS)
        .replace("{{js}}", PAGE_JS)
        .replace("{{data}}", to_script_json(data))
    )


def write_viewer(run_dir: Path, out: Path | None = None, tokenizer: Any | None = None) -> Path:
    """Write the run's viewer page (default ``RUN_DIR/view.html``) and return its path."""
    run = read_run(Path(run_dir))
    path = Path(out) if out is not None else run.path / VIEW
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(view_model(run, tokenizer)), encoding="utf-8")
    return path


def make_server(
    run_dir: Path, host: str = "127.0.0.1", port: int = 0, tokenizer: Any | None = None
) -> http.server.ThreadingHTTPServer:
    """An HTTP server (not yet serving) that answers ``/`` with the run's page, built once."""
    page = render_html(view_model(read_run(Path(run_dir)), tokenizer)).encode("utf-8")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found = self.path.split("?")[0] in ("/", "/" + VIEW)
            body = page if found else b"not found\n"
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "text/html; charset=utf-8" if found else "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    return http.server.ThreadingHTTPServer((host, port), Handler)


def serve(run_dir: Path, host: str = "127.0.0.1", port: int = 0, tokenizer: Any | None = None) -> None:
    """Serve the run's page at ``http://host:port/`` until interrupted (port 0: any free port)."""
    with make_server(run_dir, host, port, tokenizer) as server:
        bound_host, bound_port = server.server_address[:2]
        print(f"serving {run_dir} at http://{bound_host!s}:{bound_port}/ (Ctrl-C stops)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            server.serve_forever()
