"""The `streamfuse` console script: every command line of README.md's "Using it" block answers --help through the
installed script, the command table points at real mains, and a wrong command is one line."""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

import pytest

from streamfuse import cli

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("streamfuse")  # what `pip install -e .` put beside this interpreter
FLAG = re.compile(r"\[?(--[a-z][a-z0-9-]*)")


def readme_commands() -> list[str]:
    """The "Using it" block's commands: its indented lines, a continuation (a trailing backslash or a deeper
    indent) joined to the line it continues."""
    section = (ROOT / "README.md").read_text().split("\n## Using it\n", 1)[1].split("\n## ", 1)[0]
    commands: list[str] = []
    for line in section.splitlines():
        if line.startswith("        ") and commands:
            commands[-1] = commands[-1].removesuffix("\\").rstrip() + " " + line.strip()
        elif line.startswith("    "):
            commands.append(line.strip())
    return commands


def run_script(*args: str) -> subprocess.CompletedProcess:
    assert SCRIPT.is_file(), f"{SCRIPT} is missing: install the package (pip install -e .)"
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_every_command_line_of_the_readme_answers_help_with_its_flags():
    commands = [shlex.split(command, comments=True) for command in readme_commands()]
    assert len(commands) >= 5 and all(words[0] == "streamfuse" for words in commands), commands
    # one process per command (each imports its module, torch for most), all at once
    names = sorted({words[1] for words in commands if not words[1].startswith("-")})
    calls = [[], *([name] for name in names)]
    with ThreadPoolExecutor(len(calls)) as pool:
        helps = dict(zip(map(tuple, calls), pool.map(lambda call: run_script(*call, "--help"), calls)))
    for words in commands:
        call = () if words[1].startswith("-") else (words[1],)
        done = helps[call]
        assert done.returncode == 0, f"{' '.join(words)}: {done.stderr}"
        assert done.stdout.startswith(f"usage: {' '.join(['streamfuse', *call])}"), done.stdout[:200]
        flags = {match.group(1) for word in words if (match := FLAG.match(word))}
        missing = sorted(flag for flag in flags if flag not in done.stdout)
        assert not missing, f"README's `{' '.join(words[:2])}` uses {missing}, which its --help does not list"


def test_the_help_lists_every_command_of_the_table_and_imports_none_of_them():
    probe = (
        "import sys; from streamfuse import cli; cli.main(['--help']); "
        "print(sorted(m for m in sys.modules if m.startswith(('streamfuse.', 'torch', 'numpy'))))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    listed = {line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")}
    assert set(cli.ALL) <= listed
    assert done.stdout.splitlines()[-1] == "['streamfuse.cli']"  # no command module, no torch, no numpy
    assert run_script("--help").stdout == cli.help_text()


def main_takes_argv(module: str) -> bool:
    """Whether `module` defines main(argv...) at its top level (read from its source, not imported)."""
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    return any(
        isinstance(node, ast.FunctionDef) and node.name == "main" and len(node.args.args) == 1 for node in tree.body
    )


@pytest.mark.parametrize("name", sorted(cli.ALL))
def test_each_command_is_a_main_whose_help_names_the_command(name, capsys):
    assert main_takes_argv(cli.ALL[name].module), f"{cli.ALL[name].module} has no main(argv)"
    with pytest.raises(SystemExit) as done:
        cli.main([name, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: streamfuse {name} ")


def test_every_tool_with_an_entry_point_is_a_command():
    modules = {command.module for command in cli.ALL.values()}
    tools = {
        f"streamfuse.tools.{path.stem}"
        for path in (ROOT / "tools").glob("*.py")
        if 'if __name__ == "__main__":' in path.read_text()
    }
    assert tools and not tools - modules, f"tools without a command in cli.py: {sorted(tools - modules)}"


@pytest.mark.parametrize(
    "argv, names",
    [
        (["biuld"], "'build'"),
        (["graph-latncy"], "'graph-latency'"),
        (["--frobnicate"], "--help"),
        ([], "name a command"),
    ],
)
def test_a_wrong_command_is_one_line_naming_the_closest(argv, names):
    done = run_script(*argv)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("streamfuse: error: ") and names in done.stderr


def test_version_and_underscored_names(capsys):
    assert run_script("--version").stdout == f"streamfuse {version('streamfuse')}\n"
    with pytest.raises(SystemExit):
        cli.main(["task_switch", "--help"])
    assert capsys.readouterr().out.startswith("usage: streamfuse task-switch ")
