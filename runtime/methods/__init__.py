"""The registry of decoding methods: every CLI, the bench, the profiler and the demo read it.

A method is one file here (a `Method`, runtime/methods/method.py, and its drafter) and one line in
BUILT_IN; a method defined elsewhere joins with `register`.
"""

from __future__ import annotations

from streamfuse.runtime.methods import ar, falcon, medusa, parallelspec, pearl, sd, specdec, ss, ss_adaptive
from streamfuse.runtime.methods.method import Method

BUILT_IN = (ar.METHOD, ss.METHOD, sd.METHOD, medusa.METHOD, specdec.METHOD, ss_adaptive.METHOD, pearl.METHOD,
            parallelspec.METHOD, falcon.METHOD)
_REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    if method.name in _REGISTRY and _REGISTRY[method.name] is not method:
        raise ValueError(f"a method named {method.name!r} is registered already")
    _REGISTRY[method.name] = method
    return method


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get(name: str) -> Method:
    if name not in _REGISTRY:
        raise ValueError(f"method must be one of {', '.join(_REGISTRY)}, got {name!r}")
    return _REGISTRY[name]


for _method in BUILT_IN:
    register(_method)
