"""The kernels are compiled when streamfuse is built or installed (runtime/ops/kernel_build.py, setup.py) and only
loaded at run time: what a build records and when it recompiles (a fake compiler: no real compile), every way a
built library can fail to fit this process (a one-line error naming the fix), the wheel's contents, its libraries
and the checkout's loading with no compiler on PATH, and a fresh venv decoding `make build`'s artifact from it."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import tomllib

from streamfuse import seams
from streamfuse.runtime.ops import kernel_build as kb
from streamfuse.runtime.ops import kernel_library as kl

ROOT = Path(__file__).resolve().parents[1]
HAS_EXECUTORCH = kl.installed_version("executorch") is not None
NAMES = ["c", "onnxruntime", *(["executorch"] if HAS_EXECUTORCH else [])]

# A stand-in for g++: writes its command line as the "library" and logs which sources it compiled.
FAKE_COMPILER = """#!{python}
import os, pathlib, sys, time
args = sys.argv[1:]
if args == ["--version"]:
    sys.exit(print("fakec++ 1.0"))
sources = " ".join(sorted(pathlib.Path(a).name for a in args if a.endswith(".cpp")))
with open(os.environ["FAKE_CXX_LOG"], "a") as log:
    log.write("start " + sources + "\\n")
time.sleep(float(os.environ.get("FAKE_CXX_SLEEP", "0")))
if os.environ.get("FAKE_CXX_FAIL"):
    sys.exit(print("x.cpp:1:1: error: " + os.environ["FAKE_CXX_FAIL"], file=sys.stderr) or 1)
pathlib.Path(args[args.index("-o") + 1]).write_bytes(" ".join(args).encode())
with open(os.environ["FAKE_CXX_LOG"], "a") as log:
    log.write("end " + sources + "\\n")
