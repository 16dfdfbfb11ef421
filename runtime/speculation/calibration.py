"""Per-device draft trees: expected tokens per step from acceptance statistics, over the cost of a
step measured on the device (tools/calibrate.py measures, export/ records, the runtime reads).

Acceptance model. Teacher-forced on validation inputs' own greedy answers (the tokens verification
accepts), each answer position (a root: the token the main stream decides) gives one row:
    ranks   the rank of the token d places after the root among stream d's candidates, for
            d = 1, 2, ... up to the first depth where it is not among the top `max_rank`;
    lookup  how many of prompt lookup's proposed tokens continue the answer (-1: it proposed none).
At a position a tree accepts the deepest rank path it holds, or, on its lookup branch, as many
tokens as lookup got right (where lookup proposes nothing the branch keeps its streams' ranks).
A tree's expected tokens per step replays greedy decoding along each answer: from a root, accept,
jump past the accepted tokens and the correction, repeat. (Averaging over all positions instead
overstates it: steps skip the easy stretches and land on every position of the hard ones.) The
model treats a partly filled lookup branch as full; tools/calibrate.py reports the realised rate.

Tree construction (Medusa, Sequoia): by the probability of each rank path over all positions, the
best n-node stream tree is the n most probable paths (a parent is at least as probable as its
children, so they form a tree): nested trees, each of which may also carry a lookup branch; per
size the candidate with most expected tokens (by replay) wins.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from streamfuse.runtime.speculation.tree import Path, TreeSpec

MAX_TREE_NODES = 16  # the largest tree calibration considers (root included)
Row = tuple[Path, int]  # (ranks, lookup) at one answer position


@dataclass(frozen=True)
class AcceptanceModel:
    max_rank: int  # candidates per stream the statistics looked at
    depth: int  # streams (gamma)
    answers: tuple[tuple[Row, ...], ...]  # per validation answer, a row per position, in order

    @classmethod
    def from_answers(
        cls, answers: Iterable[tuple[Sequence[Sequence[int]], Sequence[int]]], max_rank: int, depth: int
    ) -> AcceptanceModel:
        """answers: per answer, (each position's rank at depth 1, 2, ...; each position's lookup matches).
        A rank >= max_rank, or < 0, is a miss: it ends the path."""
        kept = []
        for ranks, lookups in answers:
            rows = tuple(
                (cls._path(position, max_rank, depth), min(int(lookup), depth))
                for position, lookup in zip(ranks, lookups, strict=True)
            )
            if rows:
                kept.append(rows)
        if not kept:
            raise ValueError("no answer positions to build an acceptance model from")
        return cls(max_rank, depth, tuple(kept))

    @staticmethod
    def _path(position: Sequence[int], max_rank: int, depth: int) -> Path:
        path = []
        for rank in list(position)[:depth]:
            if not 0 <= rank < max_rank:
                break
            path.append(int(rank))
        return tuple(path)

    @property
    def positions(self) -> int:
        return sum(len(rows) for rows in self.answers)

    def acceptor(self, tree: TreeSpec) -> Callable[[Path, int], int]:
        """(ranks, lookup) -> the drafts `tree` accepts at a position with them."""
        paths = set(tree.paths)
        branch = {tree.node_paths[n] for n in tree.lookup_nodes}
        streams_only = paths - branch

        def accepted(ranks: Path, lookup: int) -> int:
            held = streams_only if branch and lookup >= 0 else paths  # no proposal: the branch keeps stream ranks
            depth = 0
            while depth < len(ranks) and ranks[: depth + 1] in held:
                depth += 1
            return max(depth, min(lookup, len(tree.lookup))) if branch and lookup >= 0 else depth

        return accepted

    def expected_tokens(self, tree: TreeSpec) -> float:
        """Tokens per step, replaying greedy decoding of every answer with `tree`."""
        accepted, tokens, steps = self.acceptor(tree), 0, 0
        for rows in self.answers:
            position = 0
            while position < len(rows):
                drafts = accepted(*rows[position])
                tokens, steps, position = tokens + drafts + 1, steps + 1, position + drafts + 1
        return tokens / steps

    def path_probabilities(self) -> dict[Path, float]:
        """P(a position's ranks start with path), for every path some position reaches."""
        reached: Counter = Counter()
        for rows in self.answers:
            for ranks, _ in rows:
                for depth in range(1, len(ranks) + 1):
                    reached[ranks[:depth]] += 1
        return {path: count / self.positions for path, count in reached.items()}

    def stream_trees(self, max_nodes: int = MAX_TREE_NODES) -> list[TreeSpec]:
        """The nested best stream trees of 2..max_nodes nodes (fewer if fewer paths were ever reached)."""
        probabilities = self.path_probabilities()
        # Ties go to shallower paths, so a parent always precedes its equally probable child.
        order = sorted(probabilities, key=lambda p: (-probabilities[p], len(p), p)) or [(0,)]  # (0,): one draft
        return [TreeSpec(tuple(order[:count])) for count in range(1, min(max_nodes - 1, len(order)) + 1)]

    def best_trees(self, max_nodes: int = MAX_TREE_NODES) -> dict[int, TreeSpec]:
        """nodes -> the tree of that size with the most expected tokens, stream trees and stream trees
        with a lookup branch (a branch of m nodes on the tree of n - 1 - m stream nodes) alike."""
        candidates = []
        for tree in self.stream_trees(max_nodes):
            candidates.append(tree)
            candidates += [tree.with_lookup(m) for m in range(1, tree.depth + 1) if tree.num_nodes + m <= max_nodes]
        best: dict[int, tuple[float, TreeSpec]] = {}
        for tree in candidates:
            tokens = self.expected_tokens(tree)
            if tree.num_nodes not in best or tokens > best[tree.num_nodes][0]:
                best[tree.num_nodes] = (tokens, tree)
        return {nodes: tree for nodes, (_, tree) in sorted(best.items())}

    def to_dict(self) -> dict:
        return {
            "max_rank": self.max_rank,
            "depth": self.depth,
            "positions": self.positions,
            "answers": [[[list(ranks), lookup] for ranks, lookup in rows] for rows in self.answers],
        }

    @classmethod
    def from_dict(cls, data: dict) -> AcceptanceModel:
        answers = tuple(tuple((tuple(ranks), int(lookup)) for ranks, lookup in rows) for rows in data["answers"])
        return cls(int(data["max_rank"]), int(data["depth"]), answers)


@dataclass(frozen=True)
class TreeCost:
    """One candidate tree on one device: the step's median seconds, the tokens per step the acceptance
    model expects, and those the timed runs got (a few inputs: a check of the model, not the choice).
    A greedy step of a tree with a greedy_step graph was timed both ways, that graph (one call) and a step then
    a streams call for the accepted node (two calls): the faster way is the tree's, its cost the step's."""

    tree: TreeSpec
    step_seconds: float
    expected_tokens: float
    realised_tokens: float
    two_calls: bool = False  # both ways timed, and step then streams was faster
    other_seconds: float | None = None  # the slower way's median, where both were timed

    def speedup(self, plain_seconds: float) -> float:
        """Expected tokens per second over plain decoding's (one token per plain step)."""
        return self.expected_tokens * plain_seconds / self.step_seconds


@dataclass(frozen=True)
class BackendCalibration:
    """The calibration of one backend on one device: plain step cost, every candidate's, the choice, and
    the prefill's cost (backends differ there too, and it weighs in which is fastest end to end)."""

    device: str  # the machine, in words (CPU model, accelerator)
    threads: int
    plain_seconds: float
    trees: tuple[TreeCost, ...]
    prefill_seconds_per_token: float
    prompt_tokens: float  # the mean prompt length of the timed inputs

    def request_seconds(self, new_tokens: float) -> float:
        """A request of the timed inputs' mean prompt length writing `new_tokens` with the chosen tree."""
        best = self.best
        return (
            self.prompt_tokens * self.prefill_seconds_per_token
            + max(new_tokens - 1, 0) / best.expected_tokens * best.step_seconds
        )

    @property
    def best(self) -> TreeCost:
        return max(self.trees, key=lambda cost: cost.speedup(self.plain_seconds))

    @property
    def tree(self) -> TreeSpec:
        return self.best.tree

    def two_call_trees(self) -> tuple[TreeSpec, ...]:
        """The trees whose greedy steps ran faster as step then streams than as one greedy_step call."""
        return tuple(cost.tree for cost in self.trees if cost.two_calls)

    def step_cost(self, tree: TreeSpec) -> float | None:
        """A step of `tree` in plain steps, if it was measured (the fallback's threshold)."""
        found = [cost for cost in self.trees if cost.tree.hash() == tree.hash()]
        return found[0].step_seconds / self.plain_seconds if found else None

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "threads": self.threads,
            "plain_ms": round(1e3 * self.plain_seconds, 3),
            "prefill_ms_per_token": round(1e3 * self.prefill_seconds_per_token, 4),
            "prompt_tokens": round(self.prompt_tokens, 1),
            "choice": self.tree.to_dict(),
            "expected_speedup": round(self.best.speedup(self.plain_seconds), 4),
            "trees": [
                {
                    "tree": cost.tree.to_dict(),
                    "step_ms": round(1e3 * cost.step_seconds, 3),
                    "step_cost": round(cost.step_seconds / self.plain_seconds, 4),
                    "expected_tokens": round(cost.expected_tokens, 4),
                    "realised_tokens": round(cost.realised_tokens, 4),
                    "expected_speedup": round(cost.speedup(self.plain_seconds), 4),
                    "two_calls": cost.two_calls,
                    "other_ms": None if cost.other_seconds is None else round(1e3 * cost.other_seconds, 3),
                }
                for cost in self.trees
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> BackendCalibration:
        trees = tuple(
            TreeCost(
                TreeSpec.from_dict(row["tree"]),
                row["step_ms"] / 1e3,
                row["expected_tokens"],
                row["realised_tokens"],
                row["two_calls"],
                None if row["other_ms"] is None else row["other_ms"] / 1e3,
            )
            for row in data["trees"]
        )
        return cls(
            data["device"],
            int(data["threads"]),
            data["plain_ms"] / 1e3,
            trees,
            data["prefill_ms_per_token"] / 1e3,
            data["prompt_tokens"],
        )


@dataclass(frozen=True)
class Timings:
    """What tools/calibrate.py measured: seconds per plain step and per step of each tree (one per timed
    run), each tree's tokens per step over its runs, prefill seconds per prompt token per run."""

    plain: Sequence[float]
    steps: dict[TreeSpec, Sequence[float]]  # greedy steps as the tree's greedy_step graph where it has one
    realised: dict[TreeSpec, float]
    prefill: Sequence[float]
    prompt_tokens: float
    two_calls: dict[TreeSpec, Sequence[float]] = field(default_factory=dict)  # those trees as step, then streams


def calibrate(model: AcceptanceModel, timings: Timings, device: str, threads: int) -> BackendCalibration:
    """Timings (medians of each) and the acceptance model -> the calibration."""
    if not timings.plain or not timings.steps or not all(timings.steps.values()) or not timings.prefill:
        raise ValueError("calibration needs timed plain steps, prefills and steps of every candidate tree")
    costs = tuple(tree_cost(model, timings, tree) for tree in timings.steps)
    return BackendCalibration(
        device,
        threads,
        statistics.median(timings.plain),
        costs,
        statistics.median(timings.prefill),
        timings.prompt_tokens,
    )


def tree_cost(model: AcceptanceModel, timings: Timings, tree: TreeSpec) -> TreeCost:
    """A tree's cost: the faster of its two ways where both were timed (ties: one call)."""
    one = statistics.median(timings.steps[tree])
    expected, realised = model.expected_tokens(tree), timings.realised[tree]
    if not timings.two_calls.get(tree):
        return TreeCost(tree, one, expected, realised)
    two = statistics.median(timings.two_calls[tree])
    if two < one:
        return TreeCost(tree, two, expected, realised, two_calls=True, other_seconds=one)
    return TreeCost(tree, one, expected, realised, other_seconds=two)
