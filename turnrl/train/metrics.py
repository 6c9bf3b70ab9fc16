"""Training metrics: per-step numbers from trajectories, metrics.jsonl, a console line, trackers, a plot."""

from __future__ import annotations

import importlib.util
import json
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console

from turnrl.record.codec import json_line
from turnrl.rollout.metrics import run_metrics
from turnrl.support.cpus import usable_cores
from turnrl.types import Trajectory

METRICS = "metrics.jsonl"


def rollout_metrics(trajs: Sequence[Trajectory], prefix: str = "") -> dict[str, float]:
    """Reward (per run), turns, stop reasons, tools, env retries, model tokens, truncation and time sums."""
    if not trajs:
        return {}
    count = len(trajs)
    stops = Counter(t.stop_reason.value for t in trajs)
    out: dict[str, float] = {
        **run_metrics(trajs),  # per run, as a user counts (an agent run leaves one per branch)
        "turns/mean": statistics.fmean(t.num_turns for t in trajs),
        "tools/calls": sum(int(t.info.get("num_tool_calls", 0)) for t in trajs),
        "tools/errors": sum(int(t.info.get("num_tool_errors", 0)) for t in trajs),
        "tools/parse_errors": sum(int(t.info.get("num_parse_errors", 0)) for t in trajs),
        "tools/truncated_outputs": sum(int(t.info.get("num_truncated_outputs", 0)) for t in trajs),
        "env/retries": sum(int(t.metrics.get("env_retries", 0)) for t in trajs),
        "tokens/model_mean": statistics.fmean(sum(t.loss_mask) for t in trajs),
        "truncated/ratio": sum(t.truncated for t in trajs) / count,
        "time/generate_sum": sum(float(t.metrics.get("time/generate", 0.0)) for t in trajs),
        "time/env_sum": sum(float(t.metrics.get("time/env", 0.0)) for t in trajs),
    }
    out |= {f"stop/{reason}": n / count for reason, n in sorted(stops.items())}
    return {prefix + k: v for k, v in out.items()}


def cpu_metrics(cpu_s: float, wall_s: float) -> dict[str, float]:
    """A step's CPU seconds in this process (every thread) and the share of the process's cores
    they kept busy. Well below 1 (slow tools, a simulated user), cores sit idle that an overlapped
    trainer can use. OpenMP workers spinning between parallel regions count as busy, so a share
    near 1 may still hide gaps; a vLLM server computes in its own process and does not count."""
    cores = usable_cores()
    return {"time/cpu": cpu_s, "time/cores_busy": cpu_s / (wall_s * cores) if wall_s > 0 else 0.0}


class Tracker(Protocol):
    """An experiment tracker: scalars per step."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record the step's scalars."""

    def close(self) -> None:
        """Flush and finish."""


def _tensorboard(out_dir: Path, config: dict[str, Any]) -> Tracker:
    from torch.utils.tensorboard import SummaryWriter

    class TensorBoard:
        def __init__(self) -> None:
            self.writer = SummaryWriter(str(out_dir / "tensorboard"))

        def log(self, metrics: dict[str, float], step: int) -> None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)

        def close(self) -> None:
            self.writer.close()

    return TensorBoard()


def _module_tracker(module: str) -> Callable[[Path, dict[str, Any]], Tracker]:
    """wandb and trackio share an API: ``init(project, config)``, ``log(dict, step)``, ``finish()``."""

    def build(out_dir: Path, config: dict[str, Any]) -> Tracker:
        lib = importlib.import_module(module)
        lib.init(project="turnrl", name=out_dir.name, config=config)

        class ModuleTracker:
            def log(self, metrics: dict[str, float], step: int) -> None:
                lib.log(metrics, step=step)

            def close(self) -> None:
                lib.finish()

        return ModuleTracker()

    return build


def _mlflow(out_dir: Path, config: dict[str, Any]) -> Tracker:
    import mlflow

    mlflow.start_run(run_name=out_dir.name)
    mlflow.log_params({k: str(v) for k, v in config.items()})

    class MLflow:
        def log(self, metrics: dict[str, float], step: int) -> None:
            mlflow.log_metrics({k.replace("/", "."): v for k, v in metrics.items()}, step=step)

        def close(self) -> None:
            mlflow.end_run()

    return MLflow()


TRACKERS: dict[str, tuple[str, Callable[[Path, dict[str, Any]], Tracker]]] = {
    "tensorboard": ("tensorboard", _tensorboard),
    "wandb": ("wandb", _module_tracker("wandb")),
    "trackio": ("trackio", _module_tracker("trackio")),
    "mlflow": ("mlflow", _mlflow),
}


def make_tracker(name: str, out_dir: Path, config: dict[str, Any]) -> Tracker | None:
    """The tracker ``name`` (None for "none"); a clear error when its package is not installed."""
    if name == "none":
        return None
    package, build = TRACKERS[name]
    if importlib.util.find_spec(package) is None:
        raise ImportError(
            f"train.tracker is {name!r} but {package!r} is not installed: pip install {package}"
        )
    return build(out_dir, config)


