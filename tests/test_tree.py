"""Tree buffers against literal tables."""

import pytest

from streamfuse.runtime.backends.base import PruneConfig
from streamfuse.runtime.backends.static_graph import keep_nodes
from streamfuse.runtime.speculation.tree import TreeSpec


def test_full_tree_gamma2_k2_tables():
    tree = TreeSpec.full(gamma=2, k=2)
    assert tree.num_nodes == 1 + 2 + 4
    assert tree.node_paths == ((), (0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1))
    assert tree.depths == [0, 1, 1, 2, 2, 2, 2]
    assert tree.parents == [-1, 0, 0, 1, 1, 2, 2]
    assert tree.ranks == [0, 0, 1, 0, 1, 0, 1]
    assert tree.widths == [2, 2]
    assert tree.ancestor_mask.astype(int).tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 0, 1],
    ]


def test_custom_paths_sorted_and_sized():
    tree = TreeSpec(((0, 0, 0), (1,), (0,), (0, 0)))
    assert tree.paths == ((0,), (1,), (0, 0), (0, 0, 0))
    assert tree.depth == 3 and tree.widths == [2, 1, 1]
    assert TreeSpec.full(3, 3).num_nodes == 1 + 3 + 9 + 27


def test_serialisation_round_trip_and_tamper_check():
    tree = TreeSpec.parse("gamma=3,k=2")
    assert TreeSpec.from_dict(tree.to_dict()) == tree
    assert TreeSpec.parse("[[0],[1],[0,0]]") == TreeSpec(((0,), (1,), (0, 0)))
    edited = {**tree.to_dict(), "paths": [[0]]}
    with pytest.raises(ValueError, match="manifest was edited"):
        TreeSpec.from_dict(edited)


@pytest.mark.parametrize(
    "paths, message",
    [
        (((0, 0),), "no parent"),
        (((0,), (0,)), "duplicates"),
        (((-1,),), "ranks >= 0"),
    ],
)
def test_bad_trees_are_rejected(paths, message):
    with pytest.raises(ValueError, match=message):
        TreeSpec(paths)


def test_tree_deeper_than_streams_is_rejected():
    with pytest.raises(ValueError, match="needs 3 streams but the model has 2"):
        TreeSpec.full(3, 1).check_streams(2)


def test_pruning_threshold_and_budget_tables():
    tree = TreeSpec.full(gamma=2, k=2)  # nodes: root, a=(0), b=(1), aa, ab, ba, bb
    transition = [1.0, 0.6, 0.3, 0.5, 0.05, 0.9, 0.2]
    # threshold: ab (0.05) goes; path scores aa .30, ba .27, bb .06
    assert keep_nodes(tree, transition, PruneConfig(threshold=0.1)) == [True, True, True, True, False, True, True]
    # budget 3 by path probability: a .6, b .3, aa .3 (tie with b broken by index), ba .27 out
    assert keep_nodes(tree, transition, PruneConfig(budget=3)) == [True, True, True, True, False, False, False]
    # b below threshold removes its whole subtree
    assert keep_nodes(tree, [1.0, 0.6, 0.01, 0.5, 0.5, 0.9, 0.9], PruneConfig(threshold=0.1)) == [
        True,
        True,
        False,
        True,
        True,
        False,
        False,
    ]


def test_lookup_branch_tables():
    tree = TreeSpec.parse("gamma=3,k=1,lookup=3")
    assert [list(p) for p in tree.node_paths] == [[], [0], [1], [0, 0], [1, 0], [0, 0, 0], [1, 0, 0]]
    assert tree.lookup == (1, 0, 0)
    assert tree.lookup_nodes == [2, 4, 6]
    assert tree.widths == [2, 1, 1]  # the branch falls back to stream 1's second candidate
    # The shape is what graphs are built for: the lookup branch does not change the hash.
    assert tree.hash() == TreeSpec(tree.paths).hash()
    assert TreeSpec.from_dict(tree.to_dict()) == tree
    assert TreeSpec.parse('{"paths": [[0], [1], [1, 0]], "lookup": [1, 0]}').lookup_nodes == [2, 3]
    assert TreeSpec.parse("[[0],[1],[0,0],[0,0,0]]").with_lookup(2).lookup == (2, 0)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: TreeSpec(((0,), (1,)), lookup=(1, 0)), "not a node of the tree"),
        (lambda: TreeSpec.chain(2).with_lookup(3), "give 1..2"),
        (lambda: TreeSpec.parse("gamma=2,k=1,lookahead=2"), "expected 'gamma=G,k=K"),
    ],
)
def test_bad_lookup_branches_are_rejected(make, message):
    with pytest.raises(ValueError, match=message):
        make()
