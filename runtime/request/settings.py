"""What one generation is asked to do: the method, its tree, when to stop, how to choose tokens.

The decode loop (runtime/request/decode.py) takes these settings plus keyword-only hooks (trace, run
id, per-step callback, detokenizer), so a caller states a run once and hands the same settings,
method aside, to SS, the other methods and their plain-decoding baseline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamfuse.runtime.backends.base import PruneConfig
from streamfuse.runtime.methods import registry
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.speculation.fallback import FallbackConfig
from streamfuse.runtime.speculation.sampling import SamplingConfig
from streamfuse.runtime.speculation.tree import TreeSpec


@dataclass(frozen=True)
class DecodeSettings:
    method: str  # a registered method's name (runtime/methods/registry.py)
    rules: StopRules
    # the draft shape: a tree; a chain (Method.chain), its drafts; the largest a method may choose or stop within
    tree: TreeSpec | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prune: PruneConfig | None = None  # the target's own streams on torch: drop unlikely tree nodes before the call
    seed: int = 0  # the sampling generator's seed: equal seeds give equal tokens in both methods
    fallback: FallbackConfig | None = None  # plain decoding where speculation does not pay (Method.streams)
    # stop drafting once P(a rejection) passes it (Method.threshold; None: the artifact's)
    threshold: float | None = None

    def __post_init__(self):
        method = registry.get(self.method)
        if method.speculative and (self.tree is None or not self.tree.paths):
            raise ValueError(f"method {self.method} needs a draft tree with at least one path below the root")
        if method.chain and any(len(kids) > 1 for kids in self.tree.children):
            raise ValueError(f"method {self.method} drafts a chain: give it a chain tree (gamma=G,k=1)")
        if self.threshold is not None and not method.threshold:
            takers = [
                registry.get(name).label.partition(":")[0] for name in registry.names() if registry.get(name).threshold
            ]  # the method's name as its label writes it
            raise ValueError(
                f"a stop threshold is {' and '.join(takers)}'s, not method {self.method}'s: leave the threshold unset"
            )