"""
SOURCE_OF = {source: name for name, library in kl.LIBRARY.items() for source in library.sources}


class FakeBuild:
    def __init__(self, root: Path, monkeypatch):
        self.sources, self.lib, self.log = root / "src", root / "lib", root / "compiled.log"
        shutil.copytree(kl.SOURCES, self.sources, ignore=shutil.ignore_patterns("lib"))  # a snapshot to edit
        compiler = root / "fakec++"
        compiler.write_text(FAKE_COMPILER.format(python=sys.executable))
        compiler.chmod(0o755)
        monkeypatch.setattr(kl, "SOURCES", self.sources)
        monkeypatch.setattr(kl, "LIBRARIES", self.lib)
        monkeypatch.setenv("CXX", str(compiler))
        monkeypatch.setenv("FAKE_CXX_LOG", str(self.log))
        monkeypatch.delenv(kl.PORTABLE, raising=False)

    def build(self) -> dict[str, Path]:
        return kb.build(self.lib, seams.executorch_runtime_library, log=lambda line: None)

    def compiled(self) -> set[str]:
        """The libraries compiled since the last call."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        self.log.unlink(missing_ok=True)
        return {SOURCE_OF[line.split()[1]] for line in lines if line.startswith("end")}

    def manifest(self) -> dict:
        return json.loads((self.lib / kl.MANIFEST).read_text())

    def edit(self, name: str, entry: dict) -> None:
        manifest = self.manifest()
        manifest["libraries"][name].update(entry)
        (self.lib / kl.MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def fake(tmp_path, monkeypatch) -> FakeBuild:
    return FakeBuild(tmp_path, monkeypatch)


def test_a_build_records_what_each_library_was_built_against(fake):
    built = fake.build()
    assert sorted(built) == sorted(NAMES) and fake.compiled() == set(NAMES)
    entries = fake.manifest()["libraries"]
    assert sorted(entries) == sorted(NAMES)
    for name, entry in entries.items():
        path = fake.lib / entry["file"]
        assert entry["sources"] == kl.source_hash(name) and entry["compiler"] == "fakec++ 1.0"
        assert entry["flags"][: len(kb.FLAGS)] == kb.FLAGS and entry["sha256"] == kl.sha256_of(path)
        assert ("-mavx2" in entry["flags"]) == ("avx2" in entry["cpu_features"])
        assert stat.S_IMODE(path.stat().st_mode) == 0o755 and kl.library_path(name) == path
    assert entries["c"]["built_for"] == {} and entries["onnxruntime"]["built_for"] == {"onnxruntime_api": 17}
    if HAS_EXECUTORCH:
        versions = {p: kl.installed_version(p) for p in ("executorch", "torch")}
        assert entries["executorch"]["built_for"] == versions
    assert {p.name for p in fake.lib.iterdir()} == {kl.MANIFEST, *(e["file"] for e in entries.values())}


# source edited between two builds -> the libraries the second build compiles
EDITS = [
    (None, set()),
    ("tree_attention_ort.cpp", {"onnxruntime"}),
    ("q8_linear_c.cpp", {"c"}),
    ("tree_attention.h", set(NAMES)),  # every library includes every header
]


@pytest.mark.parametrize("edited, recompiled", EDITS)
def test_a_build_compiles_only_the_libraries_whose_sources_changed(fake, edited, recompiled):
    fake.build()
    fake.compiled()
    if edited:
        with open(fake.sources / edited, "a") as source:
            source.write("// edited\n")
        with pytest.raises(kl.KernelUnavailable, match="built from other sources"):
            kl.library_path(SOURCE_OF.get(edited, "c"))
    fake.build()
    assert fake.compiled() == recompiled
    assert all(kl.library_path(name) for name in NAMES)


@pytest.mark.skipif(not HAS_EXECUTORCH, reason="executorch is not installed here")
def test_a_build_without_executorch_keeps_its_library_in_place_but_not_in_a_package(fake):
    fake.build()
    kb.build(fake.lib, None, log=lambda line: None)  # pip's isolated build of an editable install
    assert kl.library_path("executorch")
    kb.build(fake.lib, None, log=lambda line: None, only_these=True)  # a wheel's: this build's libraries only
    assert sorted(fake.manifest()["libraries"]) == ["c", "onnxruntime"]
    assert not (fake.lib / kl.LIBRARY["executorch"].file).exists()
    with pytest.raises(kl.KernelUnavailable, match="executorch kernel library is not built"):
        kl.library_path("executorch")


def test_a_portable_build_requires_no_cpu_feature(fake, monkeypatch):
    fake.build()
    fake.compiled()
    native = fake.manifest()["libraries"]["c"]
    assert native["cpu_features"] == (
        ["avx2"] if "avx2" in kl.cpu_features() and kl.platform.machine() in ("x86_64", "AMD64") else []
    )
    monkeypatch.setenv(kl.PORTABLE, "1")
    fake.build()
    portable = fake.manifest()["libraries"]["c"]
    assert portable["cpu_features"] == [] and "-mavx2" not in portable["flags"]
    assert fake.compiled() == (set(NAMES) if native["cpu_features"] else set())


def test_without_a_compiler_the_build_is_one_line_and_leaves_nothing(fake, monkeypatch):
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(kb.shutil, "which", lambda name: None)
    with pytest.raises(kl.KernelUnavailable, match=r"needs a C\+\+ compiler and none is on PATH: install g\+\+") as e:
        fake.build()
    assert "\n" not in str(e.value) and not fake.lib.exists()


def test_a_compiler_that_does_not_run_is_one_line(fake, monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(kl.KernelUnavailable, match="CXX=.*no-such-c\\+\\+ is not an executable compiler") as e:
        fake.build()
    assert "\n" not in str(e.value) and not fake.lib.exists()


def test_a_failed_compile_is_one_line_keeps_the_last_good_build_and_leaves_no_temporary(fake, monkeypatch):
    fake.build()
    fake.compiled()
    with open(fake.sources / "tree_attention_ort.cpp", "a") as source:
        source.write("// edited\n")
    monkeypatch.setenv("FAKE_CXX_FAIL", "boom")
    with pytest.raises(kl.KernelUnavailable, match="onnxruntime kernel library failed: .*error: boom$") as error:
        fake.build()
    assert "\n" not in str(error.value)
    entries = fake.manifest()["libraries"]
    assert {p.name for p in fake.lib.iterdir()} == {kl.MANIFEST, *(e["file"] for e in entries.values())}
    assert kl.library_path("c")  # untouched and still current
    with pytest.raises(kl.KernelUnavailable, match="onnxruntime kernel library was built from other sources"):
        kl.library_path("onnxruntime")


def test_concurrent_builds_of_one_folder_take_turns(fake, monkeypatch):
    monkeypatch.setenv("FAKE_CXX_SLEEP", "0.2")
    errors = []
    threads = [threading.Thread(target=lambda: errors.extend(_raised(fake.build))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = fake.log.read_text().splitlines()
    assert not errors and len(lines) == 2 * len(NAMES)  # one build compiled everything, the other found it current
    assert all(
        a.split()[1:] == b.split()[1:] and a.startswith("start") and b.startswith("end")
        for a, b in zip(lines[::2], lines[1::2])
    )  # never two compiles at once
    assert all(kl.library_path(name) for name in NAMES)


def _raised(function) -> list[Exception]:
    try:
        function()
    except Exception as error:  # noqa: BLE001  (reported by the test)
        return [error]
    return []


def _no_manifest(fake):
    (fake.lib / kl.MANIFEST).unlink()


def _write(fake, text):
    (fake.lib / kl.MANIFEST).write_text(text)


def _lose_file(fake):
    (fake.lib / kl.LIBRARY["onnxruntime"].file).unlink()


def _swap_file(fake):
    with open(fake.lib / kl.LIBRARY["onnxruntime"].file, "ab") as library:
        library.write(b"\0")


def _drop_entry(fake, name):
    manifest = fake.manifest()
    del manifest["libraries"][name]
    _write(fake, json.dumps(manifest))


def _cpu_without(fake, monkeypatch):
    fake.edit("c", {"cpu_features": ["avx2"]})
    for module in (kl, kb):  # the loader's check and the build's flags read the CPU alike
        monkeypatch.setattr(module, "cpu_features", lambda: frozenset({"sse2", "sse4_2"}))


# (case, library, tamper(fake, monkeypatch), what the one-line error says, the fix it names)
TAMPERED = [
    ("no manifest", "c", lambda f, m: _no_manifest(f), "c kernel library is not built", "make kernels"),
    ("manifest not json", "c", lambda f, m: _write(f, "{not json"), "kernels.json is unreadable", "make kernels"),
    (
        "manifest of another format",
        "c",
        lambda f, m: _write(f, '{"format": 0, "libraries": {}}'),
        "is not of format 1",
        "force-reinstall",
    ),
    (
        "entry of another shape",
        "c",
        lambda f, m: f.edit("c", {"built_for": ["torch"]}),
        "is not of format 1",
        "make kernels",
    ),
    (
        "entry naming another file",
        "c",
        lambda f, m: f.edit("c", {"file": "../../libc.so.6"}),
        "is not of format 1",
        "make kernels",
    ),
    (
        "no entry",
        "onnxruntime",
        lambda f, m: _drop_entry(f, "onnxruntime"),
        "onnxruntime kernel library is not built",
        "make kernels",
    ),
    ("file missing", "onnxruntime", lambda f, m: _lose_file(f), "is missing or not the one built", "make kernels"),
    ("file replaced", "onnxruntime", lambda f, m: _swap_file(f), "is missing or not the one built", "make kernels"),
    (
        "other machine",
        "c",
        lambda f, m: f.edit("c", {"machine": "aarch64"}),
        "was built for aarch64, this machine",
        "force-reinstall",
    ),
    (
        "cpu lacks avx2",
        "c",
        _cpu_without,
        "compiled for CPUs with avx2 and this CPU lacks it",
        "STREAMFUSE_PORTABLE_KERNELS=1",
    ),
    ("other sources", "c", lambda f, m: f.edit("c", {"sources": "0" * 64}), "built from other sources", "make kernels"),
    (
        "old onnxruntime",
        "onnxruntime",
        lambda f, m: f.edit("onnxruntime", {"built_for": {"onnxruntime_api": 99}}),
        "needs ONNX Runtime 1.99 or later",
        "pip install 'streamfuse",
    ),
    (
        "other executorch",
        "executorch",
        lambda f, m: f.edit("executorch", {"built_for": {"executorch": "0.1.0"}}),
        "was built for executorch 0.1.0, .* is installed",
        "make kernels",
    ),
    (
        "executorch never built",
        "executorch",
        lambda f, m: _drop_entry(f, "executorch"),
        "executorch kernel library is not built",
        "pip install --no-build-isolation",
    ),
]


@pytest.mark.parametrize("library, tamper, problem, fix", [pytest.param(*case[1:], id=case[0]) for case in TAMPERED])
def test_a_library_that_does_not_fit_is_a_one_line_error_naming_the_fix(
    fake, monkeypatch, library, tamper, problem, fix
):
    if library == "executorch" and not HAS_EXECUTORCH:
        pytest.skip("executorch is not installed here")
    fake.build()
    assert kl.library_path(library)
    tamper(fake, monkeypatch)
    with pytest.raises(kl.KernelUnavailable, match=problem) as error:
        kl.library_path(library)
    assert "\n" not in str(error.value) and fix in str(error.value), str(error.value)
    if "make kernels" in str(error.value):  # which this rebuild is: it mends every such case
        fake.build()
        assert kl.library_path(library)


def test_a_library_that_does_not_load_is_a_one_line_error(fake):
    fake.build()  # the fake compiler's "library" is its command line: no ELF
    with pytest.raises(kl.KernelUnavailable, match=r"libstreamfuse_attention.so does not load \(.*\): reinstall") as e:
        kl.load_c_library()
    assert "\n" not in str(e.value)


# --- the real libraries: the checkout's (make kernels) and a wheel's -----------------------------
# Loads every library with no compiler on PATH and no way to start a process (a compile would have to).
LOAD_ALL = """
import subprocess, sys
def refuse(*args, **kwargs):
    raise AssertionError(f"started a process: {args}")
subprocess.Popen.__init__ = refuse
from streamfuse.runtime.ops import kernel_library, q4_linear
import onnxruntime as ort
assert kernel_library.LIBRARIES.is_relative_to(sys.argv[1]), kernel_library.LIBRARIES
assert "portable" in q4_linear.available_paths()
ort.SessionOptions().register_custom_ops_library(str(kernel_library.onnxruntime_library_path()))
if kernel_library.installed_version("executorch"):  # checked, not opened: that imports torch (seconds)
    assert kernel_library.executorch_library_path().is_file()
print("loaded")
"""


def _package_copy(target: Path) -> Path:
    """The package's folders and root files, as the wheel takes them (no build outputs, no artifacts)."""
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    built = ROOT / "runtime" / "kernels"  # its lib/ is the checkout's build (make kernels), not a source

    def ignore(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if n == "__pycache__" or (Path(folder) == built and n == "lib")]

    for folder in sorted({f.split("/")[0] for f in folders} - {"."}):
        shutil.copytree(ROOT / folder, target / folder, ignore=ignore)
    for path in [ROOT / "pyproject.toml", ROOT / "README.md", *ROOT.glob("*.py")]:
        shutil.copy2(path, target / path.name)
    return target


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """pip wheel of a copy of the checkout (no build isolation: this venv's setuptools and executorch; ~10 s)."""
    root = tmp_path_factory.mktemp("wheel")
    source = _package_copy(root / "source")
    command = [
        sys.executable,
        "-m",
        "pip",
        "--disable-pip-version-check",
        "-q",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(root / "dist"),
        str(source),
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=root, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (found,) = (root / "dist").glob("streamfuse-*.whl")
    return found


def test_the_wheel_carries_the_kernels_and_what_they_were_built_against(wheel, tmp_path):
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path)
        modes = {Path(i.filename).name: stat.S_IMODE(i.external_attr >> 16) for i in archive.infolist()}
    lib = tmp_path / "streamfuse" / "runtime" / "kernels" / "lib"
    entries = json.loads((lib / kl.MANIFEST).read_text())["libraries"]
    assert sorted(entries) == sorted(NAMES) and {p.name for p in lib.iterdir()} == {
        kl.MANIFEST,
        *(e["file"] for e in entries.values()),
    }  # nothing else: no temporary, no lock
    for name, entry in entries.items():
        assert entry["sha256"] == kl.sha256_of(lib / entry["file"]) and modes[entry["file"]] == 0o755
        assert entry["sources"] == kl.source_hash(name, lib.parent)  # the sources the wheel carries
    python = "cp" if HAS_EXECUTORCH else "py3-none"  # the ExecuTorch library links one Python's bindings
    assert wheel.name.startswith(f"streamfuse-0.1.0-{python}") and not wheel.name.endswith("-any.whl")


@pytest.mark.parametrize("installed", ["checkout", "wheel"])
def test_the_libraries_load_with_no_compiler_on_path(installed, request, tmp_path):
    """The checkout's (make kernels) and the unpacked wheel's, each in a process with an empty PATH (the
    ExecuTorch library's loading is tests/test_tree_attention.py's and tests/test_q4_linear.py's)."""
    env = {"HOME": str(tmp_path), "PATH": str(tmp_path / "empty-bin"), "OMP_WAIT_POLICY": "PASSIVE"}
    root = ROOT
    if installed == "wheel":
        with zipfile.ZipFile(request.getfixturevalue("wheel")) as archive:
            archive.extractall(tmp_path / "site")
        root, env["PYTHONPATH"] = tmp_path / "site" / "streamfuse", str(tmp_path / "site")
    done = subprocess.run(
        [sys.executable, "-c", LOAD_ALL, str(root)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "loaded", done.stderr[-2000:]


DEFAULT_ARTIFACT = ROOT / "artifacts" / "dialogsum"  # make build's
FRESH_VENV = "STREAMFUSE_FRESH_VENV"  # =1: run the fresh-venv decode (~20 s and the package index)
DIALOGUE = "#Person1#: Are you coming to the party tonight? #Person2#: Yes, I will bring the cake."


def _decode(python: str, env: dict, cwd: Path) -> dict:
    command = [
        python,
        "-m",
        "streamfuse.runtime.commands.generate",
        "--artifact",
        str(DEFAULT_ARTIFACT),
        "--backend",
        "onnxruntime",
        "--task",
        "dialogsum",
        "--prompt",
        DIALOGUE,
        "--max-new-tokens",
        "24",
        "--json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
    if done.returncode != 0:  # the CLI's one-line error
        return {"error": done.stderr.strip()[-500:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    os.environ.get(FRESH_VENV) != "1",
    reason=f"a new venv from the package index takes ~20 s: "
    f"{FRESH_VENV}=1 runs it (tests/test_export.py installs a wheel in a new venv in every run)",
)
@pytest.mark.skipif(
    not (DEFAULT_ARTIFACT / "onnx").is_dir(), reason=f"no ONNX artifact in {DEFAULT_ARTIFACT}: make build"
)
def test_a_fresh_venv_decodes_the_default_artifact_from_the_wheel_without_a_compiler(wheel, tmp_path):
    """The wheel and `streamfuse[onnxruntime]` from the package index in a new venv whose PATH holds no compiler;
    its tokens are the checkout's (an artifact this checkout cannot read is a skip naming why)."""
    here = _decode(sys.executable, {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, tmp_path)
    if "error" in here:
        pytest.skip(f"the checkout does not decode {DEFAULT_ARTIFACT}: {here['error']}")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q", "install"]
    subprocess.run([*pip, "--no-deps", "--no-index", str(wheel)], check=True, timeout=300)  # the wheel alone
    deps = subprocess.run([*pip, f"{wheel}[onnxruntime]"], capture_output=True, text=True, timeout=900)
    if deps.returncode != 0:
        pytest.skip(f"the package index is unreachable: {(deps.stderr.strip().splitlines() or ['?'])[-1]}")
    env = {"HOME": str(tmp_path), "PATH": str(venv / "bin"), "OMP_WAIT_POLICY": "PASSIVE"}
    assert not any(shutil.which(c, path=env["PATH"]) for c in ("g++", "c++", "gcc", "cc", "clang++"))
    fresh = _decode(str(venv / "bin" / "python"), env, tmp_path)
    assert "error" not in fresh, fresh
    assert fresh["token_ids"] == here["token_ids"] and fresh["new_tokens"] > 0
