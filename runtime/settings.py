"""What one generation is asked to do: the method, its tree, when to stop, how to choose tokens.

The decode loop (runtime/decode.py) takes these settings plus keyword-only hooks (trace, run
id, per-step callback, detokenizer), so a caller states a run once and hands the same settings,
method aside, to SS, the other methods and their plain-decoding baseline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamfuse.runtime.backends.base import PruneConfig
from streamfuse.runtime.emitter import StopRules
from streamfuse.runtime.fallback import FallbackConfig
from streamfuse.runtime.sampling import SamplingConfig
from streamfuse.runtime.tree import TreeSpec


@dataclass(frozen=True)
class DecodeSettings:
    method: str  # a registered method's name (runtime/methods)
    rules: StopRules
    tree: TreeSpec | None = None  # ss: the draft tree; sd: a chain, its draft length; specdec++: its longest chain;
    #                               ss-adaptive: the largest tree it may choose
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prune: PruneConfig | None = None  # ss on torch: drop unlikely tree nodes before the call
    seed: int = 0  # the sampling generator's seed: equal seeds give equal tokens in both methods
    fallback: FallbackConfig | None = None  # ss, ss-adaptive: plain decoding where speculation does not pay
    threshold: float | None = None  # specdec++: stop drafting once P(a rejection) passes it (None: the artifact's)

    def __post_init__(self):
        from streamfuse.runtime import methods  # the registry's methods build drafters from settings

        method = methods.get(self.method)
        if method.speculative and (self.tree is None or not self.tree.paths):
            raise ValueError(f"method {self.method} needs a draft tree with at least one path below the root")
        if method.chain and any(len(kids) > 1 for kids in self.tree.children):
            raise ValueError(f"method {self.method} drafts a chain: give --tree gamma=G,k=1")
        if self.threshold is not None and not method.threshold:
            raise ValueError(f"a stop threshold is SpecDec++'s, not method {self.method}'s: drop --threshold")
