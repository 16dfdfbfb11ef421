"""export/onnx_passes.py on the graphs the exporter writes for a Hugging Face Llama (RMSNorm and rotary from its
own modeling code): the fused model computes what the exporter's did, and the embedding read through a mapped
input gives the same bits."""

import numpy as np
import pytest
import torch

from streamfuse.export.onnx_methods import combine_methods, method_graph, strip_debug_info
from streamfuse.export.onnx_pack import low_rank, pack_linears
from streamfuse.export.onnx_passes import (
    drop_unused_initializers,
    fuse_rms_norm,
    fuse_rotary,
    fuse_skip_norm,
    lift_embedding,
)
from streamfuse.export.to_onnx import share_weights
from streamfuse.runtime.artifact.contract import EMBEDDING_METADATA, METHOD_INPUT
from streamfuse.runtime.backends.runners import mapped_tables

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

LAYERS, ROWS = 2, 5


class Logits(torch.nn.Module):
    """A tiny random Llama: ids and positions -> logits (no cache), what the exporter sees of RMSNorm and rotary."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=4096,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            attn_implementation="eager",
        )
        self.model = transformers.LlamaForCausalLM(config).eval()

    def forward(self, ids, positions):
        return self.model(input_ids=ids, position_ids=positions, use_cache=False).logits


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The exporter's model of Logits as the one method of a combined model."""
    module = Logits()
    ids, positions = torch.tensor([[5, 900, 17, 4000, 3]]), torch.tensor([[7, 8, 9, 10, 11]])
    program = torch.export.export(module, (ids, positions), strict=False)
    folder = tmp_path_factory.mktemp("passes")
    onnx_program = torch.onnx.export(
        program,
        (),
        dynamo=True,
        input_names=["ids", "positions"],
        output_names=["logits"],
        optimize=True,
        verbose=False,
    )
    onnx_program.save(str(folder / "raw.onnx"))
    model = onnx.load(str(folder / "raw.onnx"))
    strip_debug_info(model, keep_shapes=True)  # as the exporter does: value_info stays for the passes
    return combine_methods({"decode": model}), (ids.numpy(), positions.numpy()), folder


def run(model, inputs, extra=None) -> np.ndarray:
    session = ort.InferenceSession(
        model.SerializeToString() if not isinstance(model, str) else model, providers=["CPUExecutionProvider"]
    )
    feed = {"ids": inputs[0], "positions": inputs[1], METHOD_INPUT: np.array(0, np.int64), **(extra or {})}
    return session.run(["decode.logits"], feed)[0]


def copy(model):
    twin = onnx.ModelProto()
    twin.CopyFrom(model)
    return twin


def ops(model) -> dict:
    counts = {}
    for node in method_graph(model, "decode").node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def test_rms_norm_and_rotary_become_one_node_each_and_compute_the_same(exported):
    model, inputs, _ = exported
    fused = copy(model)
    assert fuse_rms_norm(fused) == 2 * LAYERS + 1  # two per layer and the final norm
    assert fuse_rotary(fused) == 2 * LAYERS  # q and k of each layer
    initializers = len(fused.graph.initializer)
    assert drop_unused_initializers(fused) > 0  # the norms' exponent, epsilon and axes, rotary's slice bounds
    read = {name for node in method_graph(fused, "decode").node for name in node.input}
    assert {t.name for t in fused.graph.initializer} <= read and len(fused.graph.initializer) < initializers
    before, after = ops(model), ops(fused)
    assert after["SimplifiedLayerNormalization"] == 2 * LAYERS + 1 and after["RotaryEmbedding"] == 2 * LAYERS
    for gone in ("Pow", "ReduceMean", "Sqrt", "Reciprocal", "Neg"):
        assert before.get(gone, 0) > 0 and gone not in after
    assert sum(after.values()) < sum(before.values()) - 10 * LAYERS
    reference, result = run(model, inputs), run(fused, inputs)
    assert result.shape == (1, ROWS, 4096)
    np.testing.assert_allclose(result, reference, rtol=1e-5, atol=1e-5)
    # uneven gaps between positions (rotary sees relative positions only): still the exporter's result
    spread = (inputs[0], np.array([[3, 9, 40, 41, 200]]))
    assert not np.allclose(run(model, spread), reference, atol=1e-3)
    np.testing.assert_allclose(run(fused, spread), run(model, spread), rtol=1e-5, atol=1e-5)


