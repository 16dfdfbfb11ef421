"""Static tree drafts as data (paper 3.2.2, A.1; Medusa-style paths).

Node 0 is the root: the main stream's correction token. Every other node is written as its
path from the root, a tuple of candidate ranks: (0, 1) is "the top-1 token of stream 1, then
the top-2 token of stream 2". A node at depth d always takes its token from stream d, so the
full top-k tree of the paper is every path of length 1..gamma with ranks < k
(1 + sum_g k^g nodes). Nodes are ordered by (depth, path), so parents precede children.
All buffers are built once; the additive tree mask is a constant of the tree.

One branch may be a *lookup* branch (`lookup`, a path from the root): its nodes take the
tokens that followed the latest earlier occurrence of the context's last n-gram (prompt
lookup, runtime/lookup.py) and fall back to their own stream ranks where lookup has nothing.
It changes which tokens fill the nodes, never the shape, so graphs built for the paths run it;
the hash (what graphs depend on) covers the paths only.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from functools import cached_property

import numpy as np

Path = tuple[int, ...]


@dataclass(frozen=True)
class TreeSpec:
    paths: tuple[Path, ...]  # non-root nodes, each as its rank path from the root
    lookup: Path = ()  # the lookup branch's deepest node (); (): no lookup branch

    def __post_init__(self):
        paths = tuple(tuple(int(r) for r in p) for p in self.paths)
        ordered = tuple(sorted(set(paths), key=lambda p: (len(p), p)))
        if len(ordered) != len(paths):
            raise ValueError("tree paths contain duplicates")
        for path in ordered:
            if not path or min(path) < 0:
                raise ValueError(f"tree path {path} must be a non-empty tuple of ranks >= 0")
            if len(path) > 1 and path[:-1] not in set(ordered):
                raise ValueError(f"tree path {path} has no parent {path[:-1]}: every prefix must be a node too")
        object.__setattr__(self, "paths", ordered)
        lookup = tuple(int(r) for r in self.lookup)
        if lookup and lookup not in set(ordered):
            raise ValueError(f"lookup branch {list(lookup)} is not a node of the tree: give the path of one of its nodes")
        object.__setattr__(self, "lookup", lookup)

    @classmethod
    def full(cls, gamma: int, k: int) -> "TreeSpec":
        """The paper's tree: top-k of each of gamma streams, every combination."""
        if gamma < 1 or k < 1:
            raise ValueError(f"gamma and k must be >= 1, got gamma={gamma}, k={k}")
        return cls(tuple(p for depth in range(1, gamma + 1) for p in itertools.product(range(k), repeat=depth)))

    @classmethod
    def chain(cls, gamma: int) -> "TreeSpec":
        """A single path of the top-1 token of each stream (k = 1)."""
        return cls.full(gamma, 1)

    @classmethod
    def filling(cls, nodes: int, gamma: int) -> "TreeSpec":
        """A tree of exactly `nodes` nodes, at most gamma deep: the first nodes of the narrowest full tree
        that has as many (nodes are ordered by depth, so every parent is among them)."""
        if nodes < 2 or gamma < 1:
            raise ValueError(f"a filling tree needs nodes >= 2 and gamma >= 1, got nodes={nodes}, gamma={gamma}")
        k = 1
        while cls.full(gamma, k).num_nodes < nodes:
            k += 1
        return cls(cls.full(gamma, k).paths[: nodes - 1])

    def with_lookup(self, length: int) -> "TreeSpec":
        """This tree plus a lookup branch of `length` nodes below the root: stream 1's next unused
        rank, then rank 0 of each deeper stream (its tokens when lookup finds nothing)."""
        if not 1 <= length <= self.depth:
            raise ValueError(f"lookup={length}: give 1..{self.depth} (the tree's depth) lookup nodes")
        first = 1 + max(p[0] for p in self.paths)
        branch = tuple((first,) + (0,) * extra for extra in range(length))
        return TreeSpec(self.paths + branch, branch[-1])

    @classmethod
    def parse(cls, text: str) -> "TreeSpec":
        """'gamma=3,k=2' (',lookup=N' adds a lookup branch of N nodes), a JSON list of paths
        ('[[0],[1],[0,0]]'), a JSON object {"paths": [...], "lookup": [1, 0]}, or a file holding JSON."""
        text = text.strip()
        if text.startswith(("[", "{")):
            return cls._from_json(json.loads(text))
        if "=" in text:
            fields = dict(item.split("=", 1) for item in text.split(","))
            if not {"gamma", "k"} <= set(fields) <= {"gamma", "k", "lookup"}:
                raise ValueError(f"tree {text!r}: expected 'gamma=G,k=K[,lookup=N]' or a JSON list of paths")
            tree = cls.full(int(fields["gamma"]), int(fields["k"]))
            return tree.with_lookup(int(fields["lookup"])) if "lookup" in fields else tree
        from pathlib import Path as FilePath

        file = FilePath(text)
        if not file.is_file():
            raise ValueError(f"tree {text!r}: not 'gamma=G,k=K', a JSON list of paths, nor an existing JSON file")
        return cls._from_json(json.loads(file.read_text()))

    @classmethod
    def _from_json(cls, data) -> "TreeSpec":
        if isinstance(data, dict):
            return cls(tuple(tuple(p) for p in data["paths"]), tuple(data.get("lookup") or ()))
        return cls(tuple(tuple(p) for p in data))

    # --- derived buffers ---------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return 1 + len(self.paths)

    @cached_property
    def depth(self) -> int:
        """gamma: the deepest stream the tree uses."""
        return max((len(p) for p in self.paths), default=0)

    @cached_property
    def node_paths(self) -> tuple[Path, ...]:
        return ((),) + self.paths

    @cached_property
    def depths(self) -> list[int]:
        return [len(p) for p in self.node_paths]

    @cached_property
    def ranks(self) -> list[int]:
        """Candidate rank of each node within its stream's top-k (root: 0)."""
        return [p[-1] if p else 0 for p in self.node_paths]

    @cached_property
    def parents(self) -> list[int]:
        index = {p: i for i, p in enumerate(self.node_paths)}
        return [-1] + [index[p[:-1]] for p in self.paths]

    @cached_property
    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                kids[parent].append(node)
        return kids

    @cached_property
    def lookup_nodes(self) -> list[int]:
        """Node indices of the lookup branch, shallowest first ([] without one)."""
        index = {p: i for i, p in enumerate(self.node_paths)}
        return [index[self.lookup[:depth]] for depth in range(1, len(self.lookup) + 1)]

    @cached_property
    def widths(self) -> list[int]:
        """top-k needed from stream d (index d-1): one more than the largest rank at depth d."""
        return [1 + max(p[-1] for p in self.paths if len(p) == d) for d in range(1, self.depth + 1)]

    @cached_property
    def ancestor_mask(self) -> np.ndarray:
        """[T, T] bool: node i may attend to node j iff j is i or an ancestor of i (EAGLE-style,
        derived from parents)."""
        mask = np.eye(self.num_nodes, dtype=bool)
        for node in range(1, self.num_nodes):
            mask[node] |= mask[self.parents[node]]
        return mask

    # --- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"paths": [list(p) for p in self.paths], "lookup": list(self.lookup), "num_nodes": self.num_nodes,
                "depth": self.depth, "hash": self.hash()}

    @classmethod
    def from_dict(cls, data: dict) -> "TreeSpec":
        tree = cls._from_json(data)
        if "hash" in data and data["hash"] != tree.hash():
            raise ValueError(f"tree hash {data['hash']} does not match its paths ({tree.hash()}): the manifest was edited")
        return tree

    def hash(self) -> str:
        """Of the shape only: the lookup branch changes which tokens fill nodes, not the graphs."""
        return hashlib.sha256(json.dumps([list(p) for p in self.paths]).encode()).hexdigest()[:16]

    def check_streams(self, num_streams: int) -> None:
        """A tree deeper than the model's stream count has no drafts for its deep nodes."""
        if self.depth > num_streams:
            raise ValueError(f"tree depth {self.depth} needs {self.depth} streams but the model has {num_streams}; "
                             f"use a tree with gamma <= {num_streams}")
