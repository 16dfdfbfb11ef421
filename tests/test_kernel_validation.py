"""Every wrapper of the C++ ops refuses an unsound call with its validator's one-line error (runtime/kernels/*.h),
before the kernel reads or writes a byte: the torch ops (the C ABI through ctypes), ONNX Runtime's custom ops and
ExecuTorch's, fed the calls a review of the ops found unchecked (v_* against k_*, heads against kv_heads, visible's
and out's shapes, start's size and range, batch dims, commit_rows' int64 wrap) and more. The sanitizer and fuzz runs
of the same validators are tests/fuzz/ (make sanitize, make fuzz)."""

import importlib.util
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamfuse.runtime.ops import kernel_library, q4_linear, q8_linear, tree_attention

ATTEND, COMMIT, Q4 = tree_attention.torch_op(), tree_attention.commit_op(), q4_linear.torch_op()
HEADS, KV, ROWS, DIM, CAPACITY, EXTRA, LAYERS = 4, 2, 3, 8, 16, 3, 2
INT64_MAX = 2**63 - 1


def sound_call() -> dict:
    """A sound attention call: the torch op's arguments by name."""
    g = torch.Generator().manual_seed(0)
    return {
        "query": torch.randn(1, HEADS, ROWS, DIM, generator=g),
        "k_cache": torch.randn(LAYERS, KV, CAPACITY, DIM, generator=g),
        "v_cache": torch.randn(LAYERS, KV, CAPACITY, DIM, generator=g),
        "layer": 1,
        "start": torch.tensor([5]),
        "k_extra": torch.randn(1, KV, EXTRA, DIM, generator=g),
        "v_extra": torch.randn(1, KV, EXTRA, DIM, generator=g),
        "visible": torch.tril(torch.ones(ROWS, EXTRA)),
        "scale": 0.3,
        "store": 2,
    }


def with_(**changes):
    return lambda call: {**call, **changes}


def heads(n: int):
    return lambda call: {**call, "query": torch.randn(1, n, ROWS, DIM)}


# (what, the change to a sound call, the validator's message); the first rows are the review's findings
BAD_ATTENTION = [
    (
        "v_cache smaller than k_cache",
        with_(v_cache=torch.randn(LAYERS, KV, 4, DIM)),
        "v_cache must have k_cache's shape",
    ),
    ("v_extra of other KV heads", with_(v_extra=torch.randn(1, 1, EXTRA, DIM)), "and v_extra k_extra's"),
    ("heads fewer than kv_heads", heads(1), "heads (1) must be a positive multiple of kv_heads (the caches' 2"),
    ("heads not a multiple of kv_heads", heads(3), "heads (3) must be a positive multiple of kv_heads"),
    (
        "visible of other rows",
        with_(visible=torch.ones(2, EXTRA)),
        "visible must be [rows, extra] = [3, 3], got [2, 3]",
    ),
    ("visible of other keys", with_(visible=torch.ones(ROWS, 5)), "visible must be [rows, extra] = [3, 3], got [3, 5]"),
    ("start of two numbers", with_(start=torch.tensor([5, 6])), "start must hold one number ([1] int64), got 2"),
    ("start empty", with_(start=torch.zeros(0, dtype=torch.int64)), "start must hold one number ([1] int64), got 0"),
    (
        "start int32",
        with_(start=torch.tensor([5], dtype=torch.int32)),
        "start must be a rank-1 int64 tensor, got rank 1 int32",
    ),
    ("start past the cache", with_(start=torch.tensor([CAPACITY + 1])), "start 17 is outside the cache's 16 slots"),
    ("start negative", with_(start=torch.tensor([-1])), "start -1 is outside the cache's 16 slots"),
    ("query batch of 2", with_(query=torch.randn(2, HEADS, ROWS, DIM)), "query and k_extra must have a batch of 1"),
    (
        "extra keys batch of 2",
        with_(k_extra=torch.randn(2, KV, EXTRA, DIM), v_extra=torch.randn(2, KV, EXTRA, DIM)),
        "must have a batch of 1",
    ),
    ("layer past the cache", with_(layer=LAYERS), "layer 2 is outside the cache's 2 layers"),
    ("store past the extra rows", with_(store=EXTRA + 1), "store 4 is outside [0, 3] (the extra rows)"),
    (
        "head_dim differs",
        with_(k_cache=torch.randn(LAYERS, KV, CAPACITY, 4), v_cache=torch.randn(LAYERS, KV, CAPACITY, 4)),
        "must share one head_dim",
    ),
    (
        "query of rank 3",
        with_(query=torch.randn(HEADS, ROWS, DIM)),
        "query must be a rank-4 float32 tensor, got rank 3",
    ),
    (
        "caches of float64",
        with_(k_cache=torch.randn(LAYERS, KV, CAPACITY, DIM, dtype=torch.float64)),
        "k_cache must be a rank-4 float32 tensor, got rank 4 float64",
    ),
    (
        "caches not contiguous",
        with_(v_cache=torch.randn(LAYERS, KV, DIM, CAPACITY).transpose(2, 3)),
        "v_cache must be contiguous",
    ),
    ("scale not a float32", with_(scale=1e300), "scale must be a finite float32"),
]


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("what, change, message", BAD_ATTENTION, ids=[case[0] for case in BAD_ATTENTION])
def test_the_torch_op_refuses_an_unsound_attention_and_writes_nothing(what, change, message):
    call = change(sound_call())
    caches = [call["k_cache"].clone(), call["v_cache"].clone()]
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        ATTEND(**call)
    assert one_line(error).startswith("tree_attention: ")
    assert torch.equal(call["k_cache"], caches[0]) and torch.equal(call["v_cache"], caches[1])


