"""Rewrites of the combined ONNX model (export/onnx_methods.py) that cut what ONNX Runtime holds and runs.

ONNX Runtime keeps ~6.6 KiB per node of a loaded graph (measured on SmolLM2's methods: 16 MiB for decode's
2,100 nodes, 6 MiB for streams' 590), the model has four such graphs, and each node costs a few microseconds a
call. So:

- `fuse_rms_norm`: the exporter's RMSNorm, Pow -> ReduceMean -> Add(eps) -> Sqrt -> Reciprocal -> Mul(x) ->
  Mul(weight), becomes one SimplifiedLayerNormalization (ONNX Runtime's op, onnx domain): 7 nodes -> 1.
- `fuse_skip_norm`: every such norm -> SkipSimplifiedLayerNormalization, with the residual Add it reads.
- `fuse_rotary`: rotary embedding, x·cos + cat(-x2, x1)·sin (Mul, Slice, Slice, Neg, Concat, Mul, Add) on
  q and k, becomes ONNX's RotaryEmbedding (opset 23) on the first half of cos / sin: 7 nodes -> 1.
- `pack_linears` (export/onnx_pack.py): q / k / v and gate / up, each with its low-rank term, -> one product,
  one term and a Split; streamfuse.Q4Linear siblings -> one Q4Linear (activations quantized once) and a Split.
- `drop_unused_initializers`: the constants only the replaced nodes read.
- `lift_embedding`: the embedding gathers the tied LM head's Q8 codes; an initializer a Gather reads stays
  mapped and its pages resident (the head's prepacking touches them all: 30 MiB of SmolLM2), so the gathered
  tables become graph inputs the host feeds from its own read-only map of weights.bin (the same bytes, each
  page resident only once a token reads it), and the head's MatMulNBits alone holds the initializer, which
  ONNX Runtime releases once packed.

Every fused op is row-wise: a row's bits do not depend on the call's other rows, so SS stays plain decoding
(tests/test_onnx_passes.py, 1 to 16 rows on 1 and 2 threads; the export tests check every tree row end to end).
The rewrites keep what the graphs compute (the same test file, on a Hugging Face Llama's exported graphs). The
opset rises to 23 for RotaryEmbedding; every other op the graphs use means the same in opsets 18 to 23.
"""

from __future__ import annotations

import json

import numpy as np

from streamfuse.export.onnx_nodes import Graph, branches
from streamfuse.runtime.artifact.contract import EMBEDDING_METADATA

ROTARY_OPSET = 23  # ONNX's RotaryEmbedding
GATHERS = ("Gather", "GatherND")
MICROSOFT = "com.microsoft"  # ONNX Runtime's own ops
LIFT_BYTES = 1 << 20  # gathered tables this large are fed by the host; smaller ones (id maps) stay


