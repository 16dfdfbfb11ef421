"""Fuzz target: TreeSpec.parse on arbitrary text returns a tree within its bound or raises TreeSpecError with one
line; nothing else escapes, nothing hangs (libFuzzer's -timeout), nothing crashes.

    python tests/fuzz/tree/fuzz_tree.py -max_total_time=600 -timeout=5 /tmp/tree-corpus tests/fuzz/tree/seeds

(from the repository root: a spec naming a file is read relative to it, and one seed names a seed file).

(atheris: pip install atheris). Without atheris, `check` is what tests/test_input_errors.py runs on the seeds and on
hypothesis' strings. The first input byte picks the bound (an artifact's largest step graph, or none); the rest,
decoded as UTF-8 with undecodable bytes kept as lone surrogates (as Python decodes a command line), is the spec.
"""

from __future__ import annotations

import sys

from streamfuse.runtime.speculation.tree import MAX_DEPTH, MAX_NODES, TreeSpec, TreeSpecError

BOUNDS = (None, 1, 2, 4, 8, 15, 64, MAX_NODES, MAX_NODES + 5)
MAX_MESSAGE = 1000  # a one-line error stays short whatever the input


def spec_of(data: bytes) -> tuple[str, int | None]:
    """(spec text, max_nodes) of a fuzz input."""
    bound = BOUNDS[data[0] % len(BOUNDS)] if data else None
    return data[1:].decode("utf-8", "surrogateescape"), bound


def check(text: str, max_nodes: int | None = None) -> TreeSpec | None:
    """Parse `text`; assert the outcome is a valid tree within the bound or a one-line TreeSpecError."""
    try:
        tree = TreeSpec.parse(text, max_nodes)
    except TreeSpecError as error:
        message = str(error)
        assert message and "\n" not in message and "\r" not in message and len(message) <= MAX_MESSAGE, message
        return None
    limit = min(max_nodes or MAX_NODES, MAX_NODES)
    assert 2 <= tree.num_nodes <= limit and 1 <= tree.depth <= MAX_DEPTH, (text, tree.num_nodes)
    nodes = set(tree.node_paths)
    assert len(nodes) == tree.num_nodes and all(p[:-1] in nodes for p in tree.paths)
    assert all(0 <= parent < node for node, parent in enumerate(tree.parents) if node)
    assert all(0 <= rank < MAX_NODES for path in tree.paths for rank in path)
    assert not tree.lookup or tree.lookup in nodes
    return tree


def test_one_input(data: bytes) -> None:
    check(*spec_of(data))


def main() -> None:
    import atheris

    atheris.instrument_all()  # coverage of the parser (and json's Python side), loaded above
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