# Outs the validator refuses (the first, unchecked, would overflow the heap)
OUTS = [
    (torch.empty(1), "out must be a rank-4 float32 tensor, got rank 1 float32"),
    (torch.empty(1, ROWS, HEADS, DIM - 1), "out must be [1, rows, heads, dim] = [1, 3, 4, 8], got [1, 3, 4, 7]"),
    (torch.empty(1, ROWS, HEADS, DIM, dtype=torch.float64), "out must be a rank-4 float32 tensor, got rank 4 float64"),
    (torch.empty(1, HEADS, ROWS, DIM).transpose(1, 2), "out must be contiguous"),
]


@pytest.mark.parametrize("out, message", OUTS)
def test_the_out_variant_refuses_a_wrong_out(out, message):
    before = out.clone()
    with pytest.raises(ValueError, match=re.escape(message)):
        torch.ops.streamfuse.tree_attention.out(*sound_call().values(), out=out)
    assert torch.equal(out, before) or out.isnan().any()  # untouched (a NaN is unequal to itself)


def test_the_out_variant_writes_a_right_out():
    out = torch.full((1, ROWS, HEADS, DIM), float("nan"))
    assert torch.ops.streamfuse.tree_attention.out(*sound_call().values(), out=out) is out
    assert torch.equal(out, ATTEND(*sound_call().values()))


def test_a_view_is_the_arrays_own_memory_and_an_unusable_one_is_refused():
    """What reaches the validators: NumPy's byte strides in elements (-1 where they are not whole elements), its
    byte order, torch's strides; a tensor off the CPU or not strided never gets a view."""
    array = np.zeros((3, 4), np.float32)
    v = tree_attention.view(array[:, ::2])
    assert (v.data, v.rank, v.dtype) == (array.ctypes.data, 2, 0)
    assert (list(v.sizes[:2]), list(v.strides[:2])) == ([3, 2], [4, 2])
    packed = np.zeros((2, 3), np.dtype([("a", "<f4"), ("b", "u1")]))["a"]  # 5-byte steps: no whole float32
    assert list(tree_attention.view(packed).strides[:2]) == [-1, -1]
    assert tree_attention.view(array.view(">f4")).dtype == tree_attention.OTHER_DTYPE
    assert tree_attention.view(torch.zeros(2, 3).t()).strides[:2] == [1, 3]
    for tensor in (torch.zeros(2, device="meta"), torch.eye(2).to_sparse()):
        with pytest.raises(ValueError, match="take dense CPU tensors"):
            tree_attention.view(tensor)


