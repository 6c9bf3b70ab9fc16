"""Tool-call parsing of degenerate model turns: turnrl's one-pass hermes parser against the regex
scan it replaced, side by side on the same inputs.

A model that degenerates repeats a tag: ``<tool_call>`` or ``<think>`` thousands of times with no
closing tag. A non-greedy regex (``<tool_call>(.*?)</tool_call>``, ``<think>.*?</think>``) then
rescans the rest of the text from every opening tag, quadratic in the turn's length; the parser
runs in the event loop, so every other trajectory waits. The baseline below is the regex form
(the reasoning strip and the block scan, without JSON decoding: the part that is quadratic).

    .venv/bin/python bench/parsers.py [--repeats 2000 5000 10000]
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable

from turnrl.tools.parsers import get_parser

THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def regex_scan(text: str) -> int:
    """The regex form: strip reasoning blocks, cut before an unclosed ``<think>``, find the blocks."""
    visible = THINK_BLOCK.sub("", text)
    if "</think>" in visible:
        visible = visible.rsplit("</think>", 1)[1]
    if "<think>" in visible:
        visible = visible.split("<think>", 1)[0]
    return sum(1 for _ in TOOL_CALL_BLOCK.finditer(visible))


def seconds(fn: Callable[[str], object], text: str) -> float:
    start = time.perf_counter()
    fn(text)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, nargs="+", default=[2000, 5000, 10000])
    args = parser.parse_args()
    hermes = get_parser("hermes")
    print(f"{'turn':<28} {'chars':>8} {'regex s':>9} {'turnrl s':>9} {'ratio':>8}")
    for n in args.repeats:
        for name, text in (
            (f"{n} x unclosed <tool_call>", "<tool_call>" * n),
            (f"{n} x unclosed <think>", "<think>" * n),
        ):
            old, new = seconds(regex_scan, text), seconds(hermes.parse, text)
            print(f"{name:<28} {len(text):>8} {old:>9.3f} {new:>9.4f} {old / new:>7.0f}x")


if __name__ == "__main__":
    main()
