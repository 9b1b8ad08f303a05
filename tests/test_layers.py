"""No import circle anywhere in kvtui/, also through a package's own __init__.

The layers themselves (engine <- widgets <- app <- cli, nothing imports the CLI, the engine imports no Textual or
Rich) are import-linter contracts in pyproject.toml, checked by `make lint` (part of `make test`). Its
`acyclic_siblings` contract finds circles between the modules of a package but not one through the package's
own module: kvtui.engine (its __init__) -> kvtui.engine.chat.session -> kvtui.engine. This test walks the same graph
(grimp's, as import-linter reads it: every import counts, also one inside a function) for any circle.
"""

from __future__ import annotations

import grimp


def graph() -> dict[str, set[str]]:
    imports = grimp.build_graph("kvtui", cache_dir=None)
    return {module: set(imports.find_modules_directly_imported_by(module)) for module in imports.modules}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
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
    assert find_cycle({"kvtui.engine": {"kvtui.engine.chat.session"}, "kvtui.engine.chat.session": {"kvtui.engine"}})
    assert "kvtui.engine.chat.loader" in graph()["kvtui.engine.chat.configure"]  # imported inside load(): still an edge
