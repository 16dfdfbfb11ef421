"""No import circle in streamfuse: the module graph, read from the source with `ast`, has no cycle.

Every `import` statement counts, those inside functions too (a deferred import still ties two modules
together), except those under `if TYPE_CHECKING:`, which never run. Importing `a.b.c` also runs the
`__init__` of its packages `a.b` and `a`, so those are edges too (not from a package's own submodules,
which run while their package is already imported).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "streamfuse"
CORE = ("streamfuse.runtime", "streamfuse.methods")  # must hold no circle, whatever the rest does
SKIP = {"tests", "build", "checkpoints", "artifacts"}  # not package code (tests import everything)


def package_modules(root: Path = ROOT, name: str = PACKAGE) -> dict[str, Path]:
    """Module name -> file, for every .py file reachable through folders with an `__init__.py`."""
    modules = {name: root / "__init__.py"}
    for path in sorted(root.glob("*.py")):
        if path.name != "__init__.py":
            modules[f"{name}.{path.stem}"] = path
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        if folder.name not in SKIP and (folder / "__init__.py").is_file():
            modules.update(package_modules(folder, f"{name}.{folder.name}"))
    return modules


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except the body of `if TYPE_CHECKING:` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _type_checking(node.test):
            for child in node.orelse:
                yield from import_nodes(ast.Module(body=[child], type_ignores=[]))
        else:
            yield from import_nodes(node)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module an ImportFrom names, relative levels resolved against the importing module."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    base = parts[: len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterator[str]:
    """The dotted names an import statement may load: each module, and for `from m import x`, `m.x`."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    source = _absolute(node, module, is_package)
    yield source
    yield from (f"{source}.{alias.name}" for alias in node.names)


def import_graph(modules: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Module -> the package modules it imports, with the package `__init__`s that import runs."""
    modules = package_modules() if modules is None else modules
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        for node in import_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            for target in imported(node, name, is_package):
                parts = target.split(".")
                for cut in range(1, len(parts) + 1):  # the target and the packages it runs
                    prefix = ".".join(parts[:cut])
                    if prefix in modules and prefix not in own:
                        graph[name].add(prefix)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module (or one importing itself), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))
    return found


def shortest_cycle(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """A shortest circle through the component's first module, as `a, b, ..., a`."""
    inside = set(members)
    start = members[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & inside):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no circle through {start}")


def cycles(graph: dict[str, set[str]], within: tuple[str, ...] = ("",)) -> list[str]:
    """One line per tangle of modules importing each other that touches a module under `within`: its
    shortest circle `a -> b -> a` and, where more modules are tied in, how many."""
    lines = []
    for members in strongly_connected(graph):
        if any(m.startswith(prefix) for m in members for prefix in within):
            circle = shortest_cycle(graph, members)
            line = " -> ".join(_short(m) for m in circle)
            if len(members) > len(circle) - 1:
                line += f" ({len(members)} modules tied: {', '.join(map(_short, members))})"
            lines.append(line)
    return lines


def _short(module: str) -> str:
    return module.split(".", 1)[-1]


# --- the reader itself, on literal sources ---------------------------------------------------------


def _graph_of(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for relative, text in {"__init__.py": "", **files}.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    return import_graph(package_modules(tmp_path, "pkg"))


def test_reader_counts_deferred_imports_and_skips_type_checking(tmp_path):
    graph = _graph_of(
        tmp_path,
        {
            "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n"
            "def f():\n    from pkg.c import thing\n",
            "b.py": "import pkg.a\n",
            "c.py": "from . import b\n",
        },
    )
    assert graph["pkg.a"] == {"pkg.c"}
    assert graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.c"] == {"pkg.b"}
    assert cycles(graph) == ["a -> c -> b -> a"]


def test_reader_finds_circles_through_package_inits(tmp_path):
    graph = _graph_of(
        tmp_path,
        {
            "sub/__init__.py": "from pkg.sub.x import X\n",
            "sub/x.py": "X = 1\nfrom pkg import y\n",
            "y.py": "from pkg.sub.z import Z\n",  # runs sub/__init__, which imports x, which imports y
            "sub/z.py": "Z = 2\n",
            "w.py": "if TYPE_CHECKING:\n    import pkg.y\nelse:\n    import pkg.sub.z\n",
        },
    )
    assert graph["pkg.sub.x"] == {"pkg.y"}  # not its own package's __init__
    assert graph["pkg.y"] == {"pkg.sub", "pkg.sub.z"}
    assert graph["pkg.w"] == {"pkg.sub", "pkg.sub.z"}
    assert cycles(graph) == ["sub -> sub.x -> y -> sub"]


def test_reader_resolves_relative_imports(tmp_path):
    graph = _graph_of(
        tmp_path,
        {"sub/__init__.py": "", "sub/a.py": "from ..b import c\nfrom .d import e\n", "b.py": "", "sub/d.py": ""},
    )
    assert graph["pkg.sub.a"] == {"pkg.b", "pkg.sub.d"}
    assert cycles(graph) == []


# --- the project --------------------------------------------------------------------------------


def test_runtime_and_methods_have_no_import_circle():
    found = cycles(import_graph(), CORE)
    assert not found, "import circles in runtime/ or methods/:\n" + "\n".join(found)


def test_package_has_no_import_circle():
    found = cycles(import_graph())
    assert not found, "import circles in streamfuse:\n" + "\n".join(found)