def test_residual_adds_join_their_norms_and_linears_on_one_input_are_packed(exported):
    """Add + norm -> SkipSimplifiedLayerNormalization, and the first norm (it reads the embedding) the same op with
    a skip of zeros; q / k / v and gate / up -> one MatMul each, split after. Packing leaves every column's sums as
    they were: the same bits."""
    model, inputs, _ = exported
    fused = copy(model)
    fuse_rms_norm(fused)
    assert fuse_skip_norm(fused) == 2 * LAYERS
    assert fuse_rotary(fused) == 2 * LAYERS
    reference = copy(fused)
    assert pack_linears(fused) == 5 * LAYERS
    drop_unused_initializers(fused)
    after = ops(fused)
    assert after["SkipSimplifiedLayerNormalization"] == 2 * LAYERS + 1 and "SimplifiedLayerNormalization" not in after
    assert after["Sub"] == ops(model).get("Sub", 0) + 1
    assert after["Split"] == 2 * LAYERS and after["MatMul"] == ops(reference)["MatMul"] - 3 * LAYERS
    np.testing.assert_array_equal(run(fused, inputs), run(reference, inputs))
    np.testing.assert_allclose(run(fused, inputs), run(model, inputs), rtol=1e-5, atol=1e-5)
    assert any(method_graph(fused, "decode").value_info)
    strip_debug_info(fused)  # what the exporter keeps of the passes' shapes: nothing
    assert not method_graph(fused, "decode").value_info
    np.testing.assert_array_equal(run(fused, inputs), run(reference, inputs))