# (start, accepted, message): the review's int64 wrap first (start - n + accepted[n - 1] past INT64_MAX)
BAD_COMMITS = [
    (2, [INT64_MAX], f"accepted node {INT64_MAX} is row {INT64_MAX}, past the cache's 16 slots"),
    (16, [0, 1, INT64_MAX - 1], "past the cache's 16 slots"),
    (INT64_MAX, [0], f"start {INT64_MAX} is outside the cache's 16 slots"),
    (-(2**63), [-1], "is outside the cache's 16 slots"),
    (4, [0, -1, 2], "accepted [0, -1, 2] must be its nodes >= 0 first, then only -1 padding"),
    (4, [1, 1], "accepted [1, 1]'s nodes must be strictly increasing"),
    (1, [0, 1], "start 1 is less than the 2 accepted nodes"),
]


@pytest.mark.parametrize("start, accepted, message", BAD_COMMITS)
def test_commit_rows_refuses_what_would_wrap_or_leave_the_cache(start, accepted, message):
    call = sound_call()
    caches = [call["k_cache"].clone(), call["v_cache"].clone()]
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        COMMIT(call["k_cache"], call["v_cache"], torch.tensor([start]), torch.tensor(accepted))
    assert one_line(error).startswith("commit_rows: ")
    assert torch.equal(call["k_cache"], caches[0]) and torch.equal(call["v_cache"], caches[1])


BAD_COMMIT_TENSORS = [
    (lambda k, v: (k, v[:, :, :8].contiguous(), torch.tensor([4]), torch.tensor([0]), None), "both of one shape"),
    (lambda k, v: (k, v, torch.tensor([4, 5]), torch.tensor([0]), None), "start and out must each hold one number"),
    (
        lambda k, v: (k, v, torch.tensor([4]), torch.tensor([[0]]), None),
        "accepted must be a rank-1 int64 tensor, got rank 2",
    ),
    (
        lambda k, v: (k, v, torch.tensor([4]), torch.tensor([0]), torch.empty(3, dtype=torch.int64)),
        "start and out must each hold one number",
    ),
    (lambda k, v: (k, v, torch.tensor([4]), torch.tensor([0]), torch.empty(1)), "out must be a rank-1 int64 tensor"),
]


@pytest.mark.parametrize("change, message", BAD_COMMIT_TENSORS)
def test_commit_rows_checks_every_tensor(change, message):
    call = sound_call()
    k, v, start, accepted, out = change(call["k_cache"], call["v_cache"])
    with pytest.raises(ValueError, match=re.escape(message)):
        if out is None:
            COMMIT(k, v, start, accepted)
        else:
            torch.ops.streamfuse.commit_rows.out(k, v, start, accepted, out=out)


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(["query", "k_cache", "v_cache", "k_extra", "v_extra", "visible"]),
    st.sampled_from(["transpose", "slice", "expand", "ok"]),
)
def test_strided_tensors_are_refused_or_run_as_their_dense_copies(name, layout):
    """A view's strides reach the validator as they are: the caches (written in place) must be dense, the inputs only
    read are made dense first; either way the result is the dense call's."""
    call = sound_call()
    tensor = call[name]
    if layout == "transpose":
        strided = tensor.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif layout == "slice":
        strided = torch.cat([tensor, tensor], dim=-1)[..., : tensor.shape[-1]]
    elif layout == "expand":
        strided = tensor.reshape(-1)[:1].expand(tensor.shape)  # every element one (stride 0)
    else:
        strided = tensor.clone()
    dense = strided.contiguous()
    if name in ("k_cache", "v_cache") and not strided.is_contiguous():
        with pytest.raises(ValueError, match=f"{name} must be contiguous"):
            ATTEND(**{**call, name: strided})
        return
    assert torch.equal(ATTEND(**{**call, name: strided, "store": 0}), ATTEND(**{**call, name: dense, "store": 0}))


