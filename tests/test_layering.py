"""Arrows point down (issue 12.2): the import graph of the package, read from the source with ``ast``.

Every ``import`` counts, including those inside functions (a lazy import is still a dependency, and a cycle
through one is still a cycle); only ``if TYPE_CHECKING:`` blocks are skipped. Importing ``a.b.c`` also runs the
packages ``a.b`` and ``a`` (unless the importer already lives inside them), so those count as edges too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lilicorr_pl", "callbacks")

# Lowest first: a module may import its own layer and the layers below it, never one above.
LAYERS = [
    ("plumbing", ("lilicorr_pl.files", "lilicorr_pl.progress", "lilicorr_pl.checkpoint", "lilicorr_pl.optim",
                  "lilicorr_pl.allocator")),
    ("parts", ("lilicorr_pl.models", "lilicorr_pl.heads", "lilicorr_pl.losses", "lilicorr_pl.target",
               "lilicorr_pl.metrics", "lilicorr_pl.data", "lilicorr_pl.interop")),
    ("decoding", ("lilicorr_pl.decoding",)),
    ("system", ("lilicorr_pl.system",)),
    ("edge", ("callbacks", "lilicorr_pl.cli", "lilicorr_pl.command", "lilicorr_pl.lightning_cli",
              "lilicorr_pl.builtin", "lilicorr_pl.bench", "lilicorr_pl.export", "lilicorr_pl.perf", "lilicorr_pl.demo",
              "lilicorr_pl.__main__")),
]
# Edge modules every command may use: how commands are parsed and how `builtin:` names resolve.
SHARED_EDGE = ("lilicorr_pl.command", "lilicorr_pl.lightning_cli", "lilicorr_pl.builtin")
DISPATCH = ("lilicorr_pl.cli", "lilicorr_pl.__main__")  # `lilicorr <subcommand>` imports the subcommand it runs


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _imported_names(module: str, path: Path) -> list[str]:
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if _is_type_checking(node):
            return
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            names.append(base)
            names.extend(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules importing it runs (ancestor packages included)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in mods.items():
        deps: set[str] = set()
        for name in _imported_names(module, path):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            # Running a.b.c runs a.b first, unless the importer is already inside a.b (then a.b is running already).
            while name:
                if name in mods and not (module == name or module.startswith(name + ".")):
                    deps.add(name)
                name = name.rpartition(".")[0]
        graph[module] = deps
    return graph


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _unit(module: str) -> list[str]:
    """The package a module belongs to: ``lilicorr_pl.demo`` for ``lilicorr_pl.demo.run``, ``callbacks`` for its own."""
    parts = module.split(".")
    return parts[:2] if parts[0] == "lilicorr_pl" else parts[:1]


def layer_of(module: str) -> int:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if _within(module, prefixes):
            return rank
    if module == "lilicorr_pl":
        return 0
    raise AssertionError(f"{module} belongs to no layer; add it to LAYERS in tests/test_layering.py")


GRAPH = import_graph()
CORE = sorted(m for m in GRAPH if layer_of(m) < len(LAYERS) - 1)


def test_the_walk_sees_lazy_imports_and_parent_packages():
    # bench imports the system inside a function; `lilicorr_pl.heads.lilicorr` runs `lilicorr_pl.heads` first.
    assert "lilicorr_pl.system" in GRAPH["lilicorr_pl.bench"]
    assert {"lilicorr_pl.heads", "lilicorr_pl.heads.lilicorr"} <= GRAPH["lilicorr_pl.interop"]
    assert "lilicorr_pl.data.corpus" in GRAPH["lilicorr_pl.decoding.benchmarks"]


@pytest.mark.parametrize("module", CORE)
def test_the_core_never_imports_the_demo_or_a_command(module):
    upward = sorted(d for d in GRAPH[module] if layer_of(d) == len(LAYERS) - 1)
    assert not upward, f"{module} (core) imports {upward}: builtin: names are resolved at the command edge"


def test_every_arrow_points_down():
    wrong = sorted(
        f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})"
        for a, deps in GRAPH.items() for b in deps if layer_of(b) > layer_of(a)
    )
    assert not wrong, "imports that point up:\n" + "\n".join(wrong)


def test_commands_use_the_core_never_each_others_internals():
    edge = len(LAYERS) - 1
    wrong = []
    for a, deps in GRAPH.items():
        if layer_of(a) != edge or _within(a, DISPATCH):
            continue
        for b in deps:
            if layer_of(b) != edge or _within(b, SHARED_EDGE) or b == "lilicorr_pl.demo":
                continue
            same_package = _unit(a) == _unit(b)  # demo.run -> demo.tiny_target, callbacks -> callbacks.acceptance
            builtin_targets = (a, b) == ("lilicorr_pl.builtin", "lilicorr_pl.demo.tiny_target")
            if not (same_package or builtin_targets):
                wrong.append(f"{a} -> {b}")
    assert not wrong, "commands importing each other:\n" + "\n".join(sorted(wrong))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None (iterative DFS, white/grey/black)."""
    state: dict[str, int] = {}
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                stack.append((child, iter(sorted(graph.get(child, ())))))
                path.append(child)
    return None


def test_no_import_cycles():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
