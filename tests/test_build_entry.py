"""`python export/build.py`, the build's entry by path (the design card's line): `streamfuse build`'s help from a
checkout, its settings from a fresh copy with no streamfuse installed, and one line from a python without the build's
packages (tests/test_layering.py keeps pyproject's mapping plain folders, which that fresh copy relies on)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from streamfuse import cli

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "COLUMNS": "100"}  # argparse wraps its help to the terminal's width


def run_entry(*args: str, python: tuple[str, ...] = (sys.executable,), cwd: Path = ROOT, env=ENV):
    return subprocess.run(
        [*python, "export/build.py", *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )


def test_its_help_is_streamfuse_builds(capsys, monkeypatch):
    done = run_entry("--task", "dialogsum", "--help")
    assert done.returncode == 0, done.stderr
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exited:
        cli.main(["build", "--help"])
    assert exited.value.code == 0
    assert done.stdout == capsys.readouterr().out
    assert done.stdout.startswith("usage: streamfuse build ") and "--print-config" in done.stdout


def test_a_fresh_copy_without_the_install_prints_its_config(tmp_path):
    """The checkout's tracked files copied, run where the install's path hook is not (-S: no .pth files; the
    packages' folder on PYTHONPATH): the copy loads itself as streamfuse."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (ROOT / name).is_file():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / name, tmp_path / name)
    paths = os.pathsep.join(dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]))
    probe = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    done = run_entry(
        "--task",
        "dialogsum",
        "--print-config",
        python=(sys.executable, "-S", "-c", probe),
        cwd=tmp_path,
        env={**ENV, "PYTHONPATH": paths},
    )
    assert done.returncode == 0, done.stderr
    config = json.loads(done.stdout)
    assert config["task"] == "dialogsum" and config["preset"] == "cpu"


def test_a_python_without_the_builds_packages_gets_one_line():
    done = run_entry("--help", python=(sys.executable, "-S"))  # -S: none of the installed packages
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("export/build.py: error: ")
    assert "make build" in done.stderr and ".venv/bin/python" in done.stderr
