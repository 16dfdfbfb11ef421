"""The exact attention kernel (runtime/kernels/tree_attention.h): equal to its NumPy reference bit for bit, a
row's bits independent of the call's other rows, size, tree and threads, a tree row equal to plain decoding
of its token, the same bits through ExecuTorch and ONNX Runtime, and a one-line error where it cannot be built."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamfuse.runtime import tree_attention

OP = tree_attention.torch_op()
HEADS, KV, DIM, CAPACITY = 6, 2, 20, 48  # dim 20: two full lanes of 8 and a tail of 4


def tensors(seed: int, rows: int, extra: int | None = None, dim: int = DIM):
    g = torch.Generator().manual_seed(seed)
    extra = rows if extra is None else extra
    return (torch.randn(1, HEADS, rows, dim, generator=g), torch.randn(1, KV, CAPACITY, dim, generator=g),
            torch.randn(1, KV, CAPACITY, dim, generator=g), torch.randn(1, KV, extra, dim, generator=g),
            torch.randn(1, KV, extra, dim, generator=g))


def attend(query, k_cache, v_cache, start, k_extra, v_extra, visible, scale=0.3, layer=0):
    return OP(query, k_cache, v_cache, layer, torch.tensor([start]), k_extra, v_extra, visible.float(), scale)


# (start, visibility over the call's rows): the cache alone, a chain, a tree, a row seeing only itself
CASES = [
    (0, [[1]]),
    (5, [[1]]),
    (11, [[1, 0, 0], [1, 1, 0], [1, 1, 1]]),
    (30, [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]),
    (7, [[1, 0], [0, 1]]),
    (40, [[1] * (i + 1) + [0] * (6 - i) for i in range(7)]),  # 21 queries a KV head: two batches; 2 key blocks
]


@pytest.mark.parametrize("dim", [DIM, 64], ids=["dim-20", "dim-64"])  # 64: keys eight at a time (dot8, exp_poly8)
@pytest.mark.parametrize("scale", [0.3, 25.0], ids=["scale-0.3", "underflow"])  # 25: exps below EXP_FLOOR
@pytest.mark.parametrize("start, visible", CASES)
def test_the_kernel_is_its_reference_bit_for_bit(start, visible, dim, scale):
    visible = torch.tensor(visible, dtype=torch.float32)
    query, k_cache, v_cache, k_extra, v_extra = tensors(start, len(visible), dim=dim)
    got = attend(query, k_cache, v_cache, start, k_extra, v_extra, visible, scale).numpy()
    want = tree_attention.reference(query.numpy(), k_cache.numpy(), v_cache.numpy(), start, k_extra.numpy(),
                                    v_extra.numpy(), visible.numpy(), scale)
    assert got.shape == (1, len(visible), HEADS, dim) and np.array_equal(got, want)


def test_the_kernel_is_softmax_attention():
    query, k_cache, v_cache, k_extra, v_extra = tensors(1, 3)
    visible = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.float32)
    got = attend(query, k_cache, v_cache, 9, k_extra, v_extra, visible)
    group = HEADS // KV
    keys = torch.cat([k_cache[:, :, :9], k_extra], dim=2).repeat_interleave(group, dim=1)
    values = torch.cat([v_cache[:, :, :9], v_extra], dim=2).repeat_interleave(group, dim=1)
    mask = torch.cat([torch.zeros(3, 9), (1 - visible) * -1e9], dim=1)
    want = torch.softmax(query @ keys.transpose(-1, -2) * 0.3 + mask, dim=-1) @ values
    torch.testing.assert_close(got, want.transpose(1, 2), atol=1e-5, rtol=1e-5)


@st.composite
def trees_in_calls(draw):
    """A random tree of 1..16 nodes, a start, a thread count, and where its rows sit in a bigger call."""
    nodes = draw(st.integers(1, 16))
    parents = [draw(st.integers(0, node - 1)) for node in range(1, nodes)]
    return nodes, parents, draw(st.integers(0, CAPACITY - 16)), draw(st.sampled_from([1, 2])), draw(st.integers(0, 2**16))


def ancestors(parents: list[int]) -> torch.Tensor:
    visible = torch.eye(len(parents) + 1)
    for node, parent in enumerate(parents, start=1):
        visible[node] += visible[parent]
    return visible.clamp(max=1)


@settings(max_examples=60, deadline=None)
@given(trees_in_calls())
def test_a_row_has_the_same_bits_alone_in_any_call_and_as_plain_decoding(case):
    """Row i of an M-row tree call == row i alone with its ancestors == plain decoding of its token (its
    ancestors committed to the cache after `start`), at 1 and 2 threads."""
    nodes, parents, start, threads, seed = case
    visible = ancestors(parents)
    query, k_cache, v_cache, k_extra, v_extra = tensors(seed, nodes, dim=(DIM, 64)[seed % 2])
    before, work = torch.get_num_threads(), tree_attention.WORK_PER_THREAD
    torch.set_num_threads(threads)
    tree_attention.WORK_PER_THREAD = 1  # every call split over `threads`, however small
    try:
        whole = attend(query, k_cache, v_cache, start, k_extra, v_extra, visible)
        for row in range(nodes):
            seen = visible[row].nonzero()[:, 0]
            alone = attend(query[:, :, row : row + 1], k_cache, v_cache, start, k_extra[:, :, seen],
                           v_extra[:, :, seen], torch.ones(1, len(seen)))
            assert torch.equal(alone[0, 0], whole[0, row])
            committed = [k_cache.clone(), v_cache.clone()]
            for cache, new in zip(committed, (k_extra, v_extra)):
                cache[:, :, start : start + len(seen) - 1] = new[:, :, seen[:-1]]
            plain = attend(query[:, :, row : row + 1], *committed, start + len(seen) - 1, k_extra[:, :, [row]],
                           v_extra[:, :, [row]], torch.ones(1, 1))
            assert torch.equal(plain[0, 0], whole[0, row])
    finally:
        torch.set_num_threads(before)
        tree_attention.WORK_PER_THREAD = work


def test_the_kernel_reads_one_layer_of_the_whole_cache():
    query, k_cache, v_cache, k_extra, v_extra = tensors(4, 2)
    visible = torch.tensor([[1, 0], [1, 1]])
    layers = [torch.cat([torch.randn_like(cache), cache, torch.randn_like(cache)]) for cache in (k_cache, v_cache)]
    assert torch.equal(attend(query, *layers, 21, k_extra, v_extra, visible, layer=1),
                       attend(query, k_cache, v_cache, 21, k_extra, v_extra, visible))


def test_a_bad_start_or_layer_is_a_clear_error():
    query, k_cache, v_cache, k_extra, v_extra = tensors(0, 1)
    with pytest.raises(ValueError, match="start 49 is outside the cache's 48 slots"):
        attend(query, k_cache, v_cache, 49, k_extra, v_extra, torch.ones(1, 1))
    with pytest.raises(ValueError, match="layer 1 is outside the cache's 1 layers"):
        attend(query, k_cache, v_cache, 3, k_extra, v_extra, torch.ones(1, 1), layer=1)


def test_without_a_compiler_the_error_is_one_line_naming_it(monkeypatch, tmp_path):
    monkeypatch.setattr(tree_attention, "BUILD", tmp_path)
    monkeypatch.setattr(tree_attention.shutil, "which", lambda name: None)
    with pytest.raises(tree_attention.KernelUnavailable, match="needs a C\\+\\+ compiler .* install g\\+\\+") as error:
        tree_attention._library_path("libprobe", ["tree_attention_c.cpp"], [])
    assert "\n" not in str(error.value) and not list(tmp_path.iterdir())


def test_a_failed_compile_names_the_error_and_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.setattr(tree_attention, "BUILD", tmp_path)
    with pytest.raises(tree_attention.KernelUnavailable, match="compiling the tree attention kernel .*failed: .*error"):
        tree_attention._library_path("libprobe", ["tree_attention_c.cpp"], ["-DSTREAMFUSE_PROBE", "-include", "nonexistent.h"])
    assert not list(tmp_path.iterdir())


class Attend(torch.nn.Module):
    """The op on the second layer of a two-layer cache, as a program's attention calls it."""

    def forward(self, query, k_cache, v_cache, start, k_extra, v_extra, visible):
        return OP(query, k_cache, v_cache, 1, start, k_extra, v_extra, visible, 0.3)


