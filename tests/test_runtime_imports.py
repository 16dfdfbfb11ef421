"""The runtime core (what a device app ships: runtime/ and the methods' runtime files) runs exported graphs with
numpy: no module of it imports torch, or the torch side of the project, when it is imported. Read from the source
with `ast` (offline, no import), then checked by importing every core module where torch cannot be imported.
Imports inside functions are allowed: the torch backend and the build reach torch code only when called."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Packages that bring torch, and the project's torch and training layers.
TORCH = ("torch", "torchao", "transformers", "peft", "accelerate", "executorch", "safetensors.torch")
FORBIDDEN = (*TORCH, "streamfuse.adapters", "streamfuse.export", "streamfuse.training")
# A method folder's files by layer: its runtime part (the METHOD it declares, its drafter, its pass on an engine's
# graph; the registry and Method are runtime/methods/), and the rest: the torch/export layer (its modules, its pass
# on a torch target, its graph export) and the training layer (its build part, stage, trainers, their data).
METHOD_RUNTIME_FILES = frozenset({"__init__.py", "drafter.py", "graph_pass.py"})
METHOD_BUILD_FILES = frozenset(
    {"model.py", "torch_pass.py", "graph.py", "build.py", "stage.py", "train.py", "heldout.py"}
)
# runtime/ modules that import torch at module level, with why they may (none: the core is torch-free).
EXCEPTIONS: dict[str, str] = {}


def core_files() -> list[Path]:
    """runtime/**.py (runtime/methods/ included) and the method folders' runtime files."""
    runtime = sorted((ROOT / "runtime").rglob("*.py"))
    methods = sorted(p for p in (ROOT / "methods").rglob("*.py") if p.name in METHOD_RUNTIME_FILES)
    return [p for p in runtime + methods if "__pycache__" not in p.parts]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("streamfuse", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def module_level_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import that runs when the module is imported: not those inside a function, nor
    under `if TYPE_CHECKING:`; class bodies and module-level if / try blocks run, so they count."""
    found = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.extend((node.lineno, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level == 0 and node.module:
                    found.append((node.lineno, node.module))
                    found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
            elif isinstance(node, ast.If) and _type_checking(node.test):
                visit(node.orelse)
            elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit(getattr(node, field, []))

    visit(ast.parse(source).body)
    return found


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def forbidden(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in FORBIDDEN)


def test_module_level_imports_rule_reads_what_runs_at_import():
    source = (
        "import numpy\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
        "try:\n    import transformers\nexcept ImportError:\n    pass\n"
        "class A:\n    from streamfuse.export import graph\n"
        "def f():\n    import torch\n"
        "from streamfuse import export\n"
    )
    imports = module_level_imports(source)
    assert sorted({line for line, module in imports if forbidden(module)}) == [6, 10, 13]
    assert "torch" not in [module for _, module in imports]


def test_every_method_file_has_a_layer():
    """A new kind of file in a method folder says which layer it belongs to (above), so the runtime's is checked."""
    unknown = [
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "methods").rglob("*.py")
        if p.name not in METHOD_RUNTIME_FILES | METHOD_BUILD_FILES
    ]
    assert not unknown, f"list these in METHOD_RUNTIME_FILES or METHOD_BUILD_FILES: {unknown}"


def test_core_files_are_found():
    names = {module_name(p) for p in core_files()}
    assert {
        "streamfuse.runtime.artifact.contract",
        "streamfuse.runtime.request.loader",
        "streamfuse.runtime.backends.static_graph",
        "streamfuse.runtime.methods.registry",
    } <= names
    assert not any(name.endswith((".model", ".torch_pass", ".build", ".train")) for name in names)


def test_runtime_core_imports_no_torch_at_module_level():
    offending = []
    for path in core_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in EXCEPTIONS:
            continue
        lines = {}
        for line, module in module_level_imports(path.read_text()):
            if forbidden(module):
                lines.setdefault(line, module)
        offending += [f"{rel}:{line} imports {module}" for line, module in sorted(lines.items())]
    assert not offending, (
        "the runtime core imports torch or the torch side at module level (import it inside the "
        "function that needs it, or move the code next to export/):\n" + "\n".join(offending)
    )


def test_exceptions_are_still_needed():
    for rel, why in EXCEPTIONS.items():
        assert why, f"{rel}: say why it may import torch"
        imports = module_level_imports((ROOT / rel).read_text())
        assert any(forbidden(module) for _, module in imports), f"{rel} no longer imports torch: drop its exception"


# Every core module imported in a fresh interpreter whose import of a TORCH package raises, as on a device
# without torch: printed as JSON {module: error or null}.
BLOCKED_IMPORT = """
import importlib, json, sys
BLOCKED = {blocked!r}

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"{{name}} is blocked: the runtime core must not need it")
        return None

sys.meta_path.insert(0, NoTorch())
errors = {{}}
for module in {modules!r}:
    try:
        importlib.import_module(module)
        errors[module] = None
    except Exception as error:
        errors[module] = f"{{type(error).__name__}}: {{error}}"
errors["loaded torch"] = sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED))
print(json.dumps(errors))
"""


def test_runtime_core_imports_without_torch():
    modules = sorted({module_name(p) for p in core_files() if p.relative_to(ROOT).as_posix() not in EXCEPTIONS})
    script = BLOCKED_IMPORT.format(blocked=TORCH, modules=modules)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.splitlines()[-1])
    assert results.pop("loaded torch") == []
    failed = {module: error for module, error in results.items() if error is not None}
    assert not failed, "runtime core modules that do not import without torch:\n" + "\n".join(
        f"{module}: {error}" for module, error in failed.items()
    )
    assert set(results) == set(modules)


@pytest.mark.parametrize("module", ["torch", "torch.nn", "transformers", "streamfuse.export.eager"])
def test_blocked_import_fails_as_on_a_device_without_torch(module):
    """The check above means something: under the same finder, torch (and what needs it) does not import."""
    script = BLOCKED_IMPORT.format(blocked=TORCH, modules=[module])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    error = json.loads(done.stdout.splitlines()[-1])[module]
    assert error is not None and "blocked" in error


def test_the_loader_reaches_torch_code_by_no_import_statement():
    """runtime/request/loader.py opens the torch backend through its entry point, at module level or inside a
    function."""
    tree = ast.parse((ROOT / "runtime" / "request" / "loader.py").read_text())
    modules = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    modules += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
    assert not [module for module in modules if forbidden(module)]


def test_the_torch_backend_is_an_entry_point():
    from streamfuse.export.eager import open_checkpoint
    from streamfuse.runtime.request.loader import open_backend

    assert open_backend("torch") is open_checkpoint


def test_a_backend_not_registered_is_one_line():
    from streamfuse.runtime.backends.runners import MissingBackend
    from streamfuse.runtime.request.loader import open_backend

    with pytest.raises(
        MissingBackend,
        match=r"^the tpu backend is not registered \(no entry point 'tpu' in group "
        r"streamfuse\.backends\): install it with `pip install",
    ) as error:
        open_backend("tpu")
    assert "\n" not in str(error.value)


def test_the_torch_backend_without_torch_is_one_line():
    script = (
        BLOCKED_IMPORT.format(blocked=TORCH, modules=[])
        + """
from streamfuse.runtime.backends.runners import MissingBackend
from streamfuse.runtime.request.loader import open_backend
try:
    open_backend("torch")
except MissingBackend as error:
    print(json.dumps(str(error)))
"""
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    message = json.loads(done.stdout.splitlines()[-1])
    assert message == (
        "the torch backend (streamfuse.export.eager:open_checkpoint) cannot be imported (torch is "
        "blocked: the runtime core must not need it); install it with `pip install 'streamfuse[torch]'`"
    )


def test_the_contract_stands_on_numpy_alone():
    """runtime/artifact/contract.py, which export and the runtime both read, imports the standard library, numpy and
    the tree spec only."""
    imports = module_level_imports((ROOT / "runtime" / "artifact" / "contract.py").read_text())
    project = {module for _, module in imports if module.startswith("streamfuse")}
    assert project <= {"streamfuse.runtime.speculation.tree", "streamfuse.runtime.speculation.tree.TreeSpec"}
    assert {module.split(".")[0] for _, module in imports} <= {
        "__future__",
        "collections",
        "dataclasses",
        "numpy",
        "streamfuse",
    }


def test_export_reads_the_contract_from_the_contract_module():
    """No export module takes a contract name from a backend's file (where it would be the contract's object)."""
    import importlib

    from streamfuse.runtime.artifact import contract

    misplaced = []
    for path in sorted((ROOT / "export").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("streamfuse.runtime.backends."):
                module = importlib.import_module(node.module)
                misplaced += [
                    f"{path.relative_to(ROOT)}:{node.lineno} {alias.name} from {node.module}"
                    for alias in node.names
                    if getattr(module, alias.name, None) is getattr(contract, alias.name, object())
                ]
    assert not misplaced, "import these from streamfuse.runtime.artifact.contract:\n" + "\n".join(misplaced)
