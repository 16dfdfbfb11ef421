"""The registry of decoding methods: the runtime (CLIs, bench, profiler, demo, server) and the build iterate it.

A method is one folder, `streamfuse.methods.<folder>`, whose `__init__.py` declares `METHOD` (runtime/methods/method.py)
from runtime-layer imports only; its other parts are modules of the same folder (`drafter`, `graph_pass`,
`torch_pass`, `build`, ...), found with `part`, so a runtime module reaches a method's torch code without an
import statement. A built-in method is its folder plus one line in BUILT_IN; a package elsewhere joins with
`register_package`. Loading is lazy (the first call), so a runtime module may import this one without importing
every method.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from streamfuse.runtime.methods.method import Method

BUILT_IN = ("ar", "ss", "sd", "medusa", "specdec", "ss_adaptive", "pearl", "parallelspec", "falcon")  # folders
_METHODS: dict[str, Method] = {}
_PACKAGES: dict[str, str] = {}  # method name -> the package that declares it


def _loaded() -> dict[str, Method]:
    if not _METHODS:
        for folder in BUILT_IN:
            register_package(f"streamfuse.methods.{folder}")
    return _METHODS


def register_package(package: str) -> Method:
    """Import `package` and register the METHOD it declares; its parts are found in it by `part`."""
    method = importlib.import_module(package).METHOD
    if not _METHODS and not package.startswith("streamfuse.methods."):
        _loaded()  # the built-in methods come first
    if method.name in _METHODS and _PACKAGES[method.name] != package:
        raise ValueError(f"a method named {method.name!r} is registered already (by {_PACKAGES[method.name]})")
    _METHODS[method.name], _PACKAGES[method.name] = method, package
    return method


def names() -> tuple[str, ...]:
    return tuple(_loaded())


def get(name: str) -> Method:
    methods = _loaded()
    if name not in methods:
        raise ValueError(f"method must be one of {', '.join(methods)}, got {name!r}")
    return methods[name]


def _flagged(flag: str) -> str:
    found = [name for name, method in _loaded().items() if getattr(method, flag)]
    if len(found) != 1:
        raise ValueError(f"exactly one registered method must be {flag}, got {', '.join(found) or 'none'}")
    return found[0]


def plain() -> str:
    """The plain decoding method's name: every speed-up's baseline."""
    return _flagged("plain")


def default() -> str:
    """The method the CLIs, the bench and the demo run unless told."""
    return _flagged("default")


def part(name: str, kind: str) -> ModuleType | None:
    """The method's `kind` module (e.g. "build", "torch_pass"), or None where the method has none."""
    get(name)
    package = importlib.import_module(_PACKAGES[name])
    if not hasattr(package, "__path__"):  # a method declared in a plain module has no parts
        return None
    module = f"{_PACKAGES[name]}.{kind}"
    return importlib.import_module(module) if importlib.util.find_spec(module) is not None else None
