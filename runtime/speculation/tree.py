"""Static tree drafts as data (paper 3.2.2, A.1; Medusa-style paths).

Node 0 is the root: the main stream's correction token. Every other node is written as its
path from the root, a tuple of candidate ranks: (0, 1) is "the top-1 token of stream 1, then
the top-2 token of stream 2". A node at depth d always takes its token from stream d, so the
full top-k tree of the paper is every path of length 1..gamma with ranks < k
(1 + sum_g k^g nodes). Nodes are ordered by (depth, path), so parents precede children.
All buffers are built once; the additive tree mask is a constant of the tree.

One branch may be a *lookup* branch (`lookup`, a path from the root): its nodes take the
tokens that followed the latest earlier occurrence of the context's last n-gram (prompt
lookup, runtime/speculation/lookup.py) and fall back to their own stream ranks where lookup has nothing.
It changes which tokens fill the nodes, never the shape, so graphs built for the paths run it;
the hash (what graphs depend on) covers the paths only.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path as FilePath

import numpy as np

Path = tuple[int, ...]

# Bounds every tree is checked against before anything is enumerated (a caller may bound it further: an artifact by
# its largest step graph). Trees that decode well have tens of nodes, a few levels deep; these leave room.
MAX_NODES = 1024  # the root included: a step's tree mask alone is MAX_NODES^2 entries
MAX_DEPTH = 64  # gamma: one stream per level
MAX_SPEC_CHARS = 1 << 20  # a spec's text or file; a tree within the bounds above takes far less
SPEC_FORMS = "'gamma=G,k=K[,lookup=N]', a JSON list of paths such as '[[0],[1],[0,0]]', or a JSON file of one"
WHOLE = re.compile(r"[0-9]{1,9}")


class TreeSpecError(ValueError):
    """A draft tree spec that does not describe a tree (within the bounds): its one-line message says why and how."""


@dataclass(frozen=True)
class TreeSpec:
    paths: tuple[Path, ...]  # non-root nodes, each as its rank path from the root
    lookup: Path = ()  # the lookup branch's deepest node (); (): no lookup branch

    def __post_init__(self):
        paths = _paths(self.paths)
        ordered = tuple(sorted(set(paths), key=lambda p: (len(p), p)))
        if len(ordered) != len(paths):
            raise TreeSpecError("tree paths contain duplicates: give each path once")
        nodes = set(ordered)
        for path in ordered:
            if len(path) > 1 and path[:-1] not in nodes:
                raise TreeSpecError(
                    f"tree path {_brief(list(path))} has no parent {_brief(list(path[:-1]))}: every "
                    f"prefix must be a node too"
                )
        object.__setattr__(self, "paths", ordered)
        lookup = _path(self.lookup, "lookup branch", empty=True)
        if lookup and lookup not in nodes:
            raise TreeSpecError(
                f"lookup branch {list(lookup)} is not a node of the tree: give the path of one of its nodes"
            )
        object.__setattr__(self, "lookup", lookup)

    @classmethod
    def full(cls, gamma: int, k: int, max_nodes: int = MAX_NODES) -> TreeSpec:
        """The paper's tree: top-k of each of gamma streams, every combination (its size checked first)."""
        if gamma < 1 or k < 1:
            raise TreeSpecError(f"gamma and k must be >= 1, got gamma={gamma}, k={k}")
        if gamma > MAX_DEPTH:
            raise TreeSpecError(f"gamma={gamma} is deeper than any model's streams: give gamma <= {MAX_DEPTH}")
        if full_size(gamma, k) > max_nodes:
            raise TreeSpecError(too_large(full_size(gamma, k), max_nodes, "the most a tree may have here"))
        paths, level = [], [()]
        for _ in range(gamma):
            level = [parent + (rank,) for parent in level for rank in range(k)]
            paths.extend(level)
        return cls(tuple(paths))

    @classmethod
    def chain(cls, gamma: int) -> TreeSpec:
        """A single path of the top-1 token of each stream (k = 1)."""
        return cls.full(gamma, 1)

    @classmethod
    def filling(cls, nodes: int, gamma: int) -> TreeSpec:
        """A tree of exactly `nodes` nodes, at most gamma deep: the first nodes of the narrowest full tree
        that has as many (nodes are ordered by depth, so every parent is among them)."""
        if not 2 <= nodes <= MAX_NODES or not 1 <= gamma <= MAX_DEPTH:
            raise TreeSpecError(
                f"a filling tree needs 2 <= nodes <= {MAX_NODES} and 1 <= gamma <= {MAX_DEPTH}, got "
                f"nodes={nodes}, gamma={gamma}"
            )
        k = 1
        while full_size(gamma, k) < nodes:
            k += 1
        paths, level = [], [()]
        while len(paths) < nodes - 1:  # level by level, each in order: the full tree's first nodes only
            level = [parent + (rank,) for parent in level[: nodes - 1 - len(paths)] for rank in range(k)]
            paths.extend(level)
        return cls(tuple(paths[: nodes - 1]))

    def with_lookup(self, length: int) -> TreeSpec:
        """This tree plus a lookup branch of `length` nodes below the root: stream 1's next unused
        rank, then rank 0 of each deeper stream (its tokens when lookup finds nothing)."""
        if not 1 <= length <= self.depth:
            raise TreeSpecError(f"lookup={length}: give 1..{self.depth} (the tree's depth) lookup nodes")
        first = 1 + max(p[0] for p in self.paths)
        branch = tuple((first,) + (0,) * extra for extra in range(length))
        return TreeSpec(self.paths + branch, branch[-1])

    @classmethod
    def parse(cls, text: str, max_nodes: int | None = None, bound: str = "the most a tree may have") -> TreeSpec:
        """'gamma=3,k=2' (',lookup=N' adds a lookup branch of N nodes), a JSON list of paths
        ('[[0],[1],[0,0]]'), a JSON object {"paths": [...], "lookup": [1, 0]}, or a file holding JSON.
        At most max_nodes nodes (default and cap MAX_NODES; `bound` says what sets it), checked before any is
        made; anything else is a TreeSpecError."""
        limit = min(max_nodes, MAX_NODES) if max_nodes is not None else MAX_NODES
        if not isinstance(text, str):
            raise TreeSpecError(f"a tree spec is text ({SPEC_FORMS}), got {type(text).__name__}")
        try:
            tree = cls._parse(text, limit, bound)
            if not tree.paths:
                raise TreeSpecError("a draft tree needs at least one path below the root, e.g. [[0]]")
            if tree.num_nodes > limit:
                raise TreeSpecError(too_large(tree.num_nodes, limit, bound))
        except TreeSpecError as error:
            raise TreeSpecError(f"tree {_shown(text)}: {error}") from None
        return tree

    @classmethod
    def _parse(cls, text: str, limit: int, bound: str) -> TreeSpec:
        if len(text) > MAX_SPEC_CHARS:
            raise TreeSpecError(f"longer than {MAX_SPEC_CHARS} characters, which no tree within the bounds needs")
        text = text.strip()
        if text.startswith(("[", "{")):
            return cls._from_json(_json(text))
        if "=" in text:
            return cls._from_fields(text, limit, bound)
        return cls._from_json(_json(_spec_file(text)))

    @classmethod
    def _from_fields(cls, text: str, limit: int, bound: str) -> TreeSpec:
        """'gamma=G,k=K[,lookup=N]'."""
        fields: dict[str, int] = {}
        for item in text.split(","):
            key, equals, value = (part.strip() for part in item.partition("="))
            if not equals or key not in ("gamma", "k", "lookup") or key in fields:
                raise TreeSpecError(f"expected {SPEC_FORMS}")
            if not WHOLE.fullmatch(value):
                raise TreeSpecError(f"{key} must be a whole number, got {_shown(value)}")
            fields[key] = int(value)
        if not {"gamma", "k"} <= set(fields):
            raise TreeSpecError(f"expected {SPEC_FORMS}")
        if 1 <= fields["gamma"] <= MAX_DEPTH and full_size(fields["gamma"], fields["k"]) > limit:
            raise TreeSpecError(too_large(full_size(fields["gamma"], fields["k"]), limit, bound))
        tree = cls.full(fields["gamma"], fields["k"], limit)
        return tree.with_lookup(fields["lookup"]) if "lookup" in fields else tree

    @classmethod
    def _from_json(cls, data) -> TreeSpec:
        if isinstance(data, dict):
            unknown = sorted(map(str, set(data) - {"paths", "lookup", "num_nodes", "depth", "hash"}))
            if "paths" not in data or unknown:
                raise TreeSpecError(
                    f'a tree object needs "paths" (and may have "lookup"); '
                    f"{'unknown keys ' + _shown(', '.join(unknown)) if unknown else 'it has none'}"
                )
            lookup = data.get("lookup")
            return cls(_paths(data["paths"]), () if lookup is None else lookup)
        return cls(_paths(data))

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
        return {
            "paths": [list(p) for p in self.paths],
            "lookup": list(self.lookup),
            "num_nodes": self.num_nodes,
            "depth": self.depth,
            "hash": self.hash(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> TreeSpec:
        if not isinstance(data, dict):
            raise TreeSpecError(f'a tree record is a JSON object with "paths", got {type(data).__name__}')
        tree = cls._from_json(data)
        if "hash" in data and data["hash"] != tree.hash():
            raise TreeSpecError(
                f"tree hash {_brief(data['hash'])} does not match its paths ({tree.hash()}): the manifest was edited"
            )
        return tree

    def hash(self) -> str:
        """Of the shape only: the lookup branch changes which tokens fill nodes, not the graphs."""
        return hashlib.sha256(json.dumps([list(p) for p in self.paths]).encode()).hexdigest()[:16]

    def check_streams(self, num_streams: int) -> None:
        """A tree deeper than the model's stream count has no drafts for its deep nodes."""
        if self.depth > num_streams:
            raise ValueError(
                f"tree depth {self.depth} needs {self.depth} streams but the model has {num_streams}; "
                f"use a tree with gamma <= {num_streams}"
            )


def full_size(gamma: int, k: int) -> int:
    """Nodes of the full tree gamma, k, the root included: counted, not made (gamma <= MAX_DEPTH keeps it cheap)."""
    return gamma + 1 if k == 1 else (k ** (gamma + 1) - 1) // (k - 1)


def too_large(nodes: int, limit: int, bound: str) -> str:
    count = f"{nodes:,}" if nodes < 10**15 else "over 10^15"
    return f"{count} nodes is larger than {bound} ({limit} nodes): use a smaller gamma or k, or fewer paths"


def _shown(text: str, most: int = 40) -> str:
    """`text` quoted for a one-line message: escaped (newlines, lone surrogates) and cut to `most` characters."""
    return repr(text if len(text) <= most else text[:most] + "...")


def _brief(value: object, most: int = 40) -> str:
    """A value's repr for a one-line message, cut to `most` characters."""
    text = repr(value)
    return text if len(text) <= most else text[:most] + "..."


def _path(value, what: str, empty: bool = False) -> Path:
    """A rank path (list or tuple of whole numbers in 0..MAX_NODES-1, at most MAX_DEPTH of them) as a tuple."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TreeSpecError(f"{what} {_brief(value)} is not a list of ranks: write a path such as [0, 1]")
    if len(value) > MAX_DEPTH or (not value and not empty):
        raise TreeSpecError(f"{what} has {len(value)} ranks: a path holds 1..{MAX_DEPTH} of them")
    for rank in value:
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < MAX_NODES:
            raise TreeSpecError(
                f"{what} {_brief(list(value))} must hold whole ranks >= 0 and < {MAX_NODES}, got {_brief(rank)}"
            )
    return tuple(int(rank) for rank in value)


def _paths(value) -> tuple[Path, ...]:
    """The non-root nodes' paths, checked: a list (or tuple) of at most MAX_NODES - 1 rank paths."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TreeSpecError(
            f"tree paths must be a list of rank paths such as [[0], [1], [0, 0]], got {type(value).__name__}"
        )
    if len(value) > MAX_NODES - 1:
        raise TreeSpecError(f"{len(value)} paths: a tree has at most {MAX_NODES} nodes, the root included")
    return tuple(_path(path, "tree path") for path in value)


def _json(text: str):
    try:
        return json.loads(text)
    except RecursionError:
        raise TreeSpecError("JSON nested too deeply for a tree (a path is a flat list of ranks)") from None
    except ValueError as error:  # JSONDecodeError, or an integer past Python's digit limit
        message = error.msg if isinstance(error, json.JSONDecodeError) else str(error).split(":")[0]
        raise TreeSpecError(f"not valid JSON ({message}); expected {SPEC_FORMS}") from None


def _spec_file(text: str) -> str:
    """The text of a tree file (UTF-8 JSON), read no further than MAX_SPEC_CHARS."""
    try:
        file = FilePath(text)
        if not text or not file.is_file():
            raise TreeSpecError(f"not {SPEC_FORMS} (no such file)")
        with file.open("rb") as handle:
            raw = handle.read(MAX_SPEC_CHARS + 1)
    except (OSError, ValueError) as error:  # ValueError: a NUL byte or a lone surrogate in the name
        if isinstance(error, TreeSpecError):
            raise
        raise TreeSpecError(f"not {SPEC_FORMS} (the file cannot be read: {type(error).__name__})") from None
    if len(raw) > MAX_SPEC_CHARS:
        raise TreeSpecError(f"the file is larger than {MAX_SPEC_CHARS} bytes, which no tree within the bounds needs")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise TreeSpecError(
            f"the file is not UTF-8 text ({error.reason} at byte {error.start}): save it as UTF-8 JSON"
        ) from None
