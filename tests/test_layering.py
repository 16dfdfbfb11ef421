"""One-way data flow: runtime/ is the bottom layer; tools/ and apps/ reach models only through it."""

import ast
import pkgutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package -> streamfuse packages it may import
ALLOWED = {
    "runtime": {"runtime", "adapters", "seams", "head_format"},  # adapters: the torch backend's model only
    "adapters": {"adapters", "seams", "head_format"},
    "metrics": {"metrics"},
    "export": {"export", "adapters", "runtime", "seams"},
    "training": {"training", "export", "adapters", "runtime", "metrics", "seams", "head_format"},  # the build: train, then export
    "tools": {"tools", "runtime", "metrics", "export", "adapters", "seams"},
    "apps": {"apps", "runtime"},
}


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "streamfuse" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_flow_one_way(package):
    for path in (ROOT / package).rglob("*.py"):
        bad = imported_packages(path) - ALLOWED[package]
        assert not bad, f"{path.relative_to(ROOT)} imports streamfuse.{sorted(bad)}: against the data flow"


# Folders whose files run as scripts (python export/build.py): Python puts the folder first on sys.path.
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
    for path in [*ROOT.glob("*.py"), *(p for package in ALLOWED for p in (ROOT / package).rglob("*.py"))]:
        assert "sys.path[" not in path.read_text() and "sys.path.insert" not in path.read_text(), path


def test_every_package_folder_goes_into_the_wheel():
    """The root folder is the package, so pyproject lists each subpackage: one left out imports from a
    checkout (the editable install finds it by path) but is missing from the wheel."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    skip = {".venv", "build", "tests", "artifacts", "bench", ".git"}
    folders = {path.parent.relative_to(ROOT) for path in ROOT.rglob("__init__.py")
               if not skip & set(path.relative_to(ROOT).parts)}
    expected = {".".join(("streamfuse", *folder.parts)): folder.as_posix() for folder in folders}
    assert set(setup["packages"]) == set(expected)
    assert setup["package-dir"] == expected


@pytest.mark.parametrize("module", ["seams.py", "head_format.py"])
def test_the_root_modules_import_no_streamfuse_module(module):
    assert imported_packages(ROOT / module) == set()
