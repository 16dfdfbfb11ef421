"""One packed copy of the weights for every method of a .pte: XNNPACK's weight cache.

Each method of a program is its own XNNPACK delegate, and each delegate packs the weights it
reads into buffers of its own: SmolLM2 q4-native held five copies (~138 MiB per method). With
the backend's weight cache on, delegates look packed weights up by their named-data key (the
sha256 of the unpacked bytes, so equal weights share one entry across methods and programs)
and the unpacked bytes are freed once packed. Outputs are bit-identical either way.

ExecuTorch's Python bindings expose no backend options, so the switch goes through the C++
runtime's exported `executorch::runtime::set_option(backend, Span<BackendOption>)`. The struct
layout below is executorch/runtime/backend/options.h; the value is read back with `get_option`
before anything relies on it, and a runtime without the symbol keeps one copy per method.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

_BACKEND = b"XnnpackBackend"
_KEY = b"weight_cache_enabled"  # XNNPACKBackend.h: weight_cache_option_key
_SET = "_ZN10executorch7runtime10set_optionEPKcNS0_4SpanINS0_13BackendOptionEEE"
_GET = "_ZN10executorch7runtime10get_optionEPKcNS0_4SpanINS0_13BackendOptionEEE"
_BOOL = 0  # index of bool in std::variant<bool, int, std::array<char, 256>>


class _Option(ctypes.Structure):
    """BackendOption: char key[64]; std::variant<bool, int, std::array<char, 256>> value."""

    _fields_ = [("key", ctypes.c_char * 64), ("storage", ctypes.c_uint8 * 256), ("index", ctypes.c_uint8),
                ("padding", ctypes.c_uint8 * 3)]


class _Span(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("size", ctypes.c_size_t)]


def _runtimes():
    """(set_option, get_option) of each loaded ExecuTorch library that exports the runtime
    (RTLD_NOLOAD: a library not already loaded is skipped, never loaded). Only the runtime that
    the Python bindings registered XNNPACK with knows the backend; the others answer NotFound."""
    from executorch.extension.pybindings import portable_lib

    package = Path(portable_lib.__file__).resolve().parents[2]
    for library in sorted(package.rglob("*.so")) + sorted(package.rglob("*.dylib")):
        try:
            handle = ctypes.CDLL(str(library), mode=os.RTLD_NOLOAD)
            functions = handle[_SET], handle[_GET]
        except (OSError, AttributeError):
            continue
        for function in functions:
            function.argtypes = [ctypes.c_char_p, _Span]
            function.restype = ctypes.c_uint32
        yield functions


def _call(function, option: _Option) -> bool:
    return function(_BACKEND, _Span(ctypes.addressof(option), 1)) == 0


def share_xnnpack_weights(enabled: bool = True) -> bool:
    """Turn XNNPACK's weight cache on (or off) for methods loaded from now on; True when the
    runtime confirms the setting."""
    for set_option, get_option in _runtimes():
        wanted = _Option(key=_KEY, index=_BOOL)
        wanted.storage[0] = int(enabled)
        read = _Option(key=_KEY, index=_BOOL)
        read.storage[0] = 2  # neither value: get_option must overwrite it
        if _call(set_option, wanted) and _call(get_option, read):
            return read.index == _BOOL and read.storage[0] == int(enabled)
    return False
