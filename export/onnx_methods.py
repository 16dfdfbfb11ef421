"""All exported methods in one ONNX model, so one ONNX Runtime session holds one copy of the weights.

ONNX has one entry point per model, and a session per method graph prepacks its own copy of every
weight (5 graphs: 811 MiB of RSS for a 132 MiB q4 artifact). Here each method's graph becomes the
then-branch of an If at the top of one model; the input `method` (its index in the model's method
list, kept in its metadata under METHODS_METADATA) picks the branch, every weight is an initializer of the top
graph, and each method's outputs are <method>.<name> (runtime/artifact/contract.py owns these names). Measured with
ONNX Runtime 1.31.1 on SmolLM2's layers: one session prepacks the weights once for all the If branches that
read them from the enclosing graph (docs/export.md; an If nested in another If's branch would not
find them there and run unpacked, so the Ifs sit side by side). An If whose condition is false
runs its else-branch: empty constants, a few microseconds.

    method ─┬─ If(method == 0) ── prefill's nodes ───── prefill.logits, prefill.anchor, ..
            ├─ If(method == 1) ── decode's nodes ────── decode.logits, ..
            └─ ..                 (weights: the top graph's initializers, each tensor once)
"""

from __future__ import annotations

import copy
import hashlib
import json

from streamfuse.runtime.artifact.contract import METHOD_INPUT, METHODS_METADATA, method_output


def strip_debug_info(model, keep_shapes: bool = False) -> None:
    """Drop what only a reader needs (value_info, doc strings, the exporter's per-node stack traces), in every
    graph of the model: it is most of a graph's bytes, and ONNX Runtime keeps it in memory (31 -> 19 MiB per
    SmolLM2 graph). keep_shapes: keep value_info, which the passes (export/onnx_passes.py) read; the stack traces
    go first all the same, since the passes rebuild each graph's node list and protobuf keeps every copy."""
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        if not keep_shapes:
            del graph.value_info[:]
        for node in graph.node:
            node.doc_string = ""
            del node.metadata_props[:]
            graphs += [a.g for a in node.attribute if a.HasField("g")] + [g for a in node.attribute for g in a.graphs]


def combine_methods(models: dict):
    """{method: ModelProto, each self-contained} -> one ModelProto: inputs are the union of the methods'
    (plus METHOD_INPUT), a dim the methods disagree on is named, a rank they disagree on leaves the input's shape
    open; outputs <method>.<name>. METHOD_INPUT
    picks a method by its index in `models`, an order the model's metadata keeps."""
    from onnx import TensorProto, helper

    shared: dict[str, object] = {}  # content key -> the top graph's initializer
    nodes, outputs = [], []
    for position, (method, model) in enumerate(models.items()):
        then_branch, names = _branch(method, model.graph, shared)
        empties = [
            helper.make_node(
                "Constant",
                [],
                [f"{method}/skip/{name}"],
                value=helper.make_tensor(f"{method}/skip/{name}", dtype, [0], []),
            )
            for name, dtype in names
        ]
        else_branch = helper.make_graph(
            empties,
            f"{method}/skip",
            [],
            [helper.make_tensor_value_info(e.output[0], d, None) for e, (_, d) in zip(empties, names)],
        )
        index, chosen = f"{method}/index", f"{method}/chosen"
        nodes += [
            helper.make_node(
                "Constant", [], [index], value=helper.make_tensor(index, TensorProto.INT64, [], [position])
            ),
            helper.make_node("Equal", [METHOD_INPUT, index], [chosen]),
            helper.make_node(
                "If",
                [chosen],
                [method_output(method, name) for name, _ in names],
                then_branch=then_branch,
                else_branch=else_branch,
                name=method,
            ),
        ]
        outputs += [helper.make_tensor_value_info(method_output(method, name), dtype, None) for name, dtype in names]
    inputs = [helper.make_tensor_value_info(METHOD_INPUT, TensorProto.INT64, [])] + _union_inputs(models)
    top = helper.make_graph(nodes, "streamfuse", inputs, outputs, initializer=list(shared.values()))
    first = next(iter(models.values()))
    model = helper.make_model(top, opset_imports=_union_opsets(models), ir_version=first.ir_version)
    helper.set_model_props(model, {METHODS_METADATA: json.dumps(list(models))})
    return model


