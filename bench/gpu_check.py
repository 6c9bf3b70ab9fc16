"""The GPU check, in one call: does turnrl run on this GPU, and how fast against the usual baselines.

1. Builds a random-init Qwen3 in Qwen3-0.6B's shape (28 layers x 1024, 596M parameters) with the
   real Qwen3 tokenizer, on this machine (nothing is downloaded; the weights are not carried).
2. ``engine``: the embedded engine (decode steps replayed from CUDA graphs, and without them)
   against transformers ``generate``, bfloat16, on the GPU (``bench/engine_speed.py``: 64
   requests x 256 tokens, median of 2); then ``graphs exact``: greedy tokens with the graphs equal
   those of the same steps run eagerly.
   ``sampler``: 32 rows over Qwen's 152k-token vocabulary at several temperatures, top-k and top-p,
   drawn on the GPU and on the CPU from the same seeds, 50 times: the tokens must be the same (the
   requests' generators live on the CPU, so a draw does not depend on the device) but for draws
   within float32 rounding of a token boundary, and the logprobs within 1e-4.
3. ``trainer``: a GRPO step on turnrl's path against TRL's ``GRPOTrainer.compute_loss``, under
   bfloat16 autocast, tokens/s and peak CUDA memory above the loaded model for both
   (``bench/trainer_speed.py``: 32 rows x (256 + <= 768) tokens, median of 2), and turnrl's side
   once more with micro-batches of 16k tokens; each side's costliest operators (``--profile``) go
   to the log.
4. ``train``: ``turnrl train examples/train_key_lookup.yaml`` on that model for 3 steps with
   ``engine.device=cuda``: its exit code, the share of trajectories that ended in an error, the
   mean step time.
5. ``harness``: ``turnrl train examples/harness/train_lookup.yaml`` for 2 steps on that model with
   ``engine.device=cuda``: an agent on the plain openai SDK, a forked process per run, served through
   the gateway; its exit code, the share of runs per stop reason, the mean step time.
6. ``train 2 GPUs``: the same as 4, data-parallel under ``torchrun --nproc-per-node 2``, when there are 2.

Prints each part's output as it comes, then one table. Exits 1 when a part failed.

    bash scripts/gpu_check.sh [--quick] [--no-profile]   # --quick: smaller workloads, for a first look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("engine", "sampler", "trainer", "train", "harness")
Row = tuple[str, str, str]  # part, "ok" or "FAILED", what it measured


def build_model(out: Path, layers: int = 28) -> Path:
    """Qwen3-0.6B's shape (``layers`` of its 28), random weights (seeded), saved in bfloat16 with
    the real tokenizer."""
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from turnrl.models.files import QWEN3_EOS_IDS, qwen3_tokenizer_dir

    tokenizer_dir = qwen3_tokenizer_dir()
    config = Qwen3Config(
        vocab_size=len(AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)),
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=QWEN3_EOS_IDS[0],
        pad_token_id=QWEN3_EOS_IDS[1],
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # initialized where it is fast
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        eos_token_id=list(QWEN3_EOS_IDS), pad_token_id=QWEN3_EOS_IDS[1]
    )
    model.save_pretrained(out)
    for file in tokenizer_dir.iterdir():
        if file.is_file():
            shutil.copyfile(file, out / file.name)
    return out


def run(name: str, command: list[str], timeout: float) -> tuple[int, str, float]:
    """Run a part, echoing its output; (exit code, output, seconds)."""
    print(f"\n=== {name}: {' '.join(command)}", flush=True)
    t0 = time.perf_counter()
    lines = []
    with subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as p:
        assert p.stdout is not None
        deadline = t0 + timeout
        for line in p.stdout:
            print(line, end="", flush=True)
            lines.append(line)
            if time.perf_counter() > deadline:
                p.kill()
                lines.append(f"killed after {timeout:.0f} s\n")
                break
        code = p.wait()
    return code, "".join(lines), time.perf_counter() - t0


def last_line(output: str) -> str:
    """The last non-empty line of ``output`` (what a failed part said last)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


