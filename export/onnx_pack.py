"""`pack_linears`: linear layers of a method that read the same activations become one layer and a Split.

q / k / v and gate / up, each with its low-rank term, -> one product, one term and a Split; streamfuse.Q4Linear
siblings -> one Q4Linear (activations quantized once, each sibling's LoRA its own segment) and a Split. Both
products stay row-wise (see export/onnx_passes.py), and a column sums the same terms in the same order as its own
layer did.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from streamfuse.export.onnx_nodes import Graph, branches
from streamfuse.runtime.ops import q4_linear

OWN_LINEAR, OWN_WIDTH, OWN_TILE = "Q4Linear", "out_features", 16  # streamfuse's 4-bit op (runtime/ops/q4_linear.py)


class _Linear(NamedTuple):
    """A linear layer in a graph: `product` (MatMulNBits on constants, or MatMul by a constant [K, N]) of x,
    plus (x · left) · right (two MatMuls by constants: Q4_1's block offsets and LoRA, export/low_bit.py) when
    `add` sums them."""

    product: object
    left: object = None
    right: object = None
    add: object = None

    @property
    def nodes(self) -> list:
        return [n for n in (self.product, self.left, self.right, self.add) if n is not None]

    @property
    def output(self) -> str:
        return (self.add or self.product).output[0]

    def key(self) -> tuple:
        """What siblings must share to be packed: the input, the op and its attributes but N, the term's form."""
        attributes = tuple(sorted((a.name, a.i) for a in self.product.attribute if a.name not in ("N", OWN_WIDTH)))
        return (self.product.input[0], self.product.op_type, len(self.product.input), attributes, self.add is None)


def pack_linears(model) -> int:
    """Linear layers of a method that read the same activations (q / k / v; gate / up) -> one layer on their
    weights side by side, its output split: per SmolLM2 layer 12 nodes -> 5 and 8 -> 5. A column's terms are
    summed as in its own layer (the low-rank term's added columns are exact zeros), and both products stay
    row-wise, so rows keep their bits whatever the call. Returns how many linear layers went into packs."""
    constants = {t.name: t for t in model.graph.initializer}
    made: dict[tuple, str] = {}  # tensors built once for every method that packs the same layers
    packed = 0
    for branch in branches(model):
        graph = Graph(branch, constants)
        groups: dict[tuple, list[_Linear]] = {}
        for linear in _linears(graph):
            groups.setdefault(linear.key(), []).append(linear)
        packs = [s for s in groups.values() if len(s) > 1 and _whole_tiles(graph, s)]
        graph.replace_all(
            [
                ([n for linear in siblings for n in linear.nodes], _packed(model, siblings, graph, made), True)
                for siblings in packs
            ]
        )
        packed += sum(len(siblings) for siblings in packs)
    return packed


def _linears(graph: Graph) -> list[_Linear]:
    """The graph's linear layers: products with their low-rank terms first, then bare products."""
    found, taken = [], set()
    for add in (n for n in graph.graph.node if n.op_type == "Add"):
        for first, second in (add.input, reversed(add.input)):
            product, right = graph.only(first, "MatMulNBits"), graph.only(second, "MatMul")
            left = right and graph.only(right.input[0], "MatMul")
            if (
                product
                and left
                and _constant_product(graph, product)
                and left.input[0] == product.input[0]
                and _matrix(graph, left.input[1])
                and _matrix(graph, right.input[1])
            ):
                found.append(_Linear(product, left, right, add))
                taken.update(n.output[0] for n in (product, left, right, add))
                break
    for node in graph.graph.node:
        if node.output[0] not in taken and _constant_product(graph, node):
            found.append(_Linear(node))
    return found


def _whole_tiles(graph: Graph, siblings: list[_Linear]) -> bool:
    """Q4Linear siblings pack by stacking their weights' tiles: each must fill its last tile of 16 columns."""
    return siblings[0].product.op_type != OWN_LINEAR or all(
        _columns(graph, linear.product) % OWN_TILE == 0 for linear in siblings
    )


def _constant_product(graph: Graph, node) -> bool:
    if node.op_type == OWN_LINEAR:
        return len(node.input) == 5 and all(graph.dims(name) is not None for name in node.input[1:])
    if node.op_type == "MatMulNBits":
        return len(node.input) <= 4 and all(graph.dims(name) is not None for name in node.input[1:])
    return node.op_type == "MatMul" and graph.dims(node.input[0]) is None and _matrix(graph, node.input[1])


def _matrix(graph: Graph, name: str) -> bool:
    dims = graph.dims(name)
    return dims is not None and len(dims) == 2


def _packed(model, siblings: list[_Linear], graph: Graph, made: dict) -> list:
    """The nodes computing `siblings` as one layer, then one Split into their outputs."""
    from onnx import helper, numpy_helper

    first = siblings[0]
    sizes = [_columns(graph, linear.product) for linear in siblings]
    name = f"{first.output}/packed"

    def tensor(parts: list[str], build) -> str:
        key = tuple(parts)
        if key not in made:
            made[key] = f"{parts[0]}+{len(made)}"
            model.graph.initializer.append(numpy_helper.from_array(build(), made[key]))
            graph.constants[made[key]] = model.graph.initializer[-1]
        return made[key]

    inputs = [first.product.input[0]]
    if first.product.op_type == OWN_LINEAR:
        inputs += _packed_own(siblings, graph, tensor)
    for slot in range(len(inputs), len(first.product.input)):
        parts = [linear.product.input[slot] for linear in siblings]
        axis = 0 if first.product.op_type == "MatMulNBits" else 1  # NBits: [N, ..]; MatMul: [K, N]
        inputs.append(tensor(parts, lambda: np.concatenate([graph.value(p) for p in parts], axis=axis)))
    attributes = {a.name: helper.get_attribute_value(a) for a in first.product.attribute}
    for width in ("N", OWN_WIDTH):
        if width in attributes:
            attributes[width] = sum(sizes)
    nodes = [
        helper.make_node(
            first.product.op_type,
            inputs,
            [f"{name}/product"],
            name=f"{name}/product",
            domain=first.product.domain,
            **attributes,
        )
    ]
    total = f"{name}/product"
    if first.add is not None:
        lefts = [linear.left.input[1] for linear in siblings]
        rights = [linear.right.input[1] for linear in siblings]

        @functools.cache  # built once, for the first method that packs these layers
        def term() -> tuple[np.ndarray, np.ndarray]:
            return low_rank([graph.value(p) for p in lefts], [graph.value(p) for p in rights])

        left_name = lefts[0] if len(set(lefts)) == 1 else tensor(lefts, lambda: term()[0])
        right_name = tensor(rights, lambda: term()[1])
        x = first.product.input[0]
        nodes += [
            helper.make_node("MatMul", [x, left_name], [f"{name}/left"], name=f"{name}/left"),
            helper.make_node("MatMul", [f"{name}/left", right_name], [f"{name}/right"], name=f"{name}/right"),
            helper.make_node("Add", [total, f"{name}/right"], [f"{name}/sum"], name=f"{name}/sum"),
        ]
        total = f"{name}/sum"
    split = tensor([f"split/{'-'.join(map(str, sizes))}"], lambda: np.array(sizes, np.int64))
    nodes.append(
        helper.make_node("Split", [total, split], [linear.output for linear in siblings], name=f"{name}/split", axis=-1)
    )
    return nodes


def _packed_own(siblings: list[_Linear], graph: Graph, tensor) -> list[str]:
    """Q4Linear siblings' weights and LoRA as one layer's: the weights' tiles stacked, and each sibling's LoRA its own
    segment (q4_linear.join_lora: A's columns side by side, U's blocks one after another, rank_splits listing each
    sibling's tiles and rank), so a column sums its own layer's rank terms and no zeros of the others'."""
    names = [[linear.product.input[slot] for linear in siblings] for slot in (1, 2, 3, 4)]

    @functools.cache  # built once, for the first method that packs these layers
    def lora() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return q4_linear.join_lora([tuple(graph.value(n[i]) for n in names[1:]) for i in range(len(siblings))])

    return [
        tensor(names[0], lambda: np.concatenate([graph.value(n) for n in names[0]], axis=0)),
        *(tensor(names[1 + part], lambda part=part: lora()[part]) for part in range(3)),
    ]


def _columns(graph: Graph, product) -> int:
    if product.op_type == OWN_LINEAR:
        return next(a.i for a in product.attribute if a.name == OWN_WIDTH)
    if product.op_type == "MatMulNBits":
        return next(a.i for a in product.attribute if a.name == "N")
    return graph.dims(product.input[1])[1]


def low_rank(lefts: list[np.ndarray], rights: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """One (x · left) · right for several: the columns every left starts with (Q4_1's block sums) once, then each
    left's own (its LoRA's A); right holds each layer's rows in its own columns and zeros elsewhere, so every output
    column sums the same terms in the same order as its own layer did, plus exact zeros."""
    shared = min(left.shape[1] for left in lefts)
    while shared and not all(np.array_equal(left[:, :shared], lefts[0][:, :shared]) for left in lefts):
        shared -= 1
    left = np.concatenate([lefts[0][:, :shared]] + [left[:, shared:] for left in lefts], axis=1)
    right = np.zeros((left.shape[1], sum(r.shape[1] for r in rights)), np.float32)
    row, column = shared, 0
    for own in rights:
        right[:shared, column : column + own.shape[1]] = own[:shared]
        right[row : row + own.shape[0] - shared, column : column + own.shape[1]] = own[shared:]
        row, column = row + own.shape[0] - shared, column + own.shape[1]
    return left, right