def method_graph(model, method: str):
    """The then-branch of `method` in a combined model (tests and tools read a method's nodes)."""
    node = next((n for n in model.graph.node if n.op_type == "If" and n.name == method), None)
    if node is None:
        raise KeyError(f"the ONNX model has no method {method!r}")
    return next(a.g for a in node.attribute if a.name == "then_branch")


def _branch(method: str, graph, shared: dict):
    """The method's graph as an If branch: its initializers move to `shared` (deduplicated by content),
    its own values are prefixed '<method>/', graph inputs stay names of the enclosing graph."""
    from onnx import helper

    renamed = {}
    for tensor in graph.initializer:
        key = _content_key(tensor)
        if key not in shared:
            taken = {t.name for t in shared.values()}
            moved = copy.deepcopy(tensor)
            moved.name = tensor.name if tensor.name not in taken else f"{tensor.name}/{len(shared)}"
            shared[key] = moved
        renamed[tensor.name] = shared[key].name
    outer = {i.name for i in graph.input}

    def name(value: str) -> str:
        if not value or value in outer:
            return value
        return renamed.get(value, f"{method}/{value}")

    nodes = []
    for index, node in enumerate(graph.node):
        moved = copy.deepcopy(node)
        moved.input[:] = [name(v) for v in node.input]
        moved.output[:] = [name(v) for v in node.output]
        moved.name = f"{method}/{node.name or index}"
        nodes.append(moved)
    produced = {v for n in nodes for v in n.output}
    outputs = []
    for out in graph.output:
        value = name(out.name)
        if value not in produced:  # a branch must produce its outputs itself
            nodes.append(helper.make_node("Identity", [value], [f"{method}/{out.name}/out"]))
            value = f"{method}/{out.name}/out"
        outputs.append(helper.make_tensor_value_info(value, out.type.tensor_type.elem_type, None))
    names = [(out.name, out.type.tensor_type.elem_type) for out in graph.output]
    shapes = []  # the exporter's value_info, renamed, for the passes
    for info in graph.value_info:
        shapes.append(copy.deepcopy(info))
        shapes[-1].name = name(info.name)
    return helper.make_graph(nodes, method, [], outputs, value_info=shapes), names


def _content_key(tensor) -> str:
    """Same type, shape and bytes: one initializer (the exporter lifts a tied tensor twice)."""
    anonymous = type(tensor)()
    anonymous.CopyFrom(tensor)
    anonymous.name = ""
    return hashlib.sha256(anonymous.SerializeToString(deterministic=True)).hexdigest()


def _union_inputs(models: dict) -> list:
    from onnx import helper

    shapes: dict[str, tuple[int, list | None]] = {}
    for model in models.values():
        for value in model.graph.input:
            dims = [d.dim_value if d.HasField("dim_value") else None for d in value.type.tensor_type.shape.dim]
            dtype, known = shapes.get(value.name, (value.type.tensor_type.elem_type, dims))
            if known is None or len(known) != len(dims):  # a batched step's tree [B, T, T] beside step's [T, T]
                shapes[value.name] = (dtype, None)
                continue
            shapes[value.name] = (dtype, [a if a == b else None for a, b in zip(known, dims)])
    return [helper.make_tensor_value_info(name, kind, _named_dims(name, dims)) for name, (kind, dims) in shapes.items()]


def _named_dims(name: str, dims: list | None) -> list | None:
    """An input's dims, each the methods disagree on named after the input and axis; None: any shape."""
    return None if dims is None else [d if d is not None else f"{name}_{axis}" for axis, d in enumerate(dims)]


def _union_opsets(models: dict) -> list:
    from onnx import helper

    versions: dict[str, int] = {}
    for model in models.values():
        for opset in model.opset_import:
            versions[opset.domain] = max(versions.get(opset.domain, 0), opset.version)
    return [helper.make_opsetid(domain, version) for domain, version in versions.items()]
