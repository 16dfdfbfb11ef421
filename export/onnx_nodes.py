"""What the ONNX passes (export/onnx_passes.py, export/onnx_pack.py) read of a graph: each value's producer and how
many nodes read it, and the methods' graphs inside the combined model."""

from __future__ import annotations


class Graph:
    """One graph's producers and consumer counts; constants are the top graph's initializers."""

    def __init__(self, graph, constants: dict):
        self.graph, self.constants = graph, constants
        self.producer = {o: n for n in graph.node for o in n.output}
        self.claimed: set[str] = set()
        self.uses: dict[str, int] = {}
        for node in graph.node:
            for name in node.input:
                self.uses[name] = self.uses.get(name, 0) + 1
        for out in graph.output:
            self.uses[out.name] = self.uses.get(out.name, 0) + 1

    def only(self, name: str, op: str):
        """The node of type `op` producing `name`, if `name` is read once (so the node can go)."""
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op and self.uses.get(name) == 1 else None

    def value(self, name: str):
        from onnx import numpy_helper

        tensor = self.constants.get(name)
        return None if tensor is None or tensor.data_location == tensor.EXTERNAL else numpy_helper.to_array(tensor)

    def dims(self, name: str) -> tuple | None:
        """A constant's shape, without reading its bytes; None if `name` is no constant in memory."""
        tensor = self.constants.get(name)
        return None if tensor is None or tensor.data_location == tensor.EXTERNAL else tuple(tensor.dims)

    def claim(self, nodes: list) -> bool:
        """Mark `nodes` for one rewrite; False if a rewrite already took one of them (rewrites must be disjoint)."""
        outputs = {n.output[0] for n in nodes}
        if outputs & self.claimed:
            return False
        self.claimed |= outputs
        return True

    def replace_all(self, edits: list[tuple[list, list, bool]]) -> None:
        """Each (dead, new, first): remove the dead nodes and put `new` where the last of them stood, or the first
        (`first`: for new nodes that read only what came before any dead node), so graphs stay topologically sorted.
        The graph's nodes are rebuilt once: protobuf keeps every copy of a rebuilt list until the model goes (one
        rebuild per match cost GBs in the build)."""
        dead_outputs = {n.output[0] for dead, _, _ in edits for n in dead}
        position = {node.output[0]: index for index, node in enumerate(self.graph.node)}
        inserts: dict[str, list] = {}
        for dead, new, first in edits:
            places = sorted(position[n.output[0]] for n in dead)
            inserts.setdefault(self.graph.node[places[0 if first else -1]].output[0], []).extend(new)
        kept = []
        for node in self.graph.node:
            kept += inserts.get(node.output[0], [])
            if node.output[0] not in dead_outputs:
                kept.append(node)
        del self.graph.node[:]
        self.graph.node.extend(kept)
        self.__init__(self.graph, self.constants)


def branches(model):
    """The methods' graphs: the branches of the top graph's Ifs."""
    for node in model.graph.node:
        for attribute in node.attribute:
            if attribute.HasField("g"):
                yield attribute.g