def two_layers(seed: int, rows: int, start: int, visible: torch.Tensor) -> tuple:
    query, k_cache, v_cache, k_extra, v_extra = tensors(seed, rows)
    k_cache, v_cache = torch.cat([k_cache, k_cache.flip(2)]), torch.cat([v_cache, v_cache.flip(2)])
    return query, k_cache, v_cache, torch.tensor([start]), k_extra, v_extra, visible.float()


@pytest.mark.skipif(tree_attention.importlib.util.find_spec("executorch") is None, reason="executorch not installed")
def test_executorch_runs_the_same_kernel_bit_for_bit_on_random_trees_and_threads(tmp_path):
    """One 16-row program (trees, starts and caches are its inputs) against the torch op, whose rows the
    property test above proves invariant: random trees of 1-16 nodes (pad rows see themselves), random
    starts, with ExecuTorch's threadpool at 2 threads and at 1."""
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from streamfuse.runtime.backends.sessions import set_executorch_threads

    rows, g = 16, torch.Generator().manual_seed(7)
    example = two_layers(0, rows, 13, torch.eye(rows))
    program = to_edge_transform_and_lower(torch.export.export(Attend(), example, strict=False)).to_executorch()
    (tmp_path / "attend.pte").write_bytes(program.buffer)
    tree_attention.load_executorch_kernels()
    for threads in (2, 1):  # ExecuTorch's threadpool splits the rows and heads, or does not
        set_executorch_threads(threads)
        method = Runtime.get().load_program(tmp_path / "attend.pte").load_method("forward")
        for nodes, start, inputs in random_tree_calls(rows, 6, g):
            assert torch.equal(method.execute(list(inputs))[0], Attend()(*inputs)), (threads, nodes, start)