# --- q4 / q8 -------------------------------------------------------------------------------------------------
def q4_layer(rows: int = 3, depth: int = 64, width: int = 20, rank: int = 2) -> dict:
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, (width, depth), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, (width, depth // 32)).astype(np.float16).astype(np.float32)
    weights = q4_linear.pack(codes, scales, -scales)
    down, up, splits = q4_linear.pack_lora(
        rng.standard_normal((rank, depth)), rng.standard_normal((width, rank)), 0.5, width, depth
    )
    return {
        "x": torch.from_numpy(rng.standard_normal((1, rows, depth)).astype(np.float32)),
        "weights": torch.from_numpy(weights),
        "lora_a": torch.from_numpy(down),
        "lora_up": torch.from_numpy(up),
        "rank_splits": torch.from_numpy(splits),
        "out_features": width,
    }


BAD_Q4_OUTS = [
    (torch.empty(1), "out must be a rank-3 float32 tensor, got rank 1 float32"),
    (torch.empty(1, 3, 19), "out must have x's shape with out_features (20) last"),
    (torch.empty(2, 3, 20), "out must have x's shape"),
    (torch.empty(1, 3, 20, dtype=torch.float64), "out must be a rank-3 float32 tensor, got rank 3 float64"),
    (torch.empty(1, 20, 3).transpose(1, 2), "out must be contiguous"),
]


@pytest.mark.parametrize("out, message", BAD_Q4_OUTS)
def test_q4_linear_out_refuses_a_wrong_out(out, message):
    with pytest.raises(q4_linear.Q4LinearError, match=re.escape(message)):
        torch.ops.streamfuse.q4_linear.out(*q4_layer().values(), out=out)


def test_q4_linear_out_writes_a_right_out():
    layer = q4_layer()
    out = torch.full((1, 3, 20), float("nan"))
    torch.ops.streamfuse.q4_linear.out(*layer.values(), out=out)
    assert torch.equal(out, Q4(*layer.values()))


BAD_Q4 = [
    (
        "weights of int8",
        lambda lin: {**lin, "weights": lin["weights"].view(torch.int8)},
        "weights must be a rank-3 uint8 tensor, got rank 3 int8",
    ),
    ("weights short", lambda lin: {**lin, "weights": lin["weights"][:, :1]}, "the packed weights must be"),
    ("lora_a of rank 1", lambda lin: {**lin, "lora_a": lin["lora_a"][:, 0]}, "lora_a must be a rank-2 float32 tensor"),
    (
        "x of rank 5",
        lambda lin: {**lin, "x": lin["x"].reshape(1, 1, 1, 3, 64)},
        "x must be a float32 tensor of rank 1 to 4",
    ),
    (
        "rank_splits of int32",
        lambda lin: {**lin, "rank_splits": lin["rank_splits"].int()},
        "rank_splits must be a rank-2 int64 tensor, got rank 2 int32",
    ),
    (
        "rank_splits past the tiles",
        lambda lin: {**lin, "rank_splits": torch.tensor([[1, 2], [2, 0]])},
        "rank_splits' tiles must be >= 1 each and sum to ceil(out_features / 16) = 2, row 1 has 2",
    ),
    (
        "rank_splits short of the rank",
        lambda lin: {**lin, "rank_splits": torch.tensor([[2, 1]])},
        "rank_splits must cover every tile and rank column",
    ),
    ("out_features 0", lambda lin: {**lin, "out_features": 0}, "out_features must be in [1, 2^24], got 0"),
    ("out_features huge", lambda lin: {**lin, "out_features": 2**40}, "out_features must be in [1, 2^24]"),
]


@pytest.mark.parametrize("what, change, message", BAD_Q4, ids=[case[0] for case in BAD_Q4])
def test_q4_linear_refuses_an_unsound_call(what, change, message):
    with pytest.raises(q4_linear.Q4LinearError, match=re.escape(message)) as error:
        Q4(*change(q4_layer()).values())
    assert one_line(error).startswith("q4_linear: ")


def test_q8_head_refuses_a_wrong_out_or_codes():
    rng = np.random.default_rng(2)
    codes, scales = q8_linear.pack(
        rng.integers(-127, 128, (20, 64), dtype=np.int8), rng.uniform(0.01, 0.1, (20, 2)).astype(np.float32)
    )
    x = rng.standard_normal((3, 64)).astype(np.float32)
    for out, message in [
        (np.empty(1, np.float32), "out must be a rank-2 float32 tensor, got rank 1"),
        (np.empty((3, 21), np.float32), "out must have x's shape with out_features (20) last"),
        (np.empty((20, 3), np.float32).T, "out must be contiguous"),
        (np.empty((3, 20), np.float32).view(">f4"), "got rank 2 another type"),
    ]:
        with pytest.raises(q4_linear.Q4LinearError, match=re.escape(message)):
            q8_linear.linear(x, codes, scales, 20, out=out)
    with pytest.raises(q4_linear.Q4LinearError, match="codes must be a rank-1 int8 tensor, got rank 1 uint8"):
        q8_linear.linear(x, codes.view(np.uint8), scales, 20)
    got = np.full((3, 20), np.nan, np.float32)
    q8_linear.linear(x, codes, scales, 20, out=got)
    assert np.array_equal(got, q8_linear.reference(x, codes, scales, 20))


# --- ONNX Runtime ----------------------------------------------------------------------------------------------
def attention_session(layer: int = 1, store: int = 2):
    """One TreeAttention node whose inputs take any shape: a crafted graph feeds the op what it likes."""
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    names = ["query", "k_cache", "v_cache", "start", "k_extra", "v_extra", "visible"]
    types = [TensorProto.INT64 if n == "start" else TensorProto.FLOAT for n in names]
    ranks = [4, 4, 4, 1, 4, 4, 2]
    inputs = [
        helper.make_tensor_value_info(n, t, [f"{n}{i}" for i in range(r)]) for n, t, r in zip(names, types, ranks)
    ]
    node = helper.make_node("TreeAttention", names, ["out"], domain="streamfuse", layer=layer, scale=0.3, store=store)
    graph = helper.make_graph([node], "attend", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("streamfuse", 1)], ir_version=10
    )
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(kernel_library.onnxruntime_library_path()))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def feeds(call: dict) -> dict:
    names = ["query", "k_cache", "v_cache", "start", "k_extra", "v_extra", "visible"]
    return {n: np.ascontiguousarray(call[n].numpy()) for n in names}