def last_json(output: str) -> dict[str, Any]:
    """The last line of ``output`` that is a JSON object ({} if none)."""
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            try:
                return dict(json.loads(line))
            except ValueError:
                continue
    return {}


def train_rows(label: str, code: int, seconds: float, out: Path) -> list[Row]:
    """The table row of a ``turnrl train`` run from its exit code and metrics: failed when it exited
    non-zero, trained no step, or any trajectory ended in an engine error."""
    metrics_file = out / "metrics.jsonl"
    steps = (
        [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.is_file() else []
    )
    steps = [s for s in steps if "time/step" in s or "time/rollout" in s]
    errors = max((s.get("stop/engine_error", 0.0) for s in steps), default=float("nan"))
    step_s = sum(s.get("time/step", s.get("time/rollout", 0.0) + s.get("time/train", 0.0)) for s in steps)
    mean = step_s / len(steps) if steps else float("nan")
    ok = code == 0 and steps and errors == 0.0
    last = steps[-1] if steps else {}
    stops = ", ".join(f"{k.removeprefix('stop/')} {v:.0%}" for k, v in last.items() if k.startswith("stop/"))
    detail = (
        f"exit {code}, {len(steps)} steps, engine errors {errors:.0%} of trajectories, {mean:.1f} s a step"
        f"{f'; last step: {stops}' if stops else ''}"
    )
    return [(label, "ok" if ok else "FAILED", f"{detail} ({seconds:.0f} s in all)")]


def sampler_row(device: str) -> Row:
    """The ``sampler`` part: the same draws on ``device`` as on the CPU, from the same seeds."""
    from turnrl.engines.hf.sampling import sample_tokens
    from turnrl.types import SamplingParams

    rows, vocab, trials = 32, 151_936, 50
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 4
    logits[:, 1::3] = float("-inf")
    kinds: list[dict[str, Any]] = [
        {"temperature": 1.0},
        {"temperature": 0.7},
        {"temperature": 1.3},
        {"temperature": 0.0},
    ]
    kinds += [{"temperature": 1.0, "top_k": 20}, {"temperature": 0.8, "top_p": 0.9}]
    samplings = [SamplingParams(**kinds[b % len(kinds)]) for b in range(rows)]
    on_device = logits.to(device)
    same, gap = 0, 0.0
    for trial in range(trials):
        seeds = [1000 * trial + b for b in range(rows)]
        cpu = sample_tokens(logits, samplings, [torch.Generator().manual_seed(s) for s in seeds])
        dev = sample_tokens(on_device, samplings, [torch.Generator().manual_seed(s) for s in seeds])
        for (t_cpu, lp_cpu), (t_dev, lp_dev) in zip(cpu, dev, strict=True):
            same += t_cpu == t_dev
            if t_cpu == t_dev:
                gap = max(gap, abs(lp_cpu - lp_dev))
    draws = rows * trials
    ok = draws - same <= draws // 1000 and gap < 1e-4
    detail = f"{same}/{draws} draws equal to the CPU's from the same seeds, logprob gap {gap:.2g}"
    return ("sampler on the device vs the CPU", "ok" if ok else "FAILED", detail)


def engine_rows(args: argparse.Namespace, model: str, work: Path, gpus: int) -> list[Row]:
    """The embedded engine against ``generate``; on CUDA, graphs against eager steps."""
    py, rows = sys.executable, []
    requests, tokens = ("16", "64") if args.quick else ("64", "256")
    engine = [py, "bench/engine_speed.py", "--model", model, "--device", args.device, "--dtype", "bfloat16"]
    code, out, secs = run(
        "engine", [*engine, "--requests", requests, "--tokens", tokens, "--repeats", "2", "--json"], 240
    )
    med = last_json(out)
    if code == 0 and med:
        ratio = med["embedded"] / med["generate"]
        eager = med.get("embedded, eager", med["embedded"])
        detail = (
            f"embedded {med['embedded']:.0f} tok/s (CUDA graphs), eager {eager:.0f}, generate "
            f"{med['generate']:.0f}: x{ratio:.2f} generate, graphs x{med['embedded'] / eager:.2f} eager"
        )
        rows.append((f"engine ({requests} x {tokens} tokens, bf16)", "ok", detail))
    else:
        rows.append(("engine", "FAILED", f"exit {code} after {secs:.0f} s: {last_line(out)}"))
    if args.device == "cuda":
        code, out, secs = run(
            "graphs exact", [*engine, "--graphs-exact", "--requests", "16", "--tokens", "48"], 180
        )
        res = last_json(out)
        equal, plain = res.get("equal_eager"), res.get("equal_plain")
        detail = (
            f"{equal}/{res.get('rows')} greedy rows equal, logprob gap {res.get('gap', float('nan')):.4f} "
            f"(plain decode: {plain} equal)"
        )
        rows.append(
            ("CUDA graphs vs eager steps", "ok" if code == 0 else "FAILED", detail if res else last_line(out))
        )
    return rows


def sampler_rows(args: argparse.Namespace, model: str, work: Path, gpus: int) -> list[Row]:
    """``sampler_row``, its failure one line in the table."""
    try:
        return [sampler_row(args.device)]
    except Exception as exc:
        return [("sampler on the device vs the CPU", "FAILED", f"{type(exc).__name__}: {exc}"[:200])]


def trainer_rows(args: argparse.Namespace, model: str, work: Path, gpus: int) -> list[Row]:
    """A GRPO step against TRL's, then with 16k-token micro-batches; the profiles to the log."""
    py, rows = sys.executable, []
    shape = (
        ["--rows", "8", "--prompt", "128", "--completion", "256"]
        if args.quick
        else ["--rows", "32", "--prompt", "256", "--completion", "768"]
    )
    trainer = [py, "bench/trainer_speed.py", "--model", model, "--device", args.device, "--bf16", *shape]
    code, out, secs = run(
        "trainer", [*trainer, "--steps", "2", "--repeats", "2", "--sides", "turnrl,trl", "--json"], 300
    )
    res = last_json(out)
    if code == 0 and res:
        rates, peak = res["rates"], res["cuda_peak_mib"] or res["extra_mib"]
        memory = "CUDA peak" if res["cuda_peak_mib"] else "peak RSS"
        detail = (
            f"turnrl {rates['turnrl']:.0f} tok/s, TRL {rates['trl']:.0f} tok/s: "
            f"x{rates['turnrl'] / rates['trl']:.2f}; "
            f"{memory} above the model: turnrl {peak['turnrl']:.0f} MiB, TRL {peak['trl']:.0f} MiB"
        )
        rows.append(("trainer step vs TRL (bf16 autocast)", "ok", detail))
    else:
        rows.append(("trainer step vs TRL", "FAILED", f"exit {code} after {secs:.0f} s: {last_line(out)}"))
    big = ["--micro-tokens", "16384", "--steps", "2", "--repeats", "1", "--sides", "turnrl", "--json"]
    code, out, secs = run("trainer, 16k-token micro-batches", [*trainer, *big], 200)
    big_res = last_json(out)
    if code == 0 and big_res and res:
        rate, peak = big_res["rates"]["turnrl"], (big_res["cuda_peak_mib"] or big_res["extra_mib"])["turnrl"]
        ratio = rate / res["rates"]["trl"]
        detail = f"turnrl {rate:.0f} tok/s: x{ratio:.2f} TRL; peak above the model {peak:.0f} MiB"
        rows.append(("trainer, 16k-token micro-batches", "ok", detail))
    else:
        rows.append(("trainer, 16k-token micro-batches", "FAILED", f"exit {code}: {last_line(out)}"))
    for side in () if args.no_profile else ("turnrl", "trl"):  # where the time goes, for the log
        run(f"profile {side}", [*trainer, "--steps", "1", "--side", side, "--profile"], 150)
    return rows


def train_command(config: str, model: str, device: str, steps: int, out: Path) -> list[str]:
    """``turnrl train CONFIG`` on ``model`` for ``steps`` steps, evaluated and saved at the last."""
    sets = {
        "model": model,
        "engine.device": device,
        "train.steps": steps,
        "train.save_every": steps,
        "eval.every": steps,
        "warm_start.epochs": 1,
        "output_dir": out,
    }
    return [
        sys.executable,
        "-m",
        "turnrl.cli",
        "train",
        config,
        *(a for k, v in sets.items() for a in ("--set", f"{k}={v}")),
    ]


def train_part_rows(args: argparse.Namespace, model: str, work: Path, gpus: int) -> list[Row]:
    """``turnrl train`` of the key-lookup example for 3 steps; data-parallel on 2 GPUs when there are 2."""
    out = work / "train"
    code, _, secs = run(
        "train", train_command("examples/train_key_lookup.yaml", model, args.device, 3, out), 300
    )
    rows = train_rows("turnrl train, 3 steps on CUDA", code, secs, out)
    if gpus >= 2:
        out = work / "train-dp"
        command = train_command("examples/train_key_lookup.yaml", model, args.device, 1, out)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *command[1:]]
        code, _, secs = run("train, 2 GPUs", torchrun, 300)
        rows += train_rows("turnrl train, 2 ranks data-parallel", code, secs, out)
    return rows


