"""No import circle in streamfuse: the module graph, read from the source with `ast`, has no cycle.

Every `import` statement counts, those inside functions too (a deferred import still ties two modules
together); those under `if TYPE_CHECKING:` never run, but the whole package's test and runtime/'s order count
them too, as a drawing tool of the package draws them. Importing `a.b.c` also runs the
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


def import_nodes(tree: ast.AST, type_checking: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except the body of `if TYPE_CHECKING:` blocks unless type_checking (a
    drawing tool reads those too)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _type_checking(node.test) and not type_checking:
            for child in node.orelse:
                yield from import_nodes(ast.Module(body=[child], type_ignores=[]))
        else:
            yield from import_nodes(node, type_checking)


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


def import_graph(modules: dict[str, Path] | None = None, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports, with the package `__init__`s that import runs (type_checking: and
    those imported under `if TYPE_CHECKING:`)."""
    modules = package_modules() if modules is None else modules
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        for node in import_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path)), type_checking):
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


# --- runtime/ by job --------------------------------------------------------------------------------

# runtime/'s sub-packages, bottom first: each imports its own modules and those of the sub-packages before it only
RUNTIME = "streamfuse.runtime"
RUNTIME_ORDER = ("ops", "speculation", "methods", "artifact", "backends", "request", "measure", "commands")


def subpackage(module: str, runtime: str = RUNTIME) -> str | None:
    """The runtime sub-package a module lies in (None: outside runtime/, or runtime's own `__init__`)."""
    parts, root = module.split("."), runtime.split(".")
    return parts[len(root)] if len(parts) > len(root) and parts[: len(root)] == root else None


def arrows_up(graph: dict[str, set[str]], order: tuple[str, ...], runtime: str = RUNTIME) -> list[str]:
    """One line per import from a runtime module to a sub-package after its own in `order`, per import of a method
    folder (they import the runtime; the registry finds them by name) and per module in no sub-package of `order`."""
    rank = {name: i for i, name in enumerate(order)}
    methods = runtime.rpartition(".")[0] + ".methods"
    found = []
    for module, targets in sorted(graph.items()):
        source = subpackage(module, runtime)
        if source is None:
            continue
        if source not in rank:
            found.append(f"{_short(module)} lies in no sub-package of the order: place it in one")
            continue
        for target in sorted(targets):
            into = subpackage(target, runtime)
            if target == methods or target.startswith(methods + "."):
                found.append(f"{_short(module)} ({source}) imports the method folder {_short(target)}")
            elif into is not None and rank.get(into, len(order)) > rank[source]:
                found.append(f"{_short(module)} ({source}) imports {_short(target)} ({into}): an arrow back up")
    return found


def subpackage_graph(graph: dict[str, set[str]], runtime: str = RUNTIME) -> dict[str, set[str]]:
    """Sub-package -> the other runtime sub-packages its modules import."""
    between: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = subpackage(module, runtime)
        if source is not None:
            into = {subpackage(t, runtime) for t in targets} - {None, source}
            between.setdefault(source, set()).update(into)
            for target in into:
                between.setdefault(target, set())
    return between


# --- the reader itself, on literal sources ---------------------------------------------------------


def _graph_of(tmp_path: Path, files: dict[str, str], type_checking: bool = False) -> dict[str, set[str]]:
    for relative, text in {"__init__.py": "", **files}.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    return import_graph(package_modules(tmp_path, "pkg"), type_checking)


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


def test_reader_finds_arrows_back_up_between_runtime_subpackages(tmp_path):
    files = {
        "runtime/__init__.py": "",
        "runtime/low/__init__.py": "",
        "runtime/low/a.py": "",
        "runtime/high/__init__.py": "",
        "runtime/high/b.py": "from pkg.runtime.low import a\n",
    }
    graph = _graph_of(tmp_path, files)
    assert arrows_up(graph, ("low", "high"), "pkg.runtime") == []
    assert arrows_up(graph, ("high", "low"), "pkg.runtime") == [
        "runtime.high.b (high) imports runtime.low (low): an arrow back up",
        "runtime.high.b (high) imports runtime.low.a (low): an arrow back up",
    ]
    files["runtime/low/c.py"] = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.runtime.high import b\n"
    )
    files["runtime/flat.py"] = "def f():\n    import pkg.methods.ss\n"
    files["methods/__init__.py"] = files["methods/ss.py"] = ""
    graph = _graph_of(tmp_path, files, type_checking=True)
    assert arrows_up(graph, ("low", "high"), "pkg.runtime") == [
        "runtime.flat lies in no sub-package of the order: place it in one",
        "runtime.low.c (low) imports runtime.high (high): an arrow back up",
        "runtime.low.c (low) imports runtime.high.b (high): an arrow back up",
    ]
    assert subpackage_graph(graph, "pkg.runtime") == {"low": {"high"}, "high": {"low"}, "flat": set()}
    assert cycles(subpackage_graph(graph, "pkg.runtime")) == ["high -> low -> high"]


# --- the project --------------------------------------------------------------------------------


def test_runtime_and_methods_have_no_import_circle():
    found = cycles(import_graph(), CORE)
    assert not found, "import circles in runtime/ or methods/:\n" + "\n".join(found)


def test_package_has_no_import_circle():
    """Not even through imports under TYPE_CHECKING: a drawing tool of the package draws those too."""
    found = cycles(import_graph(type_checking=True))
    assert not found, "import circles in streamfuse:\n" + "\n".join(found)


def test_runtime_subpackages_import_downward_only():
    """runtime/ by job: every import (deferred ones and those under TYPE_CHECKING included, as a drawing tool
    reads them) goes to the module's own sub-package or one before it in RUNTIME_ORDER, so the sub-packages'
    graph has no arrow back up and no circle; and no runtime module lies outside them."""
    graph = import_graph(type_checking=True)
    found = arrows_up(graph, RUNTIME_ORDER)
    assert not found, "runtime/ imports against RUNTIME_ORDER:\n" + "\n".join(found)
    between = subpackage_graph(graph)
    assert set(between) == set(RUNTIME_ORDER), "a sub-package of runtime/ is missing from RUNTIME_ORDER, or gone"
    assert not cycles(between), cycles(between)
    assert not cycles(graph, (RUNTIME,)), cycles(graph, (RUNTIME,))
