"""One call's inputs for any of an artifact's graph methods, from the manifest's signature: random token ids and
caches (a call's time depends on shapes, not values), the tree each step bucket is timed with, `cache_len` at a
span, a commit that moves nothing. What the timing tools share (tools/call_times.py, tools/op_profile.py)."""

from __future__ import annotations

import numpy as np

from streamfuse.runtime.artifact.contract import COMMIT_INPUT, batch_inputs, tree_inputs
from streamfuse.runtime.speculation.tree import TreeSpec


def bucket_tree(trees: tuple[TreeSpec, ...], rows: int, gamma: int) -> TreeSpec:
    """The tree a step bucket of `rows` rows is timed with: the first of the artifact's that fits."""
    fitting = [tree for tree in trees if tree.num_nodes <= rows]
    return fitting[0] if fitting else TreeSpec.filling(rows, gamma)


def method_inputs(signature: dict, span: int, trees: tuple[TreeSpec, ...], gamma: int, vocab: int) -> list[np.ndarray]:
    """One call's inputs from the manifest's signature of a method, its cache `span` slots full."""
    g = np.random.default_rng(span)
    rows = next((i["shape"][1] for i in signature["inputs"] if i["name"] == "ids"), 1)
    has_tree = any(i["name"] == "tree" for i in signature["inputs"])
    sequences = 1
    if has_tree and len(next(i["shape"] for i in signature["inputs"] if i["name"] == "tree")) == 3:  # batched
        sequences = next(i["shape"][0] for i in signature["inputs"] if i["name"] == "tree")
        rows //= sequences
        tree = bucket_tree(trees, rows, gamma) if rows > 1 else TreeSpec(())
        tree_data = dict(zip(("tree", "depths"), batch_inputs([tree] * sequences, rows)))
    else:
        tree_data = (
            dict(zip(("tree", "depths", "parents"), tree_inputs(bucket_tree(trees, rows, gamma), rows)))
            if has_tree
            else {}
        )
    made = []
    for spec in signature["inputs"]:
        name, shape = spec["name"], spec["shape"]
        if name in tree_data:
            made.append(tree_data[name])
        elif name == "cache_len":
            made.append(np.full(sequences, span))
        elif name == "last":  # prefill: the chunk's last row is its last real prompt token
            made.append(np.array([rows - 1], dtype=np.int64))
        elif name == COMMIT_INPUT:
            made.append(np.full(shape, -1, dtype=np.int64))
        elif name == "ids":
            made.append(g.integers(0, vocab, shape))
        else:  # caches and stream anchors: values of a trained model's scale
            made.append(g.standard_normal(shape, dtype=np.float32) * 0.5)
    return made
