"""Writes the task-family set: Harbor task folders in five families of one-command terminal tasks
(write a file, replace a word, rename a file, append a line, delete lines), each instance with its
own names and words, in three splits that share the families:

- ``warm_start/``: 4 instances a family, whose solutions the warm start demonstrates;
- ``train/``: 6 a family, the RL tasks (not demonstrated: the model must carry the pattern over);
- ``held_out/``: 2 a family, with none of the names or words of the other two, so a pass there is a
  skill learned, not an answer remembered.

    python examples/task_families/make.py examples/task_families   # rewrites the three folders

The folders are committed; this script is how they were made (the same seed gives the same files).
"""

from __future__ import annotations

import random
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WORDS = [
    "apple",
    "amber",
    "birch",
    "cobalt",
    "cedar",
    "delta",
    "ember",
    "falcon",
    "garnet",
    "harbor",
    "indigo",
    "juniper",
    "kestrel",
    "lemon",
    "maple",
    "nectar",
    "onyx",
    "pepper",
    "quartz",
    "raven",
    "saffron",
    "tundra",
    "umber",
    "velvet",
    "willow",
    "yarrow",
    "zephyr",
    "basil",
    "copper",
    "dune",
    "fennel",
    "glacier",
    "hazel",
    "iris",
    "jasper",
    "lotus",
    "meadow",
    "nutmeg",
    "orchid",
    "pine",
    "river",
    "sage",
    "thistle",
]
TOML = """version = "1.0"

[metadata]
difficulty = "easy"
category = "{family}"
tags = ["turnrl-example", "family:{family}"]

[agent]
timeout_sec = 120.0

[verifier]
timeout_sec = 30.0

[environment]
cpus = 1
memory_mb = 512
"""
TEST = """#!/bin/bash
# The verifier: writes 1 to /logs/verifier/reward.txt when the check passes, else 0.
cd /app
if {check}
then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


@dataclass
class Instance:
    """One task: its prompt, the files it starts with, the check its tests make, its solution."""

    instruction: str
    files: dict[str, str]
    check: str
    solution: str
    expected: str | None = None  # the file the tests compare with (in tests/, unseen by the agent)


def write_file(pick: Callable[[int], list[str]]) -> Instance:
    name, word, other = pick(3)
    text = f"{word} {other}"
    return Instance(
        f"Create a file named `{name}.txt` that contains exactly one line: `{text}`.",
        {"README": "An empty project.\n"},
        f'[ "$(cat {name}.txt)" = "{text}" ] && [ "$(wc -l < {name}.txt)" = 1 ]',
        f"echo '{text}' > {name}.txt",
    )


def replace_word(pick: Callable[[int], list[str]]) -> Instance:
    name, old, new, a, b = pick(5)
    lines = [f"{a} {old}", f"{old} {b}", f"{a} {b}", f"{b} {old} {a}"]
    after = "\n".join(line.replace(old, new) for line in lines) + "\n"
    return Instance(
        f"In `{name}.txt`, replace every `{old}` with `{new}`.",
        {f"{name}.txt": "\n".join(lines) + "\n"},
        f"cmp -s {name}.txt /tests/expected",
        f"sed -i 's/{old}/{new}/g' {name}.txt",
        after,
    )


def rename_file(pick: Callable[[int], list[str]]) -> Instance:
    old, new, word = pick(3)
    body = f"{word} notes\n"
    return Instance(
        f"Rename the file `{old}.txt` to `{new}.txt`.",
        {f"{old}.txt": body},
        f"[ ! -e {old}.txt ] && cmp -s {new}.txt /tests/expected",
        f"mv {old}.txt {new}.txt",
        body,
    )


def append_line(pick: Callable[[int], list[str]]) -> Instance:
    name, a, b, word, other = pick(5)
    before = f"{a}\n{b}\n"
    text = f"{word} {other}"
    return Instance(
        f"Add the line `{text}` at the end of `{name}.txt`.",
        {f"{name}.txt": before},
        f"cmp -s {name}.txt /tests/expected",
        f"echo '{text}' >> {name}.txt",
        f"{before}{text}\n",
    )


def delete_lines(pick: Callable[[int], list[str]]) -> Instance:
    name, word, a, b, c = pick(5)
    lines = [f"{a} {word}", f"{b}", f"{word} {c}", f"{c} {a}", f"{b} {word} {a}"]
    kept = [line for line in lines if word not in line]  # as sed matches
    return Instance(
        f"Delete every line of `{name}.txt` that contains the word `{word}`.",
        {f"{name}.txt": "\n".join(lines) + "\n"},
        f"cmp -s {name}.txt /tests/expected",
        f"sed -i '/{word}/d' {name}.txt",
        "\n".join(kept) + "\n",
    )


FAMILIES: dict[str, Callable[[Callable[[int], list[str]]], Instance]] = {
    "write-file": write_file,
    "replace-word": replace_word,
    "rename-file": rename_file,
    "append-line": append_line,
    "delete-lines": delete_lines,
}


def write(task: Path, family: str, instance: Instance) -> None:
    """One Harbor task folder."""
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "solution").mkdir()
    (task / "instruction.md").write_text(instance.instruction + "\n")
    (task / "task.toml").write_text(TOML.format(family=family))
    copies = "".join(f"COPY {name} /app/{name}\n" for name in instance.files)
    (task / "environment" / "Dockerfile").write_text(f"FROM python:3.11-slim\nWORKDIR /app\n{copies}")
    for name, text in instance.files.items():
        (task / "environment" / name).write_text(text)
    (task / "tests" / "test.sh").write_text(TEST.format(check=instance.check))
    if instance.expected is not None:
        (task / "tests" / "expected").write_text(instance.expected)
    solve = f"#!/bin/bash\n# The reference solution, run in /app.\nset -e\n{instance.solution}\n"
    (task / "solution" / "solve.sh").write_text(solve)


def make(root: Path, demos: int = 4, train: int = 6, held_out: int = 2, seed: int = 0) -> None:
    """``demos``, ``train`` and ``held_out`` instances of each family (numbered on across the three),
    the held-out names and words drawn from one half of ``WORDS``, the others' from the other."""
    rng = random.Random(seed)
    words = list(WORDS)
    rng.shuffle(words)
    half = len(words) // 2
    ends = (demos, demos + train, demos + train + held_out)
    splits = (
        ("warm_start", range(1, ends[0] + 1), words[:half]),
        ("train", range(ends[0] + 1, ends[1] + 1), words[:half]),
        ("held_out", range(ends[1] + 1, ends[2] + 1), words[half:]),
    )
    for split, numbers, pool in splits:
        shutil.rmtree(root / split, ignore_errors=True)
        for family, build in FAMILIES.items():
            for number in numbers:
                instance = build(lambda k, pool=pool: rng.sample(pool, k))
                write(root / split / f"{family}-{number}", family, instance)


if __name__ == "__main__":
    make(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent))
