"""Rewrites of the combined ONNX model (export/onnx_methods.py) that cut what ONNX Runtime holds and runs.

ONNX Runtime keeps ~6.6 KiB per node of a loaded graph (measured on SmolLM2's methods: 16 MiB for decode's
2,100 nodes, 6 MiB for streams' 590), the model has four such graphs, and each node costs a few microseconds a
call. So:

- `fuse_rms_norm`: the exporter's RMSNorm, Pow -> ReduceMean -> Add(eps) -> Sqrt -> Reciprocal -> Mul(x) ->
  Mul(weight), becomes one SimplifiedLayerNormalization (ONNX Runtime's op, onnx domain): 7 nodes -> 1.
- `fuse_skip_norm`: every such norm -> SkipSimplifiedLayerNormalization, with the residual Add it reads.
- `fuse_rotary`: rotary embedding, x·cos + cat(-x2, x1)·sin (Mul, Slice, Slice, Neg, Concat, Mul, Add) on
  q and k, becomes ONNX's RotaryEmbedding (opset 23) on the first half of cos / sin: 7 nodes -> 1.
- `pack_linears`: q / k / v and gate / up, each with its low-rank term, -> one product, one term and a Split;
  streamfuse.Q4Linear siblings -> one Q4Linear (activations quantized once) and a Split.
- `drop_unused_initializers`: the constants only the replaced nodes read.
- `lift_embedding`: the embedding gathers the tied LM head's Q8 codes; an initializer a Gather reads stays
  mapped and its pages resident (the head's prepacking touches them all: 30 MiB of SmolLM2), so the gathered
  tables become graph inputs the host feeds from its own read-only map of weights.bin (the same bytes, each
  page resident only once a token reads it), and the head's MatMulNBits alone holds the initializer, which
  ONNX Runtime releases once packed.

Every fused op is row-wise: a row's bits do not depend on the call's other rows, so SS stays plain decoding
(tests/test_onnx_passes.py, 1 to 16 rows on 1 and 2 threads; the export tests check every tree row end to end).
The rewrites keep what the graphs compute (the same test file, on a Hugging Face Llama's exported graphs). The
opset rises to 23 for RotaryEmbedding; no op the graphs use changed meaning since 18.
"""

from __future__ import annotations

import functools
import json
from typing import NamedTuple

import numpy as np

from streamfuse.runtime.backends.static_graph import EMBEDDING_METADATA

ROTARY_OPSET = 23  # ONNX's RotaryEmbedding
GATHERS = ("Gather", "GatherND")
MICROSOFT = "com.microsoft"  # ONNX Runtime's own ops
LIFT_BYTES = 1 << 20  # gathered tables this large are fed by the host; smaller ones (id maps) stay
OWN_LINEAR, OWN_WIDTH, OWN_TILE = "Q4Linear", "out_features", 16  # streamfuse's 4-bit op (runtime/q4_linear.py)


class _Graph:
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


def _branches(model):
    """The methods' graphs: the branches of the top graph's Ifs."""
    for node in model.graph.node:
        for attribute in node.attribute:
            if attribute.HasField("g"):
                yield attribute.g


