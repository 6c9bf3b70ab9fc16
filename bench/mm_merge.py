"""Merging a trajectory's image training inputs: buffer then merge once, against concatenating every turn.

Every turn brings the processor outputs of one turn's images: ``pixel_values`` float32
``[N, 1176]`` (N patches; one 448x448 image is 1024 patches of 3x2x14x14 values) and
``image_grid_thw`` int64 ``[k, 3]``. Two ways to end with one tensor per key:

- buffer: ``turnrl.vision.MultimodalBuffer``: keep each turn's dict, ``merge()`` once at the end;
- concat: ``merged[key] = torch.cat([merged[key], new])`` at every turn.

In turnrl's loop each turn's outputs stay alive for the whole trajectory either way (every
``ImageInput`` holds a view of its turn's ``pixel_values``; the engine needs them), so both sides
keep them. A third side, ``concat, freed``, drops each turn's outputs right after concatenating
them: an idealized concat whose per-turn tensors nothing else holds.

Each (side, turns, repeat) runs in a fresh subprocess, sides alternating, and reports:
- time: seconds spent in the merging itself (appends + merge, or the per-turn cats), not in making
  the inputs;
- peak live tensor bytes: the largest total size of the tensors alive at once (inputs and results),
  tracked exactly with a finalizer on every tensor the run creates (``torch.cat`` allocates nothing
  else that outlives the call); reported as a multiple of the final merged size M;
- peak RSS growth: the process's peak resident memory (``VmHWM``, reset before the first turn via
  ``/proc/self/clear_refs``) minus its resident memory before the first turn: what the OS saw,
  allocator caching and fragmentation included.

    .venv/bin/python bench/mm_merge.py [--turns 20 100] [--patches 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

SIDES = ("buffer", "concat", "concat, freed")
PATCH_DIM = 1176  # 3 channels x 2 frames x 14 x 14


class LiveBytes:
    """The total size of tracked tensors alive now, and its peak."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def track(self, tensor: Any) -> Any:
        """Count ``tensor`` until it is freed; return it."""
        size = tensor.untyped_storage().nbytes()
        self.now += size
        self.peak = max(self.peak, self.now)
        weakref.finalize(tensor, self._free, size)
        return tensor

    def _free(self, size: int) -> None:
        self.now -= size


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> Callable[[], int]:
    """Reset the peak RSS; return a function that gives the peak since then, in kB."""
    import resource

    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return lambda: _rss_kb("VmHWM")
    except OSError:  # no permission: the lifetime peak (an upper bound when imports peaked higher)
        return lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def turn_inputs(turn: int, patches: int, live: LiveBytes) -> dict[str, Any]:
    """One turn's processor outputs, every page written (so the OS counts them)."""
    import torch

    pixel_values = live.track(torch.empty(patches, PATCH_DIM, dtype=torch.float32).fill_(turn))
    side = math.isqrt(patches // 4) * 2  # a square grid of patches (merge size 2)
    grid = live.track(torch.tensor([[1, side, patches // side]], dtype=torch.int64))
    return {"pixel_values": pixel_values, "image_grid_thw": grid}


def run_side(side: str, turns: int, patches: int) -> dict[str, float]:
    """One side, one trajectory of ``turns`` turns; the measurements of this process."""
    import torch

    from turnrl.vision import MultimodalBuffer

    torch.cat([torch.ones(4, 4), torch.ones(4, 4)])  # load the kernels before measuring
    live = LiveBytes()
    base_kb = _rss_kb("VmRSS")
    peak_kb = _reset_peak_rss()
    kept: list[dict[str, Any]] = []  # what the trajectory's images hold on to
    buffer = MultimodalBuffer()
    merged: dict[str, Any] = {}
    seconds = 0.0
    for turn in range(turns):
        inputs = turn_inputs(turn, patches, live)
        t0 = time.perf_counter()
        if side == "buffer":
            buffer.append(inputs)
        else:
            for key, value in inputs.items():
                merged[key] = live.track(torch.cat([merged[key], value])) if key in merged else value
        seconds += time.perf_counter() - t0
        if side != "concat, freed":
            kept.append(inputs)
        del inputs
    if side == "buffer":
        t0 = time.perf_counter()
        merged = buffer.merge()
        seconds += time.perf_counter() - t0
        inputs_ids = {id(t) for given in kept for t in given.values()}
        for value in merged.values():
            if id(value) not in inputs_ids:  # one turn: merge returns the input itself
                live.track(value)
    final = sum(t.untyped_storage().nbytes() for t in merged.values())
    assert merged["pixel_values"].shape == (turns * patches, PATCH_DIM)
    assert merged["image_grid_thw"].shape == (turns, 3)
    return {
        "seconds": seconds,
        "final_mb": final / 2**20,
        "peak_live_mb": live.peak / 2**20,
        "peak_rss_mb": (peak_kb() - base_kb) / 1024,
    }


def measure(side: str, turns: int, patches: int) -> dict[str, float]:
    """``run_side`` in a fresh Python process."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", side, str(turns), str(patches)],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[20, 100])
    parser.add_argument(
        "--patches", type=int, default=1024, help="patches per turn (1024: one 448x448 image)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=3, metavar=("SIDE", "TURNS", "PATCHES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        side, turns, patches = args.child
        print(json.dumps(run_side(side, int(turns), int(patches))))
        return
    per_turn_mb = args.patches * PATCH_DIM * 4 / 2**20
    print(f"pixel_values per turn: [{args.patches}, {PATCH_DIM}] float32 = {per_turn_mb:.2f} MiB")
    print(f"repeats: {args.repeats} (median time; memory is the same every repeat up to the allocator)\n")
    header = "| turns | side | time | peak live tensors | peak RSS growth | time / buffer |"
    print(header)
    print("|---|---|---|---|---|---|")
    for turns in args.turns:
        runs: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
        for _ in range(args.repeats):
            for side in SIDES:  # side by side: alternating, each in a fresh process
                runs[side].append(measure(side, turns, args.patches))
        buffer_s = statistics.median(r["seconds"] for r in runs["buffer"])
        for side in SIDES:
            seconds = statistics.median(r["seconds"] for r in runs[side])
            final = runs[side][0]["final_mb"]
            live = max(r["peak_live_mb"] for r in runs[side])
            rss = statistics.median(r["peak_rss_mb"] for r in runs[side])
            print(
                f"| {turns} | {side} | {seconds * 1000:.1f} ms | {live:.0f} MiB ({live / final:.2f} M) "
                f"| {rss:.0f} MiB ({rss / final:.2f} M) | {seconds / buffer_s:.1f}x |"
            )
    print("\nM = the final merged size (all turns' pixel_values + image_grid_thw).")


if __name__ == "__main__":
    main()