def harness_rows(args: argparse.Namespace, model: str, work: Path, gpus: int) -> list[Row]:
    """``turnrl train`` of the harness example (an openai-SDK agent through the gateway) for 2 steps."""
    out = work / "harness"
    command = train_command("examples/harness/train_lookup.yaml", model, args.device, 2, out)
    code, _, secs = run("harness", command, 300)
    return train_rows("harness through the gateway, 2 steps on CUDA", code, secs, out)


PART_ROWS = {
    "engine": engine_rows,
    "sampler": sampler_rows,
    "trainer": trainer_rows,
    "train": train_part_rows,
    "harness": harness_rows,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    parser.add_argument("--layers", type=int, default=28, help="fewer layers than 0.6B's 28 (a dry run)")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    parser.add_argument("--no-profile", action="store_true", help="skip the trainer profiles (log only)")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)} (default: all)"
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if parts - set(PARTS):
        parser.error(
            f"--parts: no part named {', '.join(sorted(parts - set(PARTS)))} (parts: {', '.join(PARTS)})"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: torch sees no CUDA device (torch.cuda.is_available() is False)")
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    card = torch.cuda.get_device_name(0) if gpus else "CPU"
    rows: list[Row] = [("machine", "ok", f"{gpus} x {card}, torch {torch.__version__}")]
    work = Path(tempfile.mkdtemp(prefix="turnrl-gpu-check-"))
    t0 = time.perf_counter()
    model = str(build_model(work / "qwen3-0.6b-shape", args.layers))
    built = (
        f"Qwen3-0.6B shape ({args.layers} layers), random weights, built in {time.perf_counter() - t0:.0f} s"
    )
    rows.append(("model", "ok", built))

    for part in PARTS:
        if part in parts:
            rows += PART_ROWS[part](args, model, work, gpus)
    print(f"\nturnrl GPU check, {time.strftime('%Y-%m-%d')}, {gpus} x {card}")
    width = max(len(r[0]) for r in rows)
    for name, status, detail in rows:
        print(f"| {name:<{width}} | {status:<6} | {detail} |")
    shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if any(status != "ok" for _, status, _ in rows) else 0)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