def _graphs(graph):
    """`graph` and every graph nested in its nodes."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                yield from _graphs(sub)


def _scalar(graph: _Graph, name: str) -> float | None:
    value = graph.value(name)
    return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None


def fuse_rms_norm(model) -> int:
    """Every RMSNorm of every method -> SimplifiedLayerNormalization; returns how many."""
    from onnx import helper

    constants = {t.name: t for t in model.graph.initializer}
    fused = 0
    for branch in _branches(model):
        graph, edits = _Graph(branch, constants), []
        for scale in [n for n in branch.node if n.op_type == "Mul"]:
            match = _rms_norm(graph, scale)
            if match is None or not graph.claim(match[-1]):
                continue
            x, weight, eps, dead = match
            node = helper.make_node("SimplifiedLayerNormalization", [x, weight], [scale.output[0]],
                                    name=f"{scale.name}/rms_norm", axis=-1, epsilon=eps, stash_type=1)
            edits.append((dead, [node], False))
            fused += 1
        graph.replace_all(edits)
    return fused


def fuse_skip_norm(model) -> int:
    """Every SimplifiedLayerNormalization -> SkipSimplifiedLayerNormalization (ONNX Runtime's op, on 2-D or 3-D
    tensors): the residual Add a norm reads joins it where both terms have one known shape (2 nodes -> 1; the op
    returns the sum for the next residual too), and every other norm gets a skip of zeros (x - x; x + 0 is x, -0
    aside), its input flattened to rows where its rank is not 2 or 3. The two kernels round differently, and a row's
    norm must be the same arithmetic in every method (a tree step concatenates stream rows before a norm that
    decode feeds straight from the Add), so every norm takes the skip kernel. Reads the branches' value_info (run
    before strip_debug_info, after fuse_rms_norm); returns how many Adds joined their norm."""
    from onnx import helper

    constants = {t.name: t for t in model.graph.initializer}
    joined = 0
    for branch in _branches(model):
        graph, shapes, edits = _Graph(branch, constants), _shapes(branch), []
        for norm in [n for n in branch.node if n.op_type == "SimplifiedLayerNormalization"]:
            add = graph.producer.get(norm.input[0])
            if add is not None and add.op_type == "Add" and _same_rows(shapes, add.input) and graph.claim([add]):
                skip = _skip_norm(helper, norm, list(add.input), [norm.output[0], "", "", add.output[0]])
                edits.append(([add, norm], [skip], True))
                joined += 1
            else:
                rank = len(shapes.get(norm.input[0], ()))
                edits.append(([norm], _zero_skip_norm(helper, norm, rank, graph, model), False))
        graph.replace_all(edits)
    return joined


def _shapes(graph) -> dict[str, tuple]:
    """{value: its dims (an int or a symbol each)} from the graph's value_info."""
    return {info.name: tuple(d.dim_value if d.HasField("dim_value") else d.dim_param
                             for d in info.type.tensor_type.shape.dim)
            for info in graph.value_info if info.type.tensor_type.HasField("shape")}


def _same_rows(shapes: dict, names) -> bool:
    """Both terms have the same known 2-D or 3-D shape (the skip op takes no other)."""
    first, second = (shapes.get(name) for name in names)
    return first is not None and first == second and len(first) in (2, 3) and all(d not in (0, "") for d in first)


def _skip_norm(helper, norm, inputs: list[str], outputs: list[str]):
    eps = next(a.f for a in norm.attribute if a.name == "epsilon")
    return helper.make_node("SkipSimplifiedLayerNormalization", [*inputs, norm.input[1]], outputs,
                            name=f"{norm.name}/skip", domain=MICROSOFT, epsilon=eps)


def _zero_skip_norm(helper, norm, rank: int, graph: _Graph, model) -> list:
    """The skip op on `norm`'s input and zeros; a rank other than 2 or 3 (or unknown) as rows [-1, hidden], shaped
    back after."""
    x, out = norm.input[0], norm.output[0]
    if rank in (2, 3):
        return [helper.make_node("Sub", [x, x], [f"{out}/zeros"]),
                _skip_norm(helper, norm, [x, f"{out}/zeros"], [out])]
    hidden = graph.dims(norm.input[1])[0]
    rows_shape = f"rows/{hidden}"
    if rows_shape not in graph.constants:
        model.graph.initializer.append(helper.make_tensor(rows_shape, 7, [2], [-1, hidden]))
        graph.constants[rows_shape] = model.graph.initializer[-1]
    return [helper.make_node("Reshape", [x, rows_shape], [f"{out}/rows"]),
            helper.make_node("Sub", [f"{out}/rows"] * 2, [f"{out}/zeros"]),
            _skip_norm(helper, norm, [f"{out}/rows", f"{out}/zeros"], [f"{out}/normed"]),
            helper.make_node("Shape", [x], [f"{out}/shape"]),
            helper.make_node("Reshape", [f"{out}/normed", f"{out}/shape"], [out])]


def _rms_norm(graph: _Graph, scale):
    """(x, weight, eps, nodes) if `scale` is weight · (x · 1/sqrt(mean(x^2) + eps)) with weight a 1-D constant."""
    for weight, normed in (scale.input, reversed(scale.input)):
        tensor = graph.constants.get(weight)
        times = graph.only(normed, "Mul")
        if tensor is None or len(tensor.dims) != 1 or times is None:
            continue
        for x, inverse in (times.input, reversed(times.input)):
            reciprocal = graph.only(inverse, "Reciprocal")
            root = reciprocal and graph.only(reciprocal.input[0], "Sqrt")
            add = root and graph.only(root.input[0], "Add")
            if not add:
                continue
            mean, eps = add.input if add.input[1] in graph.constants else reversed(add.input)
            mean = graph.only(mean, "ReduceMean")
            power = mean and graph.only(mean.input[0], "Pow")
            axes = mean and len(mean.input) > 1 and graph.value(mean.input[1])
            if (power is None or power.input[0] != x or _scalar(graph, power.input[1]) != 2.0
                    or _scalar(graph, eps) is None or axes is None or list(axes.reshape(-1)) != [-1]
                    or not any(a.name == "keepdims" and a.i == 1 for a in mean.attribute)):
                continue
            return x, weight, _scalar(graph, eps), [power, mean, add, root, reciprocal, times, scale]
    return None


