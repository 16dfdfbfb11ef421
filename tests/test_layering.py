"""One-way data flow: training -> export -> runtime (its contract); tools and apps -> runtime; nothing imports a
command's module. A method's folder (methods/<name>/) spans the layers: each of its files belongs to the layer of
its kind (METHOD_FILES)."""

import ast
import pkgutil
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("runtime", "adapters", "metrics", "export", "training", "tools", "apps")
BASE = {"seams", "head_format"}  # root modules every layer may use; they import no streamfuse module
# layer -> the layers it may import
ALLOWED = {
    "runtime": {"runtime", "base"},  # the shipped core: no torch model, no export, no training
    "adapters": {"adapters", "base"},
    "metrics": {"metrics"},
    "export": {"export", "adapters", "runtime", "base"},
    "training": {"training", "export", "adapters", "runtime", "metrics", "base"},
    "tools": {"tools", "runtime", "metrics", "export", "adapters", "base"},  # measurement tools time torch too
    "apps": {"apps", "runtime"},
    # the console script, and export/build.py (the build run by path, through it): runtime.commands.errors; a command's
    # module only when it runs (by name)
    "cli": {"cli", "runtime"},
}
ENTRY_SCRIPTS = {"cli.py", "export/build.py"}  # the layer "cli"
# a method folder's files, by name -> their layer
METHOD_FILES = {
    "__init__": "runtime",
    "drafter": "runtime",
    "graph_pass": "runtime",
    "model": "adapters",
    "torch_pass": "export",
    "graph": "export",
    "build": "training",
    "train": "training",
    "stage": "training",
    "heldout": "training",
}


def layer_of_file(path: Path) -> str:
    rel = path.relative_to(ROOT)
    if rel.as_posix() in ENTRY_SCRIPTS:
        return "cli"
    if rel.parts[0] == "methods":
        assert path.stem in METHOD_FILES, f"{rel}: give its kind a layer in METHOD_FILES"
        return METHOD_FILES[path.stem]
    if len(rel.parts) == 1:
        return "base" if path.stem in BASE else "root"
    return rel.parts[0]


def layer_of_module(name: str) -> str | None:
    """The layer of a dotted streamfuse module (None: not streamfuse's or the package itself)."""
    parts = name.split(".")
    if parts[0] != "streamfuse" or len(parts) == 1:
        return None
    path = ROOT.joinpath(*parts[1:])
    file = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
    if not file.is_file():
        return layer_of_module(".".join(parts[:-1]))  # a name inside a module
    return layer_of_file(file)


def imports(path: Path) -> list[str]:
    """Every streamfuse module an import statement in the file names, those inside functions included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [f"{node.module}.{alias.name}" for alias in node.names]
    return [name for name in found if name.startswith("streamfuse.")]


def source_files() -> list[Path]:
    return [*ROOT.glob("*.py"), *(p for folder in (*FOLDERS, "methods") for p in (ROOT / folder).rglob("*.py"))]


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_flow_one_way(path):
    layer = layer_of_file(path)
    if layer == "root":
        return
    allowed = ALLOWED.get(layer, {layer})
    for name in imports(path):
        target = layer_of_module(name)
        assert target is None or target in allowed, (
            f"{path.relative_to(ROOT)} ({layer}) imports {name} ({target}): against the data flow"
        )


def command_modules() -> set[str]:
    """The modules the console script runs (cli.py's table): entry points, which nothing imports."""
    return set(re.findall(r'"(streamfuse\.[\w.]+)"', (ROOT / "cli.py").read_text()))


def test_nothing_imports_a_command_module():
    commands = command_modules()
    assert "streamfuse.runtime.commands.generate" in commands and "streamfuse.training.build" in commands
    for path in source_files():
        bad = [name for name in imports(path) if name in commands or name.rpartition(".")[0] in commands]
        assert not bad, (
            f"{path.relative_to(ROOT)} imports the command module(s) {bad}: move what it needs into a library"
        )


# Folders whose files run as scripts (python tools/x.py): Python puts the folder first on sys.path.
SCRIPT_FOLDERS = ("export", "training", "tools", "apps")


@pytest.mark.parametrize("folder", SCRIPT_FOLDERS)
def test_no_module_shadows_an_installed_or_standard_one(folder):
    """So no entry script needs to edit sys.path: a module here named like one of the standard
    library or an installed package would be imported in its place by everything the script runs."""
    elsewhere = {m.name for m in pkgutil.iter_modules() if Path(m.module_finder.path).resolve() != ROOT / folder}
    ours = {path.stem for path in (ROOT / folder).glob("*.py")} - {"__init__"}
    clashes = ours & (elsewhere | set(sys.stdlib_module_names))
    assert not clashes, f"{folder}/ modules {sorted(clashes)} shadow top-level modules: rename them"


def test_no_source_edits_sys_path():
    for path in source_files():
        assert "sys.path[" not in path.read_text() and "sys.path.insert" not in path.read_text(), path


def test_every_package_folder_goes_into_the_wheel():
    """The root folder is the package, so pyproject lists each subpackage: one left out imports from a
    checkout (the editable install finds it by path) but is missing from the wheel."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    skip = {".venv", "build", "tests", "artifacts", "bench", ".git"}
    folders = {
        path.parent.relative_to(ROOT)
        for path in ROOT.rglob("__init__.py")
        if not skip & set(path.relative_to(ROOT).parts)
    }
    expected = {".".join(("streamfuse", *folder.parts)): folder.as_posix() for folder in folders}
    assert set(setup["packages"]) == set(expected)
    assert setup["package-dir"] == expected


@pytest.mark.parametrize("module", ["seams.py", "head_format.py"])
def test_the_root_modules_import_no_streamfuse_module(module):
    assert imports(ROOT / module) == []
