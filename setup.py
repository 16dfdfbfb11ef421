"""The build hook: streamfuse's C++ kernels compiled into the package when it is built or installed (pip install .,
pip install -e ., pip wheel .), so the wheel carries them and nothing compiles at run time
(runtime/ops/kernel_build.py; runtime/ops/kernel_library.py loads them). Everything else is declared in
pyproject.toml."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build import build
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


def _load(name: str, path: Path):
    """A module of this tree by its path: streamfuse itself is not importable while it is being built."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class BuildKernels(Command):
    """Compile the kernels into the built package's runtime/kernels/lib (in place for an editable install)."""

    description = "compile streamfuse's C++ kernels (runtime/kernels) into the package"
    user_options: list = []

    def initialize_options(self) -> None:
        self.build_lib = None
        self.editable_mode = False
        self.built: dict[str, Path] = {}

    def finalize_options(self) -> None:
        self.set_undefined_options("build", ("build_lib", "build_lib"))

    def run(self) -> None:
        # Under their own names: kernel_build imports kernel_library by its full name, found in sys.modules.
        _load("streamfuse.runtime.ops.kernel_library", ROOT / "runtime" / "ops" / "kernel_library.py")
        kernels = _load("streamfuse.runtime.ops.kernel_build", ROOT / "runtime" / "ops" / "kernel_build.py")
        seams = _load("_streamfuse_seams", ROOT / "seams.py")
        target = (
            kernels.LIBRARIES if self.editable_mode else Path(self.build_lib, "streamfuse", "runtime", "kernels", "lib")
        )
        try:
            self.built = kernels.build(
                target, seams.executorch_runtime_library, log=self.announce_info, only_these=not self.editable_mode
            )
        except OSError as error:  # KernelUnavailable (one line naming the fix), or a folder it cannot write
            if not self.editable_mode:
                sys.exit(f"error: {error}")
            # A checkout mid-edit still installs; its kernels then refuse to load, naming `make kernels`.
            print(f"warning: {error}; the kernels load once `make kernels` succeeds", file=sys.stderr)

    def announce_info(self, message: str) -> None:
        self.announce(message, level=2)

    def get_outputs(self) -> list[str]:  # in place (editable), the source tree holds them already
        if self.editable_mode or not self.built:
            return []
        folder = next(iter(self.built.values())).parent
        return [str(path) for path in self.built.values()] + [str(folder / "kernels.json")]


class Build(build):
    sub_commands = [*build.sub_commands, ("build_kernels", None)]


class Wheel(bdist_wheel):
    """A platform wheel; for any Python 3 unless it carries the ExecuTorch library, which links one Python's
    executorch bindings."""

    def get_tag(self) -> tuple[str, str, str]:
        python, abi, plat = super().get_tag()
        if "executorch" in self.get_finalized_command("build_kernels").built:
            return python, abi, plat
        return "py3", "none", plat


class BinaryDistribution(Distribution):
    def has_ext_modules(self) -> bool:  # the kernels: a platform wheel, installed to platlib
        return True


setup(distclass=BinaryDistribution, cmdclass={"build": Build, "build_kernels": BuildKernels, "bdist_wheel": Wheel})