def fuse_rotary(model) -> int:
    """Every rotary embedding of every method -> RotaryEmbedding (opset 23); returns how many."""
    from onnx import helper

    constants = {t.name: t for t in model.graph.initializer}
    fused = 0
    for branch in _branches(model):
        graph, edits = _Graph(branch, constants), []
        halves: dict[str, str] = {}  # a [.., S, d] cos / sin -> its first half, sliced once per graph
        for add in [n for n in branch.node if n.op_type == "Add"]:
            match = _rotary(graph, add)
            if match is None or not graph.claim(match[-1]):
                continue
            x, cos, sin, half, dead = match
            new = []
            for table in (cos, sin):
                if table not in halves:
                    halves[table] = f"{table}/half"
                    new.append(_first_half(helper, table, half, model))
            new.append(helper.make_node("RotaryEmbedding", [x, halves[cos], halves[sin]], [add.output[0]],
                                        name=f"{add.name}/rotary"))
            edits.append((dead, new, False))
            fused += 1
        graph.replace_all(edits)
    if fused:
        _require_opset(model, ROTARY_OPSET)
    return fused


def _rotary(graph: _Graph, add):
    """(x, cos, sin, d/2, nodes) if `add` is
    x·unsqueeze(cos, 1) + cat(-x[.., d/2:], x[.., :d/2])·unsqueeze(sin, 1)."""
    for first, second in (add.input, reversed(add.input)):
        straight, turned = graph.only(first, "Mul"), graph.only(second, "Mul")
        if straight is None or turned is None:
            continue
        for x, cos_4d in (straight.input, reversed(straight.input)):
            for rotated, sin_4d in (turned.input, reversed(turned.input)):
                cat = graph.only(rotated, "Concat")
                if cat is None or len(cat.input) != 2 or not any(a.name == "axis" and a.i == -1 for a in cat.attribute):
                    continue
                neg = graph.only(cat.input[0], "Neg")
                upper = neg and graph.only(neg.input[0], "Slice")
                lower = graph.only(cat.input[1], "Slice")
                cos, sin = _unsqueezed(graph, cos_4d), _unsqueezed(graph, sin_4d)
                if not (upper and lower and cos and sin) or upper.input[0] != x or lower.input[0] != x:
                    continue
                half = _bounds(graph, lower)
                if half is None or half[0] != 0 or _bounds(graph, upper) != (half[1], None):
                    continue
                return x, cos, sin, half[1], [straight, lower, upper, neg, cat, turned, add]
    return None


def _unsqueezed(graph: _Graph, name: str) -> str | None:
    """The [1, S, d] table `name` unsqueezes at axis 1 into [1, 1, S, d], if its two halves are equal (RotaryEmbedding
    reads the first half only)."""
    node = graph.producer.get(name)
    if node is None or node.op_type != "Unsqueeze" or len(node.input) < 2:
        return None
    axes = graph.value(node.input[1])
    table = node.input[0] if axes is not None and list(axes.reshape(-1)) == [1] else None
    return table if table is not None and _doubled(graph, table) else None


def _doubled(graph: _Graph, table: str) -> bool:
    """`table` is an elementwise function (cos, sin, a constant scale) of concat(f, f) on the last axis."""
    node = graph.producer.get(table)
    while node is not None and (node.op_type in ("Cos", "Sin", "Cast") or node.op_type == "Mul" and any(
            _scalar(graph, name) is not None for name in node.input)):
        varying = [name for name in node.input if name not in graph.constants]
        node = graph.producer.get(varying[0]) if len(varying) == 1 else None
    return (node is not None and node.op_type == "Concat" and len(node.input) == 2
            and node.input[0] == node.input[1] and any(a.name == "axis" and a.i == -1 for a in node.attribute))


def _bounds(graph: _Graph, node) -> tuple[int, int | None] | None:
    """(start, end or None for 'to the end') of a Slice with step 1 on the last axis of a 4-D tensor."""
    values = [graph.value(name) for name in node.input[1:]]
    if len(values) != 4 or any(v is None for v in values):
        return None
    starts, ends, axes, steps = (int(v.reshape(-1)[0]) for v in values)
    if axes not in (-1, 3) or steps != 1:
        return None
    return starts, None if ends >= 2**31 - 1 else ends


