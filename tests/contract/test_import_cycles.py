"""No import cycle inside our packages: the import graph is built from the source with ast."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# (directory, the package name it is imported as); the CLI package may live in
# tools/shardledger_cli/ (imported as shardledger_cli) or in tools/ (imported as tools.*).
PACKAGES = (
    (ROOT / "ledger_server", "ledger_server"),
    (ROOT / "shard_client", "shard_client"),
    (ROOT / "tools" / "shardledger_cli", "shardledger_cli"),
    (ROOT / "tools", "tools"),
)
SKIPPED = (ROOT / "shard_client" / "api",)  # generated stubs


def _module_files() -> dict[str, Path]:
    """Returns every module of our packages by dotted name."""
    modules: dict[str, Path] = {}
    for directory, package in PACKAGES:
        if not directory.is_dir():
            continue
        for path in sorted(directory.rglob("*.py")):
            if any(path.is_relative_to(skip) for skip in SKIPPED):
                continue
            parts = path.relative_to(directory).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            # tools/shardledger_cli/x.py is shardledger_cli.x, not tools.shardledger_cli.x.
            modules.setdefault(name, path)
    if "shardledger_cli" in modules:
        modules = {n: p for n, p in modules.items() if not n.startswith("tools.shardledger_cli")}
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Yields every import at module or function level, skipping `if TYPE_CHECKING:` bodies."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _imports_in(child)
            continue
        yield from _imports_in(node)


def _imports_in(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    else:
        yield from _imports(node)


def _targets(node: ast.Import | ast.ImportFrom, module: str, path: Path) -> Iterator[str]:
    """Yields the dotted names an import statement may load."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    base = node.module or ""
    if node.level:
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    yield base
    for alias in node.names:
        yield f"{base}.{alias.name}"


def _graph() -> dict[str, set[str]]:
    modules = _module_files()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, set())
        for node in _imports(ast.parse(path.read_text(), str(path))):
            base, *names = _targets(node, name, path)
            if isinstance(node, ast.ImportFrom):
                # `from pkg import submodule` loads the submodule; `from pkg import name`, pkg.
                targets = [t for t in names if t in modules] or [base]
            else:
                targets = [base, *names]
            edges.update(t for t in targets if t in modules and t != name)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """Returns one cycle as a path of module names, or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        on_path = [start]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_path.pop()
                done.add(node)
            elif child in on_path:
                return [*on_path[on_path.index(child) :], child]
            elif child not in done:
                stack.append((child, iter(sorted(graph.get(child, ())))))
                on_path.append(child)
    return None


def test_graph_sees_our_packages() -> None:
    graph = _graph()
    assert "ledger_server.servicer" in graph
    assert "shard_client.client" in graph
    assert not any(name.startswith("shard_client.api") for name in graph)
    assert "ledger_server.stream_append" in graph["ledger_server.server"]
    assert "ledger_server.servicer" in graph["ledger_server.stream_append"]


def test_cycle_finder_names_the_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _find_cycle(graph) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_our_packages() -> None:
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