def random_tree_calls(rows: int, count: int, generator: torch.Generator):
    """(nodes, start, inputs) of `count` calls of `rows` rows: random trees of 1..rows nodes (pad rows see
    themselves), random starts, the two-layer cache of two_layers."""
    for seed in range(count):
        nodes = int(torch.randint(1, rows + 1, (1,), generator=generator))
        parents = [int(torch.randint(0, node, (1,), generator=generator)) for node in range(1, nodes)]
        visible = torch.eye(rows)
        visible[:nodes, :nodes] = ancestors(parents)
        start = int(torch.randint(0, CAPACITY - rows + 1, (1,), generator=generator))
        yield nodes, start, two_layers(seed, rows, start, visible)


@pytest.mark.skipif(tree_attention.importlib.util.find_spec("onnxruntime") is None, reason="onnxruntime not installed")
def test_onnxruntime_runs_the_same_kernel_bit_for_bit_on_random_trees_and_threads(tmp_path):
    """The exported op (export/to_onnx.py's translation) in an ONNX Runtime session with the custom-op library,
    against the torch op: random trees of 1-16 nodes and starts, ONNX Runtime's intra-op pool at 2 threads
    and at 1; a bad start is the op's one-line error, not a crash."""
    import onnxruntime as ort

    from streamfuse.export.to_onnx import custom_translations

    rows = 16
    path = tmp_path / "attend.onnx"
    program = torch.export.export(Attend(), two_layers(0, rows, 13, torch.eye(rows)), strict=False)
    torch.onnx.export(program, (), dynamo=True, custom_translation_table=custom_translations(), verbose=False
                      ).save(str(path))
    for threads in (2, 1):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.register_custom_ops_library(str(tree_attention.onnxruntime_library_path()))
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        for nodes, start, inputs in random_tree_calls(rows, 6, torch.Generator().manual_seed(7)):
            (out,) = session.run(None, dict(zip(names, (t.numpy() for t in inputs))))
            assert np.array_equal(out, Attend()(*inputs).numpy()), (threads, nodes, start)
    bad = dict(zip(names, (t.numpy() for t in two_layers(0, rows, 13, torch.eye(rows)))))
    bad[names[3]] = np.array([CAPACITY + 1], dtype=np.int64)
    with pytest.raises(Exception, match="TreeAttention: start outside the cache"):
        session.run(None, bad)
