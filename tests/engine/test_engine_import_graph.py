"""The engine's modules import one another without cycles: read from their source (the
imports at module level, those under ``if TYPE_CHECKING:`` included), so it takes no import
of torch and catches a cycle before it bites at run time."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "engine"

# Edges that exist for the type checker only and close a cycle, each with its reason. A
# method's load context types its configuration (EngineConfig), whose validators look methods
# up in the registry.
TYPING_ONLY_ALLOWED = {("engine.speculation.methods", "engine.config")}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(body: list[ast.stmt], module: str, package: bool, typing: bool) -> Iterator[str]:
    """Modules imported by the statements run at import time (functions' bodies are not);
    ``typing``: those under ``if TYPE_CHECKING:`` too."""
    for node in body:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".") if package else module.split(".")[:-1]
                parent = parent[: len(parent) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.If):
            if _is_type_checking(node):
                if typing:
                    yield from _imports(node.body, module, package, typing)
                yield from _imports(node.orelse, module, package, typing)
            else:
                yield from _imports(node.body, module, package, typing)
                yield from _imports(node.orelse, module, package, typing)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _imports(block, module, package, typing)
            for handler in node.handlers:
                yield from _imports(handler.body, module, package, typing)
        elif isinstance(node, ast.ClassDef):
            yield from _imports(node.body, module, package, typing)


def _graph(typing: bool) -> dict[str, set[str]]:
    paths = {_module(path): path for path in ENGINE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text("utf-8"))
        package = path.name == "__init__.py"
        found = set(_imports(tree.body, name, package, typing))
        graph[name] = {other for other in found if other in paths and other != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in order), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for other in sorted(graph[node]):
            if state.get(other) == 1:
                return [*path[path.index(other) :], other]
            if other not in state:
                found = visit(other)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_engine_imports_without_cycles() -> None:
    assert _cycle(_graph(typing=False)) is None


def test_nor_do_its_type_annotations_close_one() -> None:
    graph = _graph(typing=True)
    for source, target in TYPING_ONLY_ALLOWED:
        assert target in graph[source], f"{source} -> {target} is gone: drop it from the list"
        graph[source].discard(target)
    assert _cycle(graph) is None


def test_the_scheduler_does_not_know_the_engine() -> None:
    """It gets its admit and finish callbacks; the handles it queues are their own module's."""
    graph = _graph(typing=True)
    assert "engine.serving.service" not in graph["engine.serving.scheduler"]
    assert "engine.serving.request_handle" in graph["engine.serving.scheduler"]


def test_the_walk_sees_a_cycle() -> None:
    """Power check: a cycle planted in a copy of the graph is found."""
    graph = _graph(typing=False)
    graph["engine.serving.step"].add("engine.serving.scheduler")
    assert _cycle(graph) is not None
