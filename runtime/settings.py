"""What one generation is asked to do: the method, its tree, when to stop, how to choose tokens.

Every decode loop (runtime/decode.py, runtime/autoregressive.py) takes these settings plus
keyword-only hooks (trace, run id, per-step callback, detokenizer), so a caller states a run
once and hands the same settings to SS and to its plain-decoding baseline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamfuse.runtime.backends.base import PruneConfig
from streamfuse.runtime.emitter import StopRules
from streamfuse.runtime.fallback import FallbackConfig
from streamfuse.runtime.sampling import SamplingConfig
from streamfuse.runtime.tree import TreeSpec

METHODS = ("ss", "ar")


@dataclass(frozen=True)
class DecodeSettings:
    method: str  # "ss": speculative streaming; "ar": plain decoding
    rules: StopRules
    tree: TreeSpec | None = None  # ss: the draft tree (ar ignores it)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prune: PruneConfig | None = None  # ss on torch: drop unlikely tree nodes before the call
    seed: int = 0  # the sampling generator's seed: equal seeds give equal tokens in both methods
    fallback: FallbackConfig | None = None  # ss: plain decoding where speculation does not pay (runtime/fallback.py)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.method == "ss" and self.tree is None:
            raise ValueError("speculative decoding needs a draft tree")
