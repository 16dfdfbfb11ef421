"""streamfuse/seams.py: every private API of a dependency in one module, each at the version it was tested with."""

import re
import warnings
from pathlib import Path

import pytest
import tomllib

from streamfuse import seams

ROOT = Path(__file__).resolve().parents[1]
# Private names of dependencies: only seams.py may spell them.
PRIVATE = (
    "_unsafe_reset_threadpool",
    "set_optionEPKc",
    "_named_data_store",
    "backend_api",
    "_check_ir_validity",
    "NodeSource",
    "mkldnn._",
    "_attn_implementation",
    "_TORCH_OPS_REGISTRY",
    "_get_inputs",
    "_portable_lib",
    "_load_for_executorch",
    "XNNPACKPassManager",
)


def pinned() -> dict[str, str]:
    """package -> the version pyproject pins with == (a local tag such as +cpu dropped)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = [*project["dependencies"], *(s for extra in project["optional-dependencies"].values() for s in extra)]
    return {m[1].lower(): m[2].split("+")[0] for s in specs if (m := re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", s))}


@pytest.mark.parametrize("name", sorted(seams.SEAMS))
def test_each_seam_is_written_for_the_pinned_and_installed_version(name):
    """Fails when a pin moves: re-check the seam against the new version, then update its version here."""
    seam = seams.SEAMS[name]
    assert pinned().get(seam.package) == seam.version, f"{seam.package} is pinned to another version than {name}'s"
    installed = seams.installed_version(seam.package)
    if installed is None:
        pytest.skip(f"{seam.package} is not installed here")
    assert installed == seam.version


def test_no_other_module_touches_a_private_name():
    offenders = []
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if parts[0] in (".venv", "build", "tests") or path.name == "seams.py":
            continue
        text = path.read_text()
        offenders += [f"{path.relative_to(ROOT)}: {name}" for name in PRIVATE if name in text]
    assert not offenders, offenders


def test_a_seam_under_another_version_warns_once(monkeypatch):
    monkeypatch.setattr(seams, "installed_version", lambda package: "0.0.1")
    monkeypatch.setattr(seams, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="written for 2.13.0; 0.0.1 is installed"):
        seams.check("torch-mkldnn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        seams.check("torch-mkldnn")  # once only