def _first_half(helper, table: str, half: int, model):
    """A Slice of `table`'s last axis to [0, half), its bounds as constants of the top graph."""
    names = []
    for suffix, values in (("starts", [0]), ("ends", [half]), ("axes", [-1])):
        name = f"rotary/{suffix}/{half}"
        if not any(t.name == name for t in model.graph.initializer):
            model.graph.initializer.append(helper.make_tensor(name, 7, [1], values))
        names.append(name)
    return helper.make_node("Slice", [table, *names], [f"{table}/half"], name=f"{table}/half")


def _require_opset(model, version: int) -> None:
    from onnx import helper

    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, version)
            return
    model.opset_import.append(helper.make_opsetid("", version))


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
    summed as before (the low-rank term's added columns are exact zeros), and both products stay row-wise, so
    rows keep their bits whatever the call. Returns how many linear layers went into packs."""
    constants = {t.name: t for t in model.graph.initializer}
    made: dict[tuple, str] = {}  # tensors built once for every method that packs the same layers
    packed = 0
    for branch in _branches(model):
        graph = _Graph(branch, constants)
        groups: dict[tuple, list[_Linear]] = {}
        for linear in _linears(graph):
            groups.setdefault(linear.key(), []).append(linear)
        packs = [s for s in groups.values() if len(s) > 1 and _whole_tiles(graph, s)]
        graph.replace_all([([n for linear in siblings for n in linear.nodes], _packed(model, siblings, graph, made), True)
                           for siblings in packs])
        packed += sum(len(siblings) for siblings in packs)
    return packed


def _linears(graph: _Graph) -> list[_Linear]:
    """The graph's linear layers: products with their low-rank terms first, then bare products."""
    found, taken = [], set()
    for add in (n for n in graph.graph.node if n.op_type == "Add"):
        for first, second in (add.input, reversed(add.input)):
            product, right = graph.only(first, "MatMulNBits"), graph.only(second, "MatMul")
            left = right and graph.only(right.input[0], "MatMul")
            if (product and left and _constant_product(graph, product) and left.input[0] == product.input[0]
                    and _matrix(graph, left.input[1]) and _matrix(graph, right.input[1])):
                found.append(_Linear(product, left, right, add))
                taken.update(n.output[0] for n in (product, left, right, add))
                break
    for node in graph.graph.node:
        if node.output[0] not in taken and _constant_product(graph, node):
            found.append(_Linear(node))
    return found


def _whole_tiles(graph: _Graph, siblings: list[_Linear]) -> bool:
    """Q4Linear siblings pack by stacking their weights' tiles: each must fill its last tile of 16 columns."""
    return siblings[0].product.op_type != OWN_LINEAR or all(
        _columns(graph, linear.product) % OWN_TILE == 0 for linear in siblings)


def _constant_product(graph: _Graph, node) -> bool:
    if node.op_type == OWN_LINEAR:
        return len(node.input) == 4 and all(graph.dims(name) is not None for name in node.input[1:])
    if node.op_type == "MatMulNBits":
        return len(node.input) <= 4 and all(graph.dims(name) is not None for name in node.input[1:])
    return node.op_type == "MatMul" and graph.dims(node.input[0]) is None and _matrix(graph, node.input[1])


def _matrix(graph: _Graph, name: str) -> bool:
    dims = graph.dims(name)
    return dims is not None and len(dims) == 2


def _packed(model, siblings: list[_Linear], graph: _Graph, made: dict) -> list:
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
    nodes = [helper.make_node(first.product.op_type, inputs, [f"{name}/product"], name=f"{name}/product",
                              domain=first.product.domain, **attributes)]
    total = f"{name}/product"
    if first.add is not None:
        lefts = [linear.left.input[1] for linear in siblings]
        rights = [linear.right.input[1] for linear in siblings]

        @functools.cache  # built once, for the first method that packs these layers
        def term() -> tuple[np.ndarray, np.ndarray]:
            return _low_rank([graph.value(p) for p in lefts], [graph.value(p) for p in rights])

        left_name = lefts[0] if len(set(lefts)) == 1 else tensor(lefts, lambda: term()[0])
        right_name = tensor(rights, lambda: term()[1])
        x = first.product.input[0]
        nodes += [helper.make_node("MatMul", [x, left_name], [f"{name}/left"], name=f"{name}/left"),
                  helper.make_node("MatMul", [f"{name}/left", right_name], [f"{name}/right"], name=f"{name}/right"),
                  helper.make_node("Add", [total, f"{name}/right"], [f"{name}/sum"], name=f"{name}/sum")]
        total = f"{name}/sum"
    split = tensor([f"split/{'-'.join(map(str, sizes))}"], lambda: np.array(sizes, np.int64))
    nodes.append(helper.make_node("Split", [total, split], [linear.output for linear in siblings],
                                  name=f"{name}/split", axis=-1))
    return nodes


def _packed_own(siblings: list[_Linear], graph: _Graph, tensor) -> list[str]:
    """Q4Linear siblings' weights, LoRA A and LoRA U as one layer's: the weights' tiles stacked, the ranks side by
    side, U block-diagonal (each column's own rank terms in their order, exact zeros for the others' ranks)."""
    names = [[linear.product.input[slot] for linear in siblings] for slot in (1, 2, 3)]

    def block_diagonal() -> np.ndarray:
        ups = [graph.value(name) for name in names[2]]
        out = np.zeros((sum(u.shape[0] for u in ups), sum(u.shape[1] for u in ups), OWN_TILE), np.float32)
        tile = rank = 0
        for up in ups:
            out[tile : tile + up.shape[0], rank : rank + up.shape[1]] = up
            tile, rank = tile + up.shape[0], rank + up.shape[1]
        return out

    return [tensor(names[0], lambda: np.concatenate([graph.value(n) for n in names[0]], axis=0)),
            tensor(names[1], lambda: np.concatenate([graph.value(n) for n in names[1]], axis=1)),
            tensor(names[2], block_diagonal)]


def _columns(graph: _Graph, product) -> int:
    if product.op_type == OWN_LINEAR:
        return next(a.i for a in product.attribute if a.name == OWN_WIDTH)
    if product.op_type == "MatMulNBits":
        return next(a.i for a in product.attribute if a.name == "N")
    return graph.dims(product.input[1])[1]


def _low_rank(lefts: list[np.ndarray], rights: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
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
        right[:shared, column:column + own.shape[1]] = own[:shared]
        right[row:row + own.shape[0] - shared, column:column + own.shape[1]] = own[shared:]
        row, column = row + own.shape[0] - shared, column + own.shape[1]
    return left, right


def drop_unused_initializers(model) -> int:
    """Remove the top graph's initializers no node reads any more (the fused ops' constants: ONNX Runtime would
    warn of each at every load); returns how many."""
    read = {name for graph in _graphs(model.graph) for node in graph.node for name in node.input}
    unused = [t for t in model.graph.initializer if t.name not in read]
    for tensor in unused:
        model.graph.initializer.remove(tensor)
    return len(unused)


def lift_embedding(model, min_bytes: int = LIFT_BYTES) -> dict:
    """The large initializers a Gather reads (the embedding's codes and scales) become graph inputs `gathered.<name>`
    for the gathers (other readers keep the initializer); returns {input: where its bytes lie in the weights file},
    which the model's metadata keeps (EMBEDDING_METADATA) for the host to map. Call after share_weights."""
    from onnx import helper

    tensors = {t.name: t for t in model.graph.initializer}
    lifted: dict[str, dict] = {}
    for branch in _branches(model):
        for node in branch.node:
            tensor = tensors.get(node.input[0]) if node.op_type in GATHERS else None
            if tensor is None:
                continue
            where = {e.key: e.value for e in tensor.external_data}
            if int(where.get("length", 0)) < min_bytes:
                continue
            lifted[tensor.name] = {"location": where["location"], "offset": int(where["offset"]),
                                   "shape": list(tensor.dims), "dtype": np.dtype(_NUMPY[tensor.data_type]).name}
            node.input[0] = _input_name(tensor.name)
    for name in lifted:
        model.graph.input.append(helper.make_tensor_value_info(_input_name(name), tensors[name].data_type,
                                                               list(tensors[name].dims)))
    drop_unused_initializers(model)
    places = {_input_name(name): place for name, place in lifted.items()}
    if places:
        props = {p.key: p.value for p in model.metadata_props}
        helper.set_model_props(model, {**props, EMBEDDING_METADATA: json.dumps(places)})
    return places


def _input_name(initializer: str) -> str:
    return f"gathered.{initializer}"


_NUMPY = {1: np.float32, 2: np.uint8, 3: np.int8, 7: np.int64}
