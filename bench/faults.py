"""The fault suite's table: every fault a rollout meets, N trajectories each (tests/fault_harness/suite.py).

    .venv/bin/python bench/faults.py [--n 32] [--fast] [--only "server" "kill"] [--repeat 1]

Prints one Markdown table (fault | N | returned | lost | duplicated | stop reasons | max time to
stop | verdict); exits 1 when a row fails. The disk rows mount small tmpfs folders (root).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness is test support

from fault_harness.suite import Row, clean, run_suite, table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32, help="trajectories per row")
    parser.add_argument("--fast", action="store_true", help="only the rows CI runs")
    parser.add_argument("--only", nargs="*", default=[], help="rows whose name contains one of these")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each row (a race shows in some)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="turnrl-faults-"))
    t0 = time.monotonic()

    def progress(row: Row) -> None:
        print(f"{row.fault}: {row.verdict} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)

    try:
        rows = [
            row
            for _ in range(args.repeat)
            for row in asyncio.run(run_suite(tmp, args.n, args.only, args.fast, progress))
        ]
    finally:
        clean(tmp)
    print(table(rows))
    failed = [r for r in rows if not r.ok]
    print(
        f"\n{len(rows) - len(failed)} of {len(rows)} rows ok in {time.monotonic() - t0:.0f} s",
        file=sys.stderr,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