_LINE = (
    ("reward/mean", "reward {:.3f}"),
    ("reward/std", "±{:.2f}"),
    ("base/eval/reward/mean", "| before warm start {:.3f}"),
    ("eval/reward/mean", "| eval {:.3f}"),
    ("turns/mean", "| turns {:.2f}"),
    ("tokens/model_mean", "| tok {:.0f}"),
    ("truncated/ratio", "| trunc {:.2f}"),
    ("is/ratio_mean", "| is {:.3f}"),
    ("is/ratio_max", "max {:.2f}"),
    ("loss/clip_frac", "| clip {:.3f}"),
    ("time/rollout", "| rollout {:.1f}s"),
    ("time/env_sum", "(env {:.1f}s)"),
    ("time/train", "train {:.1f}s"),
    ("time/eval", "eval {:.1f}s"),
)


def _console_line(step: int, steps: int, m: dict[str, float]) -> str:
    """One line per step with the numbers that say whether it is learning (those present)."""
    parts = [f"step {step}/{steps}"] + [fmt.format(m[key]) for key, fmt in _LINE if key in m]
    if "runs" in m:  # what the reward is a mean of; an agent run leaves one branch or more
        branches = f", {m['branches']:.0f} branches" if m.get("branches", m["runs"]) != m["runs"] else ""
        parts.insert(3 if "reward/std" in m else 2, f"({m['runs']:.0f} runs{branches})")
    return " ".join(parts)


class MetricsLog:
    """Appends one JSON record per step to metrics.jsonl, prints a line, and feeds a tracker."""

    def __init__(
        self,
        out_dir: Path,
        console: Console,
        tracker: Tracker | None,
        resume_step: int | None = None,
        write: bool = True,
    ) -> None:
        """Start metrics.jsonl afresh, or, resuming at ``resume_step``, keep its records up to that
        step. Without ``write`` (a data-parallel rank other than 0) the records stay in memory."""
        self.path = out_dir / METRICS
        self.console = console
        self.tracker = tracker
        self.write = write
        kept = read_metrics(self.path) if resume_step is not None else []
        self.records = [r for r in kept if resume_step is not None and r["step"] <= resume_step]
        if write:
            self.path.write_text("".join(json_line(r) for r in self.records))

    def log(self, step: int, steps: int, metrics: dict[str, float]) -> None:
        """Record ``metrics`` for ``step``."""
        record = {"step": step, **metrics}
        self.records.append(record)
        if not self.write:
            return
        with self.path.open("a") as f:
            f.write(json_line(record))
        self.console.print(_console_line(step, steps, metrics), highlight=False, soft_wrap=True)
        if self.tracker is not None:
            self.tracker.log(metrics, step)

    def close(self) -> None:
        """Finish the tracker."""
        if self.tracker is not None:
            self.tracker.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (none when it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_rewards(records: Sequence[dict[str, Any]], path: Path) -> str:
    """Write the train and eval reward curves to ``path``; a note saying what happened."""
    if importlib.util.find_spec("matplotlib") is None:
        return "no reward plot: matplotlib is not installed"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6, 3.5))
    train = [(r["step"], r["reward/mean"]) for r in records if "reward/mean" in r]
    evals = [(r["step"], r["eval/reward/mean"]) for r in records if "eval/reward/mean" in r]
    for points, label, style in ((train, "train (sampled)", "-"), (evals, "held-out", "o-")):
        if points:
            ax.plot(*zip(*points, strict=True), style, label=label)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # steps are whole
    ax.set_ylabel("mean reward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"wrote {path}"


CUT_WARNING = 0.5  # a step whose model turns were cut at max_tokens more often than this is warned of


def step_warnings(step: int, metrics: dict[str, float]) -> list[str]:
    """Lines a user must see about a step: it trained on nothing, or most of its turns were cut."""
    said = []
    if metrics.get("train/samples") == 0:
        said.append(
            f"warning: step {step} trained on no samples: every group's rewards were alike (no advantage) "
            "or every trajectory was excluded (see train/excluded/* in metrics.jsonl)"
        )
    cut = metrics.get("train/turns_cut_fraction", 0.0)
    if cut > CUT_WARNING:
        said.append(
            f"warning: step {step}: {cut:.0%} of model turns were cut at max_tokens; "
            "raise sampling.max_tokens or ask for shorter turns"
        )
    return said


def held_out_summary(records: Sequence[dict[str, Any]]) -> str:
    """One line: the held-out reward before training (and before the warm start) and at each
    evaluation after it, e.g. ``held-out reward: 0.000 (base) -> 0.438 (step 0) -> 0.844 (step 16)``."""
    points = [f"{r['base/eval/reward/mean']:.3f} (base)" for r in records[:1] if "base/eval/reward/mean" in r]
    points += [f"{r['eval/reward/mean']:.3f} (step {r['step']})" for r in records if "eval/reward/mean" in r]
    if not points:
        return "no held-out evaluation (set eval.data)"
    return "held-out reward: " + " -> ".join(points)