def test_a_norm_of_any_rank_runs_the_skip_kernel_with_the_bits_of_a_lone_row():
    """A norm over a 4-D tensor (the skip op takes 2-D and 3-D) is flattened to rows: each row gets the bits the
    skip kernel gives it alone, as every other norm of every method."""
    T, helper = onnx.TensorProto, onnx.helper
    weight = onnx.numpy_helper.from_array(np.random.default_rng(2).random(64, dtype=np.float32) + 0.5, "w")
    norm = helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["y"], axis=-1, epsilon=1e-5, stash_type=1)
    graph = helper.make_graph(
        [norm],
        "norm",
        [helper.make_tensor_value_info("x", T.FLOAT, [2, 3, "M", 64])],
        [helper.make_tensor_value_info("y", T.FLOAT, None)],
        initializer=[weight],
    )
    model = combine_methods(
        {"decode": helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)}
    )
    assert fuse_skip_norm(model) == 0
    assert [n.op_type for n in method_graph(model, "decode").node] == [
        "Reshape",
        "Sub",
        "SkipSimplifiedLayerNormalization",
        "Shape",
        "Reshape",
    ]
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    x = np.random.default_rng(3).standard_normal((2, 3, 5, 64)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": x, METHOD_INPUT: np.array(0, np.int64)})
    skip = helper.make_node(
        "SkipSimplifiedLayerNormalization", ["x", "zeros", "w"], ["y"], domain="com.microsoft", epsilon=1e-5
    )
    graph = helper.make_graph(
        [skip],
        "lone",
        [helper.make_tensor_value_info(n, T.FLOAT, [1, 1, 64]) for n in ("x", "zeros")],
        [helper.make_tensor_value_info("y", T.FLOAT, None)],
        initializer=[weight],
    )
    lone = helper.make_model(graph, opset_imports=[helper.make_opsetid("com.microsoft", 1)], ir_version=10)
    lone = ort.InferenceSession(lone.SerializeToString(), providers=["CPUExecutionProvider"])
    assert y.shape == x.shape
    for row in x.reshape(-1, 64)[[0, 7, 29]]:
        (alone,) = lone.run(None, {"x": row.reshape(1, 1, 64), "zeros": np.zeros((1, 1, 64), np.float32)})
        (where,) = np.nonzero((x.reshape(-1, 64) == row).all(1))
        assert np.array_equal(y.reshape(-1, 64)[where[0]], alone.reshape(64))


# One packed low-rank term for layers whose lefts start with the same columns (Q4_1's block sums S) and go on
# with their own (LoRA's A): S once, then each A; right puts each layer's rows in its own columns, zeros elsewhere.
#  lefts (K = 1)        rights ([width, N] each)             left            right
LOW_RANK = [
    ([[1, 0], [1, 0]], [[[5], [1]], [[6, 7], [2, 3]]], [[1, 0]], [[5, 6, 7], [1, 2, 3]]),  # one left
    ([[1, 2], [1, 3]], [[[5], [8]], [[6], [9]]], [[1, 2, 3]], [[5, 6], [8, 0], [0, 9]]),
    ([[2, 1], [3, 1]], [[[5], [8]], [[6], [9]]], [[2, 1, 3, 1]], [[5, 0], [8, 0], [0, 6], [0, 9]]),
]


@pytest.mark.parametrize("lefts, rights, left, right", LOW_RANK)
def test_packed_low_rank_terms_keep_each_layers_terms_in_its_own_columns(lefts, rights, left, right):
    lefts = [np.array([row], np.float32) for row in lefts]
    rights = [np.array(r, np.float32) for r in rights]
    packed_left, packed_right = low_rank(lefts, rights)
    np.testing.assert_array_equal(packed_left, np.array(left, np.float32))
    np.testing.assert_array_equal(packed_right, np.array(right, np.float32))
    x = np.array([[3.0]], np.float32)
    np.testing.assert_array_equal(
        x @ packed_left @ packed_right, np.concatenate([x @ lft @ r for lft, r in zip(lefts, rights)], axis=1)
    )


def test_a_norm_without_its_constant_weight_is_left_as_it_is(exported):
    model, _, _ = exported
    broken = copy(model)
    graph = method_graph(broken, "decode")
    weights = {t.name for t in broken.graph.initializer if len(t.dims) == 1}
    scale = next(n for n in graph.node if n.op_type == "Mul" and n.input[0] in weights)
    scale.input[0] = scale.input[1]  # x * x: no longer RMSNorm's weight
    assert fuse_rms_norm(broken) == 2 * LAYERS


def test_rotary_tables_whose_halves_may_differ_are_left_as_they_are(exported):
    """RotaryEmbedding reads the first half of cos / sin: the pass fuses only tables made from concat(f, f)."""
    model, _, _ = exported
    broken = copy(model)
    graph = method_graph(broken, "decode")
    (doubled,) = [n for n in graph.node if n.op_type == "Concat" and len(n.input) == 2 and n.input[0] == n.input[1]]
    doubled.input[1] = graph.node[0].output[0]  # concat(f, g): halves that may differ
    assert fuse_rotary(broken) == 0
    assert fuse_rotary(copy(model)) == 2 * LAYERS


def test_the_embedding_is_gathered_from_the_hosts_map_of_the_weights_file(exported, tmp_path):
    model, inputs, _ = exported
    plain = copy(model)
    share_weights(plain, tmp_path / "weights.bin")
    onnx.save_model(plain, str(tmp_path / "plain.onnx"))
    lifted = copy(plain)
    places = lift_embedding(lifted, min_bytes=1 << 10)  # the tiny model's table: 4096 x 64 floats
    assert len(places) == 1
    ((name, place),) = places.items()
    assert place["shape"] == [4096, 64] and place["dtype"] == "float32" and place["location"] == "weights.bin"
    tables = {t.name for t in lifted.graph.initializer} | {name}
    gathers = [n.input[0] for n in method_graph(lifted, "decode").node if n.op_type in ("Gather", "GatherND")]
    assert [table for table in gathers if table in tables] == [name]
    assert name in [i.name for i in lifted.graph.input]
    onnx.save_model(lifted, str(tmp_path / "lifted.onnx"))
    metadata = {p.key: p.value for p in lifted.metadata_props}
    tables = mapped_tables(tmp_path / "lifted.onnx", metadata)  # the table is the tied head: still an initializer
    assert EMBEDDING_METADATA in metadata and isinstance(tables[name], np.memmap) and not tables[name].flags.writeable
    np.testing.assert_array_equal(
        run(str(tmp_path / "lifted.onnx"), inputs, tables), run(str(tmp_path / "plain.onnx"), inputs)
    )


def test_a_cut_weights_file_is_a_one_line_error(exported, tmp_path):
    model, _, _ = exported
    lifted = copy(model)
    share_weights(lifted, tmp_path / "weights.bin")
    lift_embedding(lifted, min_bytes=1 << 10)
    metadata = {p.key: p.value for p in lifted.metadata_props}
    with open(tmp_path / "weights.bin", "r+b") as blob:
        blob.truncate(1000)
    with pytest.raises(FileNotFoundError, match="cut short"):
        mapped_tables(tmp_path / "model.onnx", metadata)


def fused_ops_model() -> bytes:
    """The ops the passes write, at SmolLM2's shapes, rows dynamic: q [1, 9, M, 64] -> rotary; x + skip [1, M, 576]
    -> norm and sum; x -> q / k / v packed (4-bit MatMulNBits, low-rank term of block sums and LoRA)."""
    T, helper, rng = onnx.TensorProto, onnx.helper, np.random.default_rng(1)
    constants = {
        "w": rng.random(576, dtype=np.float32) + 0.5,
        "codes": rng.integers(0, 256, (960, 18, 16), dtype=np.uint8),
        "scales": rng.random(960 * 18, dtype=np.float32) / 50,
        "zeros": np.full(960 * 9, 0x88, np.uint8),
        "left": np.concatenate(
            [np.eye(18, dtype=np.float32).repeat(32, axis=0), rng.standard_normal((576, 96), dtype=np.float32) / 10],
            axis=1,
        ),
        "right": rng.standard_normal((114, 960), dtype=np.float32) / 10,
    }
    nodes = [
        helper.make_node("RotaryEmbedding", ["q", "cos", "sin"], ["turned"]),
        helper.make_node(
            "SkipSimplifiedLayerNormalization",
            ["x", "skip", "w"],
            ["skipped", "", "", "summed"],
            domain="com.microsoft",
            epsilon=1e-5,
        ),
        helper.make_node(
            "MatMulNBits",
            ["x", "codes", "scales", "zeros"],
            ["product"],
            domain="com.microsoft",
            K=576,
            N=960,
            bits=4,
            block_size=32,
            accuracy_level=4,
        ),
        helper.make_node("MatMul", ["x", "left"], ["sums"]),
        helper.make_node("MatMul", ["sums", "right"], ["term"]),
        helper.make_node("Add", ["product", "term"], ["qkv"]),
    ]
    inputs = [
        helper.make_tensor_value_info("x", T.FLOAT, [1, "M", 576]),
        helper.make_tensor_value_info("q", T.FLOAT, [1, 9, "M", 64]),
        helper.make_tensor_value_info("cos", T.FLOAT, [1, "M", 32]),
        helper.make_tensor_value_info("sin", T.FLOAT, [1, "M", 32]),
        helper.make_tensor_value_info("skip", T.FLOAT, [1, "M", 576]),
    ]
    outputs = [helper.make_tensor_value_info(name, T.FLOAT, None) for name in FUSED_OUTPUTS]
    graph = helper.make_graph(
        nodes, "fused", inputs, outputs, initializer=[onnx.numpy_helper.from_array(v, k) for k, v in constants.items()]
    )
    opsets = [helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString()


FUSED_OUTPUTS = ("turned", "skipped", "summed", "qkv")


def test_the_fused_ops_give_a_row_the_same_bits_in_a_call_of_any_size():
    """Row i of an M-row call equals that row alone, bit for bit (M = 1..16, the row anywhere, other rows random,
    1 and 2 threads): SS's tree rows stay plain decoding's through the fused and packed ops."""
    rng = np.random.default_rng(0)
    row = {
        "x": rng.standard_normal((1, 1, 576)),
        "q": rng.standard_normal((1, 9, 1, 64)),
        "cos": rng.uniform(-1, 1, (1, 1, 32)),
        "sin": rng.uniform(-1, 1, (1, 1, 32)),
        "skip": rng.standard_normal((1, 1, 576)),
    }
    row = {name: value.astype(np.float32) for name, value in row.items()}
    axis = {"x": 1, "q": 2, "cos": 1, "sin": 1, "skip": 1}
    out_axis = {"turned": 2, "skipped": 1, "summed": 1, "qkv": 1}
    for threads in (1, 2):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(fused_ops_model(), options, providers=["CPUExecutionProvider"])
        alone = session.run(None, row)
        for count in range(1, 17):
            at = int(rng.integers(count))
            feed = {}
            for name, value in row.items():
                shape = list(value.shape)
                shape[axis[name]] = count
                batch = rng.standard_normal(shape).astype(np.float32)
                index = [slice(None)] * batch.ndim
                index[axis[name]] = at
                batch[tuple(index)] = np.take(value, 0, axis=axis[name])
                feed[name] = batch
            for name, out, one in zip(FUSED_OUTPUTS, session.run(None, feed), alone):
                assert np.array_equal(np.take(out, at, out_axis[name]), np.take(one, 0, out_axis[name])), (
                    name,
                    threads,
                    count,
                )


@pytest.mark.parametrize("threads", [1, 2])
def test_q4_linear_siblings_pack_into_one_node_with_each_columns_bits(threads):
    """Three streamfuse.Q4Linear on one input (q / k / v; LoRA ranks 4, 0 and 2) -> one Q4Linear, each its own LoRA
    segment (no zeros for the others' ranks), and a Split: every output the unpacked graph's bits and the packed
    form's before segments (U block-diagonal), for 1 to 16 rows; a sibling whose columns do not fill its last tile
    of 16 keeps the graph as it is."""
    from streamfuse.tools import q4_bench

    rng = np.random.default_rng(0)
    layers = [q4_bench.random_layer(rng, n, 64, rank) for n, rank in ((48, 4), (16, 0), (32, 2))]
    model = as_method(q4_bench.onnx_model(layers, "ours"))
    before = q4_bench.onnx_session(model.SerializeToString(), threads)
    # the packed form before segments: the ranks side by side, U block-diagonal with exact zeros, one segment
    zeros = q4_bench.onnx_session(q4_bench.onnx_model([q4_bench.stacked(layers)], "zero_blocks"), threads)
    assert pack_linears(model) == 3 and drop_unused_initializers(model) == 12
    (body,) = [a.g for a in model.graph.node[0].attribute if a.name == "then_branch"]
    assert [n.op_type for n in body.node] == ["Q4Linear", "Split"]
    values = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    up, splits = (values[name] for name in body.node[0].input[3:])
    assert splits.tolist() == [[3, 4], [1, 0], [2, 2]] and up.shape == (3 * 4 + 2 * 2, 16)  # each its own rank
    after = q4_bench.onnx_session(model.SerializeToString(), threads)
    for rows in (1, 2, 5, 16):
        feed = {"x64": rng.standard_normal((1, rows, 64)).astype(np.float32), "run": np.array(True)}
        unpacked, packed = before.run(None, feed), after.run(None, feed)
        for old, new in zip(unpacked, packed):
            assert np.array_equal(old.view(np.uint32), new.view(np.uint32)), rows
        (former,) = zeros.run(None, {"x64": feed["x64"]})
        assert np.array_equal(former.view(np.uint32), np.concatenate(packed, axis=-1).view(np.uint32)), rows
    ragged = as_method(q4_bench.onnx_model(layers[:2] + [q4_bench.random_layer(rng, 40, 64, 1)], "ours"))
    assert pack_linears(ragged) == 0


def as_method(serialized: bytes):
    """A one-graph model as the combined model holds a method: the graph an If's branch, its constants on top."""
    from onnx import TensorProto, helper

    inner = onnx.load_from_string(serialized)
    body = helper.make_graph(list(inner.graph.node), "method", [], list(inner.graph.output))
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])
    other = helper.make_graph(
        [helper.make_node("Constant", [], [f"{o.name}/other"], value=zero) for o in inner.graph.output],
        "other",
        [],
        [helper.make_tensor_value_info(f"{o.name}/other", TensorProto.FLOAT, None) for o in inner.graph.output],
    )
    outputs = [
        helper.make_tensor_value_info(f"out{i}", TensorProto.FLOAT, None) for i in range(len(inner.graph.output))
    ]
    node = helper.make_node("If", ["run"], [o.name for o in outputs], then_branch=body, else_branch=other)
    run = helper.make_tensor_value_info("run", TensorProto.BOOL, [])
    graph = helper.make_graph([node], "top", [run, *inner.graph.input], outputs, list(inner.graph.initializer))
    return helper.make_model(graph, opset_imports=list(inner.opset_import), ir_version=inner.ir_version)
