"""A method is named in its own folder and the registry only: no other module holds its name as a string, so
adding, renaming or removing a method touches one folder (tests aside, which name what they test)."""

import ast
import subprocess
from pathlib import Path

from streamfuse.runtime.methods import registry

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = ("methods", "tests")  # each method's folder and the tests
REGISTRY = "runtime/methods/registry.py"  # BUILT_IN: the registry's one line per built-in method


def sources() -> list[Path]:
    """The tree's Python files (those git tracks or would), outside the allowed folders."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [
        ROOT / rel for rel in listed if Path(rel).parts[0] not in ALLOWED and rel != REGISTRY and (ROOT / rel).is_file()
    ]


def named_methods(path: Path, names: set[str]) -> list[str]:
    """'line: name' for each string constant in `path` that equals a method's name (an f-string's parts too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    hits = [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    ]
    return [f"{line}: {name}" for line, name in sorted(hits)]


def test_the_reader_finds_a_method_name_in_code_and_not_in_prose(tmp_path):
    source = tmp_path / "example.py"
    source.write_text('"""Runs ss."""\nMETHOD = "ss"\nLABEL = f"{METHOD}: ss"\nOTHER = "ssx"\n')
    assert named_methods(source, {"ss"}) == ["2: ss"]


def test_no_module_outside_the_methods_names_a_method():
    names = set(registry.names())
    found = {str(path.relative_to(ROOT)): hits for path in sources() if (hits := named_methods(path, names))}
    listing = "\n".join(f"  {path}: {', '.join(hits)}" for path, hits in sorted(found.items()))
    assert not found, (
        f"method names as strings outside methods/ and the registry (it has plain(), default()):\n{listing}"
    )