def _graphs(graph):
    """`graph` and every graph nested in its nodes."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                yield from _graphs(sub)


def _scalar(graph: Graph, name: str) -> float | None:
    value = graph.value(name)
    return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None


def fuse_rms_norm(model) -> int:
    """Every RMSNorm of every method -> SimplifiedLayerNormalization; returns how many."""
    from onnx import helper

    constants = {t.name: t for t in model.graph.initializer}
    fused = 0
    for branch in branches(model):
        graph, edits = Graph(branch, constants), []
        for scale in [n for n in branch.node if n.op_type == "Mul"]:
            match = _rms_norm(graph, scale)
            if match is None or not graph.claim(match[-1]):
                continue
            x, weight, eps, dead = match
            node = helper.make_node(
                "SimplifiedLayerNormalization",
                [x, weight],
                [scale.output[0]],
                name=f"{scale.name}/rms_norm",
                axis=-1,
                epsilon=eps,
                stash_type=1,
            )
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
    for branch in branches(model):
        graph, shapes, edits = Graph(branch, constants), _shapes(branch), []
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
    return {
        info.name: tuple(
            d.dim_value if d.HasField("dim_value") else d.dim_param for d in info.type.tensor_type.shape.dim
        )
        for info in graph.value_info
        if info.type.tensor_type.HasField("shape")
    }


def _same_rows(shapes: dict, names) -> bool:
    """Both terms have the same known 2-D or 3-D shape (the skip op takes no other)."""
    first, second = (shapes.get(name) for name in names)
    return first is not None and first == second and len(first) in (2, 3) and all(d not in (0, "") for d in first)


def _skip_norm(helper, norm, inputs: list[str], outputs: list[str]):
    eps = next(a.f for a in norm.attribute if a.name == "epsilon")
    return helper.make_node(
        "SkipSimplifiedLayerNormalization",
        [*inputs, norm.input[1]],
        outputs,
        name=f"{norm.name}/skip",
        domain=MICROSOFT,
        epsilon=eps,
    )


def _zero_skip_norm(helper, norm, rank: int, graph: Graph, model) -> list:
    """The skip op on `norm`'s input and zeros; a rank other than 2 or 3 (or unknown) as rows [-1, hidden], shaped
    back after."""
    x, out = norm.input[0], norm.output[0]
    if rank in (2, 3):
        return [helper.make_node("Sub", [x, x], [f"{out}/zeros"]), _skip_norm(helper, norm, [x, f"{out}/zeros"], [out])]
    hidden = graph.dims(norm.input[1])[0]
    rows_shape = f"rows/{hidden}"
    if rows_shape not in graph.constants:
        model.graph.initializer.append(helper.make_tensor(rows_shape, 7, [2], [-1, hidden]))
        graph.constants[rows_shape] = model.graph.initializer[-1]
    return [
        helper.make_node("Reshape", [x, rows_shape], [f"{out}/rows"]),
        helper.make_node("Sub", [f"{out}/rows"] * 2, [f"{out}/zeros"]),
        _skip_norm(helper, norm, [f"{out}/rows", f"{out}/zeros"], [f"{out}/normed"]),
        helper.make_node("Shape", [x], [f"{out}/shape"]),
        helper.make_node("Reshape", [f"{out}/normed", f"{out}/shape"], [out]),
    ]


def _rms_norm(graph: Graph, scale):
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
            if (
                power is None
                or power.input[0] != x
                or _scalar(graph, power.input[1]) != 2.0
                or _scalar(graph, eps) is None
                or axes is None
                or list(axes.reshape(-1)) != [-1]
                or not any(a.name == "keepdims" and a.i == 1 for a in mean.attribute)
            ):
                continue
            return x, weight, _scalar(graph, eps), [power, mean, add, root, reciprocal, times, scale]
    return None


def fuse_rotary(model) -> int:
    """Every rotary embedding of every method -> RotaryEmbedding (opset 23); returns how many."""
    from onnx import helper

    constants = {t.name: t for t in model.graph.initializer}
    fused = 0
    for branch in branches(model):
        graph, edits = Graph(branch, constants), []
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
            new.append(
                helper.make_node(
                    "RotaryEmbedding", [x, halves[cos], halves[sin]], [add.output[0]], name=f"{add.name}/rotary"
                )
            )
            edits.append((dead, new, False))
            fused += 1
        graph.replace_all(edits)
    if fused:
        _require_opset(model, ROTARY_OPSET)
    return fused


def _rotary(graph: Graph, add):
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


def _unsqueezed(graph: Graph, name: str) -> str | None:
    """The [1, S, d] table `name` unsqueezes at axis 1 into [1, 1, S, d], if its two halves are equal (RotaryEmbedding
    reads the first half only)."""
    node = graph.producer.get(name)
    if node is None or node.op_type != "Unsqueeze" or len(node.input) < 2:
        return None
    axes = graph.value(node.input[1])
    table = node.input[0] if axes is not None and list(axes.reshape(-1)) == [1] else None
    return table if table is not None and _doubled(graph, table) else None


def _doubled(graph: Graph, table: str) -> bool:
    """`table` is an elementwise function (cos, sin, a constant scale) of concat(f, f) on the last axis."""
    node = graph.producer.get(table)
    while node is not None and (
        node.op_type in ("Cos", "Sin", "Cast")
        or node.op_type == "Mul"
        and any(_scalar(graph, name) is not None for name in node.input)
    ):
        varying = [name for name in node.input if name not in graph.constants]
        node = graph.producer.get(varying[0]) if len(varying) == 1 else None
    return (
        node is not None
        and node.op_type == "Concat"
        and len(node.input) == 2
        and node.input[0] == node.input[1]
        and any(a.name == "axis" and a.i == -1 for a in node.attribute)
    )


def _bounds(graph: Graph, node) -> tuple[int, int | None] | None:
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
    for branch in branches(model):
        for node in branch.node:
            tensor = tensors.get(node.input[0]) if node.op_type in GATHERS else None
            if tensor is None:
                continue
            where = {e.key: e.value for e in tensor.external_data}
            if int(where.get("length", 0)) < min_bytes:
                continue
            lifted[tensor.name] = {
                "location": where["location"],
                "offset": int(where["offset"]),
                "shape": list(tensor.dims),
                "dtype": np.dtype(_NUMPY[tensor.data_type]).name,
            }
            node.input[0] = _input_name(tensor.name)
    for name in lifted:
        model.graph.input.append(
            helper.make_tensor_value_info(_input_name(name), tensors[name].data_type, list(tensors[name].dims))
        )
    drop_unused_initializers(model)
    places = {_input_name(name): place for name, place in lifted.items()}
    if places:
        props = {p.key: p.value for p in model.metadata_props}
        helper.set_model_props(model, {**props, EMBEDDING_METADATA: json.dumps(places)})
    return places


def _input_name(initializer: str) -> str:
    return f"gathered.{initializer}"


_NUMPY = {1: np.float32, 2: np.uint8, 3: np.int8, 7: np.int64}
