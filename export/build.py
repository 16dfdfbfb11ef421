"""`python export/build.py --task dialogsum`: the build, run by path from a checkout; `streamfuse build` with the
same flags, help and errors (training/build.py is its one home; `python -m streamfuse.export.build` runs it too).

A script run by path does not find the package by itself: pyproject maps `streamfuse` to the checkout's root, which
is not on sys.path. So it imports the installed streamfuse (`make build` installs this checkout, editable), and where
none is importable (a fresh clone, a python without the install) it loads this checkout as the package: the root's
__init__.py with the root as its path, each sub-package then found as the plain folder pyproject maps it to
(streamfuse.runtime -> runtime/; tests/test_layering.py keeps the mapping so). The build's command line imports
torch and numpy: a python without them gets one line saying to run `make build` or use .venv/bin/python.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
PROG = "export/build.py"


def import_package() -> None:
    """`streamfuse` in sys.modules: the installed package, else this checkout loaded as it."""
    if "streamfuse" in sys.modules or importlib.util.find_spec("streamfuse") is not None:
        importlib.import_module("streamfuse")
        return
    spec = importlib.util.spec_from_file_location(
        "streamfuse", CHECKOUT / "__init__.py", submodule_search_locations=[str(CHECKOUT)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules["streamfuse"] = package
    try:
        spec.loader.exec_module(package)
    except BaseException:
        del sys.modules["streamfuse"]
        raise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    import_package()
    from streamfuse import cli

    try:  # what the command line needs, imported before the build runs: a missing package is this python's lack
        importlib.import_module("streamfuse.runtime.commands.errors")
        importlib.import_module(cli.COMMANDS["build"].module)
    except ModuleNotFoundError as missing:
        if (missing.name or "").partition(".")[0] == "streamfuse":
            raise
        print(
            f"{PROG}: error: this python ({sys.executable}) has no {missing.name!r}, which the build needs: run "
            f"`make build` (it installs the build's packages into .venv), or run {PROG} with .venv/bin/python",
            file=sys.stderr,
        )
        return 1
    return cli.run("build", argv)


if __name__ == "__main__":
    sys.exit(main())
