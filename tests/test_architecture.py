"""The house rules, read from the code: which way imports flow, no cycles, short functions.

Every ``import`` counts, also those inside functions and under ``TYPE_CHECKING``. The docs'
architecture page states the same rules; this test keeps it true.
"""

from __future__ import annotations

import ast
import itertools
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "turnrl"

# The parts, from the top (may import anything below) to the bottom (imports nothing of turnrl).
# ``app`` wires rollouts, training runs and the gateway from configs; ``train`` holds the algorithm.
LAYERS: list[set[str]] = [
    {"cli"},
    {"integrations"},
    {"app", "viewer"},
    {"train"},
    {"tasks"},
    {"harness"},
    {"gateway"},
    {"distributed"},
    {"config", "models", "testing", "data"},
    {"rollout"},
    {"record"},
    {"chat", "engines", "env", "tools"},
    {"vision", "support"},
    {"types"},
]
UPPER = {
    "config",
    "models",
    "distributed",
    "gateway",
    "harness",
    "tasks",
    "train",
    "integrations",
    "cli",
    "app",
    "viewer",
}
CORE = {"rollout", "record", "chat", "engines", "env", "tools", "vision", "support", "types"}
# the gateway turns API calls into trajectories: it serves an engine it is handed (app builds it), encodes
# with chat, parses replies with tools' parsers and records with the token record (``record``) the turn
# loop records with too; it imports nothing of the turn loop (``rollout``), so the two sit side by side
GATEWAY_MAY_IMPORT = {"config", "record", "chat", "engines", "tools", "vision", "support", "types"}
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The turnrl modules ``name`` imports (``from pkg import sub`` counts as importing ``pkg.sub``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("turnrl"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            if base.startswith("turnrl"):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    out.add(sub if sub in modules else base)
    return {m for m in out if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def _layer(part: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if part in layer)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = itertools.count()

    def visit(v: str) -> None:
        index[v] = low[v] = next(counter)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_every_part_has_a_layer() -> None:
    parts = {_part(m) for m in _modules()} - {""}
    assert parts == set().union(*LAYERS)


def test_no_import_cycles_between_modules_or_parts() -> None:
    graph = _graph()
    package_inits = {m for m in graph if (ROOT.parent / m.replace(".", "/") / "__init__.py").exists()}
    # a package's __init__ re-exports its modules: importing one of them goes through it, not a cycle
    modules = {m: {d for d in deps if d not in package_inits} for m, deps in graph.items()}
    assert _cycles(modules) == []
    parts: dict[str, set[str]] = defaultdict(set)
    for module, deps in graph.items():
        parts[_part(module)].update(_part(d) for d in deps if _part(d) != _part(module))
    parts.pop("", None)
    assert _cycles({p: {d for d in deps if d} for p, deps in parts.items()}) == []


def test_imports_flow_down_only() -> None:
    upward = [
        f"{module} -> {dep}"
        for module, deps in _graph().items()
        if _part(module)
        for dep in deps
        if _part(dep) and _part(dep) != _part(module) and _layer(_part(dep)) < _layer(_part(module))
    ]
    assert upward == []


@pytest.mark.parametrize(
    ("parts", "forbidden"),
    [
        (CORE, UPPER),  # the core never reaches up into wiring, configs, models or trainers
        ({"engines"}, {"env", "tools", "train", "rollout"}),  # engines know nothing of envs or training
        (set().union(*LAYERS) - {"integrations", "cli"}, {"integrations"}),  # core never imports integrations
        ({"gateway"}, set().union(*LAYERS) - GATEWAY_MAY_IMPORT),  # the gateway's room
        ({"train"}, {"app", "viewer", "gateway"}),  # app wires training; train holds the algorithm
    ],
)
def test_forbidden_edges(parts: set[str], forbidden: set[str]) -> None:
    bad = [
        f"{module} -> {dep}"
        for module, deps in _graph().items()
        if _part(module) in parts
        for dep in deps
        if _part(dep) in forbidden and _part(dep) != _part(module)
    ]
    assert bad == []


def test_the_protocol_module_imports_nothing_of_turnrl() -> None:
    assert _graph()["turnrl.types"] == set()


def test_no_function_is_longer_than_the_limit() -> None:
    long = [
        f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1}"
        for path in ROOT.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []


def test_the_rules_catch_a_violation(tmp_path: Path) -> None:
    """The checks above can fail: a cycle and an upward edge in a made-up graph are found."""
    graph = {"turnrl.rollout.loop": {"turnrl.config"}, "turnrl.config": {"turnrl.rollout.loop"}}
    assert _cycles(graph) == [["turnrl.config", "turnrl.rollout.loop"]]
    assert _layer("config") < _layer("rollout")  # so rollout -> config is upward