def test_onnxruntime_refuses_every_unsound_attention_with_the_validators_message():
    session = attention_session()
    call = sound_call()
    assert np.array_equal(session.run(None, feeds(call))[0], ATTEND(**{**call, "store": 0}).numpy())
    # not through this graph: attributes fixed at load, ranks and element types ONNX Runtime checks itself, and
    # strides (its tensors are dense)
    elsewhere = {
        "layer past the cache",
        "store past the extra rows",
        "scale not a float32",
        "query of rank 3",
        "start int32",
        "caches of float64",
        "caches not contiguous",
    }
    cases = [case for case in BAD_ATTENTION if case[0] not in elsewhere]
    cases += [
        (
            "start of no element, read before its size once",
            with_(start=torch.zeros(0, dtype=torch.int64)),
            "start must hold one number ([1] int64), got 0",
        )
    ]
    for what, change, message in cases:
        bad = change(sound_call())
        k_cache = bad["k_cache"].numpy().copy()
        inputs = feeds(bad)
        with pytest.raises(Exception, match=re.escape(message)):
            session.run(None, inputs)
        assert np.array_equal(inputs["k_cache"], k_cache), what  # the store wrote nothing


def test_onnxruntime_refuses_a_layer_or_store_out_of_range_and_a_bad_commit():
    for layer, store, message in [
        (LAYERS, 0, "layer 2 is outside the cache's 2 layers"),
        (0, EXTRA + 1, "store 4 is outside [0, 3]"),
    ]:
        with pytest.raises(Exception, match=re.escape(message)):
            attention_session(layer, store).run(None, feeds(sound_call()))
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    names = ["k_cache", "v_cache", "start", "accepted"]
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.INT64 if n in ("start", "accepted") else TensorProto.FLOAT, None)
        for n in names
    ]
    node = helper.make_node("CommitRows", names, ["out"], domain="streamfuse")
    graph = helper.make_graph([node], "commit", inputs, [helper.make_tensor_value_info("out", TensorProto.INT64, None)])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("streamfuse", 1)], ir_version=10
    )
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(kernel_library.onnxruntime_library_path()))
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    call = sound_call()
    for start, accepted, message in BAD_COMMITS[:2]:
        inputs = {
            "k_cache": call["k_cache"].numpy().copy(),
            "v_cache": call["v_cache"].numpy().copy(),
            "start": np.array([start], np.int64),
            "accepted": np.array(accepted, np.int64),
        }
        with pytest.raises(Exception, match=re.escape(message)):
            session.run(None, inputs)
    inputs = {
        "k_cache": call["k_cache"].numpy(),
        "v_cache": call["v_cache"].numpy(),
        "start": np.zeros(0, np.int64),
        "accepted": np.array([0], np.int64),
    }
    with pytest.raises(Exception, match=re.escape("start and out must each hold one number")):
        session.run(None, inputs)


