"""The docs cannot rot: every Python snippet in the README and the docs runs, page by page, in a
fresh process; the architecture page's layers are the ones the import test enforces."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_architecture import LAYERS

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SNIPPET = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.M | re.S)
NAMED = re.compile(r"^# ([\w./-]+\.(?:py|yaml|yml|sh|toml))(?:$|[ :(])")


def snippets(page: Path) -> list[str]:
    """The page's Python blocks to run, but for copies of a shipped file (the file itself is what
    runs: ``test_every_block_that_names_a_shipped_file_is_that_file`` holds them to it)."""
    return [code for code in SNIPPET.findall(page.read_text()) if not names_a_file(code)]


def names_a_file(block: str) -> str | None:
    """The repository file a block's first line names (``# PATH ...``), or None."""
    named = NAMED.match(block.partition("\n")[0])
    return named[1] if named is not None and (REPO / named[1]).is_file() else None


@pytest.mark.parametrize("page", [p for p in PAGES if snippets(p)], ids=lambda p: p.name)
def test_every_python_snippet_runs(page: Path, tmp_path: Path) -> None:
    code = "\n\n".join(snippets(page))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, f"{page.name}: {result.stderr[-3000:]}"


def test_the_pages_have_snippets_to_run() -> None:
    assert {p.name for p in PAGES if snippets(p)} >= {"README.md", "configuration.md", "environments.md"}


def test_the_architecture_page_lists_the_enforced_layers() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("<!-- layers -->")[1].split("<!-- /layers -->")[0]
    listed = [set(re.findall(r"`(\w+)`", line)) for line in block.strip().splitlines()]
    assert listed == LAYERS


def test_every_page_is_in_the_site_nav() -> None:
    nav = (REPO / "mkdocs.yml").read_text()
    assert all(f": {p.name}" in nav for p in (REPO / "docs").glob("*.md"))


NAME = re.compile(r"`(turnrl(?:\.\w+)+)(?:\(\))?`|`([A-Z]\w+)\.(\w+)(?:\(\))?`")


def resolve(dotted: str) -> bool:
    """Whether ``turnrl.a.b.c`` names a module or an attribute of one."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(found, attr):
                return False
            found = getattr(found, attr)
        return True
    return False


def has_attribute(cls: type, attr: str) -> bool:
    """An attribute, or a field of a dataclass or pydantic model (fields with factories are not
    class attributes)."""
    fields = {name for klass in cls.__mro__ for name in getattr(klass, "__annotations__", {})}
    return hasattr(cls, attr) or attr in fields


def test_every_documented_turnrl_name_exists() -> None:
    """A `turnrl.module.name` or an exported class's `Class.attribute` named in the README or the
    docs exists (a renamed or removed name fails here, not in a reader's session)."""
    import turnrl

    missing = []
    for page in PAGES:
        for dotted, cls, attr in NAME.findall(page.read_text()):
            if dotted and not resolve(dotted):
                missing.append(f"{page.name}: {dotted}")
            elif cls in turnrl.__all__ and not has_attribute(getattr(turnrl, cls), attr):
                missing.append(f"{page.name}: {cls}.{attr}")
    assert not missing, missing


def test_every_config_key_has_its_doc_in_config_show() -> None:
    """`turnrl config show --schema` gives every key of every config a doc line (a test walks the
    schemas: rollout, train with its algorithm/optim/train/eval sections, gateway)."""
    from turnrl.app.config_docs import field_docs
    from turnrl.app.learning import LearningGatewayConfig
    from turnrl.config import RunConfig
    from turnrl.gateway.config import GatewayConfig
    from turnrl.train.config import TrainConfig

    undocumented = [
        f"{cls.__name__}: {doc.key}"
        for cls in (RunConfig, TrainConfig, GatewayConfig, LearningGatewayConfig)
        for doc in field_docs(cls)
        if not doc.doc.strip()
    ]
    assert not undocumented, undocumented


def test_config_show_reads_a_gateway_config(tmp_path: Path) -> None:
    """The config `turnrl gateway` writes beside its calls, and one a user writes, read back as a
    gateway config (guessed from its keys), every key filled in."""
    config = tmp_path / "gateway.yaml"
    config.write_text("model: tiny-qwen3\nport: 0\napi_keys: [k1]\n")
    shown = subprocess.run(
        [str(Path(sys.executable).parent / "turnrl"), "config", "show", str(config)],
        capture_output=True,
        text=True,
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"# {config} as `turnrl gateway` reads it")
    assert "any_model: true" in shown.stdout and "max_session_tokens: 32768" in shown.stdout
    learning = subprocess.run(
        [
            str(Path(sys.executable).parent / "turnrl"),
            "config",
            "show",
            str(REPO / "examples/learn/gateway.yaml"),
        ],
        capture_output=True,
        text=True,
    )
    assert learning.returncode == 0, learning.stderr
    assert "sessions_per_step: 8" in learning.stdout and "max_staleness: 4" in learning.stdout


def test_every_block_that_names_a_shipped_file_is_that_file() -> None:
    """A code block whose first line is `# PATH ...` (a file of this repository) is that file, or a
    run of its consecutive lines, exactly: a copy of an example cannot drift from the example."""
    drifted = []
    for page in PAGES:
        for block in FENCE.findall(page.read_text()):
            name = names_a_file(block)
            if name is None:
                continue
            lines = block.partition("\n")[2].rstrip("\n").splitlines()
            shipped, n = (REPO / name).read_text().splitlines(), len(lines)
            if not any(shipped[i : i + n] == lines for i in range(len(shipped) - n + 1)):
                drifted.append(f"{page.name}: the block named {name}")
    assert not drifted, drifted
