"""--threads on every backend: ONNX Runtime and ExecuTorch take it when their session opens
(runtime/backends/sessions.py); torch, where this process has loaded it, takes it here."""

from __future__ import annotations

import os
import sys


def use_threads(threads: int | None) -> int:
    """Give torch `threads` if it is loaded (None: leave its own); the count a trace records. Without
    torch (an exported engine on its own), an unset count is the engine's default, one per CPU."""
    torch = sys.modules.get("torch")
    if torch is None:
        return threads or os.cpu_count() or 1
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
