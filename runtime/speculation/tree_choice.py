"""Method ss-adaptive: each step, the draft tree that promises most tokens per second.

SpecDec++'s idea (an acceptance head decides how much to draft) on Speculative Streaming's own
states: the head (adapters/acceptance.py) reads stream d's final state at the accepted node and
predicts q_d, the probability that stream d's top token is accepted given that the top tokens
above it were. The calibration's acceptance model (runtime/speculation/calibration.py) says how often each
rank path is reached on average; a step's prediction tilts it, depth by depth:

    P_step(r_1..r_n) = P(r_1..r_n) * prod_d t_d(r_d),   t_d(0) = q_d / p_d,   t_d(r > 0) = (1 - q_d) / (1 - p_d)

where p_d is the model's own P(rank 0 at depth d | ranks 0 above), each conditional capped at 1. At
most one node per depth is accepted (siblings hold distinct tokens), so a tree's expected tokens
are 1 + the sum of P_step over its stream paths, plus its lookup branch's average gain over the same
tree without it (lookup does not depend on the streams). The step takes the candidate with the most
expected tokens per unit of its calibrated cost (in plain steps, measured on this device).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from streamfuse.runtime.speculation.calibration import AcceptanceModel, BackendCalibration
from streamfuse.runtime.speculation.tree import Path, TreeSpec

EPSILON = 1e-6  # keeps a tilt finite where the statistics never (or always) saw a top token accepted


@dataclass(frozen=True)
class Candidate:
    tree: TreeSpec
    cost: float  # one step of the tree in plain steps, as calibrated on this device
    lookup_gain: float  # its lookup branch's mean extra accepted tokens (0 without one)


@dataclass(frozen=True)
class TreeChoice:
    candidates: tuple[Candidate, ...]
    path_probability: dict[Path, float]  # P(a position's ranks start with the path), the calibration's
    top: tuple[float, ...]  # p_d: P(rank 0 at depth d | rank 0 at every depth above)

    @classmethod
    def from_calibration(
        cls,
        acceptance: AcceptanceModel,
        calibration: BackendCalibration,
        runnable=lambda tree: True,
        max_nodes: int | None = None,
    ) -> TreeChoice:
        """The calibrated stream trees this backend runs (runnable(tree)), up to max_nodes nodes."""
        trees = [
            c
            for c in calibration.trees
            if c.tree.depth <= acceptance.depth
            and runnable(c.tree)
            and (max_nodes is None or c.tree.num_nodes <= max_nodes)
        ]
        if not trees:
            raise ValueError(
                "method ss-adaptive: no calibrated tree runs on this backend within the node limit; "
                "recalibrate with python -m streamfuse.tools.calibrate, or raise --tree's size"
            )
        probability = acceptance.path_probabilities()
        candidates = tuple(
            Candidate(c.tree, c.step_seconds / calibration.plain_seconds, lookup_gain(acceptance, c.tree))
            for c in trees
        )
        return cls(candidates, probability, top_probabilities(probability, acceptance.depth))

    @property
    def largest(self) -> TreeSpec:
        return max((c.tree for c in self.candidates), key=lambda tree: tree.num_nodes)

    def expected_tokens(self, candidate: Candidate, predicted: Sequence[float]) -> float:
        """Tokens one step of the candidate yields when the head predicts q_d = predicted[d - 1]."""
        tilted: dict[Path, float] = {(): 1.0}
        total = 1.0 + candidate.lookup_gain
        for path in sorted(stream_paths(candidate.tree), key=len):  # parents first
            parent = tilted[path[:-1]]
            base = self.path_probability.get(path, 0.0)
            above = self.path_probability.get(path[:-1], 1.0) if path[:-1] else 1.0
            conditional = base / above if above > 0 else 0.0
            depth, rank = len(path), path[-1]
            p, q = self.top[depth - 1], predicted[depth - 1]
            tilt = q / max(p, EPSILON) if rank == 0 else (1.0 - q) / max(1.0 - p, EPSILON)
            tilted[path] = parent * min(1.0, conditional * tilt)
            total += tilted[path]
        return total

    def choose(self, predicted: Sequence[float]) -> TreeSpec:
        """The candidate with the most expected tokens per plain step of cost (ties: the first)."""
        return max(self.candidates, key=lambda c: self.expected_tokens(c, predicted) / c.cost).tree


def stream_paths(tree: TreeSpec) -> list[Path]:
    """The tree's paths drafted by the streams (its lookup branch left out)."""
    branch = {tree.node_paths[n] for n in tree.lookup_nodes}
    return [path for path in tree.paths if path not in branch]


def top_probabilities(probability: dict[Path, float], depth: int) -> tuple[float, ...]:
    """p_d = P(0^d) / P(0^(d-1)): the calibration's chance that stream d's top token is accepted."""
    tops, above = [], 1.0
    for d in range(1, depth + 1):
        reached = probability.get((0,) * d, 0.0)
        tops.append(reached / above if above > 0 else 0.0)
        above = reached
    return tuple(tops)


def lookup_gain(acceptance: AcceptanceModel, tree: TreeSpec) -> float:
    """Mean extra drafts accepted per position with the tree's lookup branch over the same stream tree
    without it (0 without a branch)."""
    if not tree.lookup:
        return 0.0
    with_branch, streams = acceptance.acceptor(tree), acceptance.acceptor(TreeSpec(tuple(stream_paths(tree))))
    gains: Counter = Counter()
    for rows in acceptance.answers:
        for ranks, lookup in rows:
            gains[with_branch(ranks, lookup) - streams(ranks, lookup)] += 1
    return sum(gain * count for gain, count in gains.items()) / acceptance.positions
