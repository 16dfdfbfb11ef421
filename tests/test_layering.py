"""One-way data flow: runtime/ is the bottom layer; tools/ and apps/ reach models only through it."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package -> streamfuse packages it may import
ALLOWED = {
    "runtime": {"runtime", "adapters"},
    "adapters": {"adapters"},
    "export": {"export", "adapters", "runtime", "tools"},  # the build profiles its artifact
    "tools": {"tools", "runtime"},
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