# --- ExecuTorch ------------------------------------------------------------------------------------------------
class Attend(torch.nn.Module):
    def forward(self, query, k_cache, v_cache, start, k_extra, v_extra, visible):
        return ATTEND(query, k_cache, v_cache, 1, start, k_extra, v_extra, visible, 0.3, 2)


# Programs whose tensors disagree (the fake, which exports them, looks at query alone): a crafted .pte
BAD_PROGRAMS = [
    ("v_cache smaller", with_(v_cache=torch.randn(LAYERS, KV, 4, DIM)), "v_cache must have k_cache's shape"),
    ("heads fewer than kv_heads", heads(1), "heads (1) must be a positive multiple of kv_heads"),
    ("visible of other rows", with_(visible=torch.ones(2, EXTRA)), "visible must be [rows, extra]"),
    ("start of two", with_(start=torch.tensor([5, 6])), "start must hold one number"),
]


@pytest.mark.skipif(importlib.util.find_spec("executorch") is None, reason="executorch not installed")
def test_executorch_refuses_a_crafted_program_with_the_validators_message(capfd):
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    kernel_library.load_executorch_kernels()
    for what, change, message in BAD_PROGRAMS:
        call = change(sound_call())
        inputs = tuple(call[n] for n in ("query", "k_cache", "v_cache", "start", "k_extra", "v_extra", "visible"))
        program = to_edge_transform_and_lower(torch.export.export(Attend(), inputs, strict=False)).to_executorch()
        method = Runtime.get().load_program(program.buffer).load_method("forward")
        k_cache = inputs[1].clone()
        capfd.readouterr()
        with pytest.raises(Exception):  # noqa: B017  (the binding's error type is ExecuTorch's own, per release)
            method.execute(list(inputs))
        assert message in capfd.readouterr().err, what  # ExecuTorch logs the kernel's error
        assert torch.equal(inputs[1], k_cache), what
