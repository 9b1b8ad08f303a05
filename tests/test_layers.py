"""The package layout: engine <- widgets <- app <- cli, and no import circle anywhere in kvtui/.

Read from the source with `ast` (no imports run). Every import counts, also those inside functions:
a lazy import is still a dependency, and a circle through one is still a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvtui"

# Lower layers never import higher ones. Same layer: allowed, as long as there is no circle.
LAYERS = [
    ("base", ["kvtui._version", "kvtui.fmt"]),
    ("engine", ["kvtui.engine"]),
    ("options", ["kvtui.options", "kvtui.locations"]),
    ("widgets", ["kvtui.themes", "kvtui.widgets"]),
    ("app", ["kvtui.app", "kvtui.replay_app", "kvtui.watch_app", "kvtui.headless", "kvtui.engine_host",
             "kvtui.compare", "kvtui.compare_app", "kvtui.notebook", "kvtui.notebook_hook"]),
    ("commands", ["kvtui.commands"]),
    ("cli", ["kvtui.cli"]),
    ("api", ["kvtui"]),  # the package itself: `kvtui.watch(...)`, a lazy facade over the engine
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Every kvtui module this file imports (absolute or relative, at any depth of the code)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found |= {f"{module}.{alias.name}" for alias in node.names}  # `from . import cli` imports a module
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imports(path) if m in files and m != name} for name, path in files.items()}


def layer_of(module: str) -> int:
    best, rank = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    return rank


def test_every_module_has_a_layer():
    assert all(layer_of(m) >= 0 for m in graph()), [m for m in graph() if layer_of(m) < 0]


def test_lower_layers_never_import_higher_ones():
    wrong = sorted(f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
                   for m, deps in graph().items() for d in deps if layer_of(d) > layer_of(m))
    assert not wrong, "\n".join(wrong)


def test_nothing_imports_the_cli():
    assert not [m for m, deps in graph().items() if "kvtui.cli" in deps]


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle():
    assert find_cycle(graph()) is None, " -> ".join(find_cycle(graph()))


def test_the_checker_sees_a_circle_and_a_lazy_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert "kvtui.engine.loader" in graph()["kvtui.options"]  # imported inside load(): still an edge
