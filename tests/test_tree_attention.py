"""The exact attention kernel (runtime/kernels/tree_attention.h): equal to its NumPy reference bit for bit, a
row's bits independent of the call's other rows, size, tree and threads, a tree row equal to plain decoding
of its token, the same bits through ExecuTorch and ONNX Runtime, and a one-line error where it cannot be built.
The cache's upkeep in place: the store and commit_rows equal their references byte for byte, in torch and in
both engines, where they land in the host's own buffers."""

import importlib.util
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamfuse.runtime.ops import kernel_library, tree_attention

OP = tree_attention.torch_op()
COMMIT = tree_attention.commit_op()
HEADS, KV, DIM, CAPACITY = 6, 2, 20, 48  # dim 20: two full lanes of 8 and a tail of 4


def tensors(seed: int, rows: int, extra: int | None = None, dim: int = DIM):
    g = torch.Generator().manual_seed(seed)
    extra = rows if extra is None else extra
    return (
        torch.randn(1, HEADS, rows, dim, generator=g),
        torch.randn(1, KV, CAPACITY, dim, generator=g),
        torch.randn(1, KV, CAPACITY, dim, generator=g),
        torch.randn(1, KV, extra, dim, generator=g),
        torch.randn(1, KV, extra, dim, generator=g),
    )


def attend(query, k_cache, v_cache, start, k_extra, v_extra, visible, scale=0.3, layer=0, store=0):
    return OP(query, k_cache, v_cache, layer, torch.tensor([start]), k_extra, v_extra, visible.float(), scale, store)


# (start, visibility over the call's rows): the cache alone, a chain, a tree, a row seeing only itself
CASES = [
    (0, [[1]]),
    (5, [[1]]),
    (11, [[1, 0, 0], [1, 1, 0], [1, 1, 1]]),
    (30, [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]),
    (7, [[1, 0], [0, 1]]),
    (40, [[1] * (i + 1) + [0] * (6 - i) for i in range(7)]),  # 21 queries a KV head: two batches; 2 key blocks
]


@pytest.mark.parametrize("dim", [DIM, 64], ids=["dim-20", "dim-64"])  # 64: dot8, exp_in_place, AVX-512 pairs
@pytest.mark.parametrize("scale", [0.3, 25.0], ids=["scale-0.3", "underflow"])  # 25: exps below EXP_FLOOR
@pytest.mark.parametrize("start, visible", CASES)
def test_the_kernel_is_its_reference_bit_for_bit(start, visible, dim, scale):
    visible = torch.tensor(visible, dtype=torch.float32)
    query, k_cache, v_cache, k_extra, v_extra = tensors(start, len(visible), dim=dim)
    got = attend(query, k_cache, v_cache, start, k_extra, v_extra, visible, scale).numpy()
    want = tree_attention.reference(
        query.numpy(), k_cache.numpy(), v_cache.numpy(), start, k_extra.numpy(), v_extra.numpy(), visible.numpy(), scale
    )
    assert got.shape == (1, len(visible), HEADS, dim) and np.array_equal(got, want)


@settings(max_examples=40, deadline=None)
@given(
    start=st.integers(0, 40),
    rows=st.integers(1, 12),
    extra=st.integers(1, 40),
    dim=st.sampled_from([DIM, 64]),
    seed=st.integers(0, 2**31),
)
def test_any_visibility_of_many_extra_keys_is_the_reference_bit_for_bit(start, rows, extra, dim, seed):
    """Extra keys scored and weighed eight at a time where a row sees one of them (dot8, exp_in_place) and summed in
    runs of consecutive seen keys: the reference's one-key-at-a-time bits, whatever the pattern (gaps, whole
    blocks unseen, tails)."""
    rng = np.random.default_rng(seed)
    visible = (rng.random((rows, extra)) < rng.uniform(0.1, 0.9)).astype(np.float32)
    visible[np.arange(rows), np.arange(rows) % extra] = 1  # every row sees a key
    query, k_cache, v_cache, k_extra, v_extra = tensors(seed % 1000, rows, extra, dim=dim)
    got = attend(query, k_cache, v_cache, start, k_extra, v_extra, torch.from_numpy(visible)).numpy()
    want = tree_attention.reference(
        query.numpy(), k_cache.numpy(), v_cache.numpy(), start, k_extra.numpy(), v_extra.numpy(), visible, 0.3
    )
    assert np.array_equal(got, want)


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
    return (
        nodes,
        parents,
        draw(st.integers(0, CAPACITY - 16)),
        draw(st.sampled_from([1, 2])),
        draw(st.integers(0, 2**16)),
    )


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
            alone = attend(
                query[:, :, row : row + 1],
                k_cache,
                v_cache,
                start,
                k_extra[:, :, seen],
                v_extra[:, :, seen],
                torch.ones(1, len(seen)),
            )
            assert torch.equal(alone[0, 0], whole[0, row])
            committed = [k_cache.clone(), v_cache.clone()]
            for cache, new in zip(committed, (k_extra, v_extra)):
                cache[:, :, start : start + len(seen) - 1] = new[:, :, seen[:-1]]
            plain = attend(
                query[:, :, row : row + 1],
                *committed,
                start + len(seen) - 1,
                k_extra[:, :, [row]],
                v_extra[:, :, [row]],
                torch.ones(1, 1),
            )
            assert torch.equal(plain[0, 0], whole[0, row])
    finally:
        torch.set_num_threads(before)
        tree_attention.WORK_PER_THREAD = work


def test_the_kernel_reads_one_layer_of_the_whole_cache():
    query, k_cache, v_cache, k_extra, v_extra = tensors(4, 2)
    visible = torch.tensor([[1, 0], [1, 1]])
    layers = [torch.cat([torch.randn_like(cache), cache, torch.randn_like(cache)]) for cache in (k_cache, v_cache)]
    assert torch.equal(
        attend(query, *layers, 21, k_extra, v_extra, visible, layer=1),
        attend(query, k_cache, v_cache, 21, k_extra, v_extra, visible),
    )


def test_a_bad_start_or_layer_is_a_clear_error():
    query, k_cache, v_cache, k_extra, v_extra = tensors(0, 1)
    with pytest.raises(ValueError, match="start 49 is outside the cache's 48 slots"):
        attend(query, k_cache, v_cache, 49, k_extra, v_extra, torch.ones(1, 1))
    with pytest.raises(ValueError, match="layer 1 is outside the cache's 1 layers"):
        attend(query, k_cache, v_cache, 3, k_extra, v_extra, torch.ones(1, 1), layer=1)


# (start, store): the first slots, mid-cache, rows past the capacity dropped (2 of 5, all of 2), nothing stored
STORES = [(0, 1), (11, 3), (45, 5), (48, 2), (30, 0)]


@pytest.mark.parametrize("start, store", STORES)
def test_the_store_writes_its_rows_of_its_layer_and_leaves_the_attention_alone(start, store):
    query, k_cache, v_cache, k_extra, v_extra = tensors(start, 5)
    caches = [torch.cat([c.flip(2), c, 2 * c]) for c in (k_cache, v_cache)]  # three layers; layer 1 attended
    want = [c.numpy().copy() for c in caches]
    visible = torch.tril(torch.ones(5, 5))
    plain = attend(query, *caches, start, k_extra, v_extra, visible, layer=1)
    assert all(c.numpy().tobytes() == w.tobytes() for c, w in zip(caches, want))  # store 0 writes nothing
    stored = attend(query, *caches, start, k_extra, v_extra, visible, layer=1, store=store)
    tree_attention.reference_store(*want, 1, start, k_extra.numpy(), v_extra.numpy(), store)
    assert torch.equal(stored, plain)
    assert all(c.numpy().tobytes() == w.tobytes() for c, w in zip(caches, want))


def test_a_bad_store_is_a_clear_error():
    query, k_cache, v_cache, k_extra, v_extra = tensors(0, 2)
    for store in (3, -1):
        with pytest.raises(ValueError, match=re.escape(f"store {store} is outside [0, 2] (the extra rows)")):
            attend(query, k_cache, v_cache, 4, k_extra, v_extra, torch.ones(2, 2), store=store)
    with pytest.raises(ValueError, match="k_cache must be contiguous"):  # a copy would take the store
        attend(
            query,
            k_cache.transpose(2, 3).contiguous().transpose(2, 3),
            v_cache,
            4,
            k_extra,
            v_extra,
            torch.ones(2, 2),
            store=1,
        )


# (start after the commit, accepted): a chain's first node, a path skipping nodes, a path not through node 0,
# nothing accepted, nothing moving (accepted[j] == j), the cache's last slot as a source
COMMITS = [
    (12, [0, -1, -1, -1]),
    (20, [0, 2, 5, -1]),
    (9, [1, 2, -1, -1]),
    (30, [-1, -1, -1, -1]),
    (3, [0, 1, 2, -1]),
    (40, [2, 3, 5, 11]),
]


def two_layer_caches(seed: int):
    _, k_cache, v_cache, _, _ = tensors(seed, 1)
    return torch.cat([k_cache, k_cache.flip(2)]), torch.cat([v_cache, -v_cache])


def commit(k_cache, v_cache, start: int, accepted: list[int]):
    return COMMIT(k_cache, v_cache, torch.tensor([start]), torch.tensor(accepted))


@pytest.mark.parametrize("start, accepted", COMMITS)
def test_commit_rows_is_its_reference_byte_for_byte(start, accepted):
    caches = two_layer_caches(start)
    want = [c.numpy().copy() for c in caches]
    out = commit(*caches, start, accepted)
    tree_attention.reference_commit(*want, start, accepted)
    assert out.dtype == torch.int64 and out.tolist() == [start]
    assert all(c.numpy().tobytes() == w.tobytes() for c, w in zip(caches, want))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 15), max_size=6, unique=True).map(sorted), st.integers(0, 2**16))
def test_commit_rows_moves_each_accepted_row_to_its_place(nodes, seed):
    """Whatever the path: slot base + j ends up with what slot base + nodes[j] held before."""
    start = len(nodes) + seed % (CAPACITY - 15 - len(nodes) + 1)
    caches = two_layer_caches(seed)
    before = [c.clone() for c in caches]
    commit(*caches, start, nodes + [-1] * (6 - len(nodes)))
    base = start - len(nodes)
    for cache, old in zip(caches, before):
        assert torch.equal(cache[:, :, base:start], old[:, :, [base + node for node in nodes]])
        assert torch.equal(cache[:, :, :base], old[:, :, :base]) and torch.equal(cache[:, :, start:], old[:, :, start:])


BAD_COMMITS = [
    (12, [0, -1, 2, -1], "accepted [0, -1, 2, -1] must be its nodes >= 0 first, then only -1 padding"),
    (12, [0, -2, -1, -1], "accepted [0, -2, -1, -1] must be its nodes >= 0 first, then only -1 padding"),
    (12, [0, 3, 3, -1], "accepted [0, 3, 3, -1]'s nodes must be strictly increasing"),
    (12, [2, 1, -1, -1], "accepted [2, 1, -1, -1]'s nodes must be strictly increasing"),
    (2, [0, 1, 2, -1], "start 2 is less than the 3 accepted nodes (base = start - n < 0)"),
    (47, [0, 3, -1, -1], "accepted node 3 is row 48, past the cache's 48 slots"),
    (49, [-1, -1, -1, -1], "start 49 is outside the cache's 48 slots"),
]


@pytest.mark.parametrize("start, accepted, message", BAD_COMMITS)
def test_a_bad_commit_is_a_one_line_error_and_moves_nothing(start, accepted, message):
    caches = two_layer_caches(0)
    before = [c.clone() for c in caches]
    with pytest.raises(ValueError, match=re.escape(message)):
        commit(*caches, start, accepted)
    assert all(torch.equal(c, b) for c, b in zip(caches, before))
    with pytest.raises(ValueError, match="accepted must be a rank-1 int64 tensor, got rank 1 int32"):
        COMMIT(*caches, torch.tensor([12]), torch.tensor([0, -1], dtype=torch.int32))


class Attend(torch.nn.Module):
    """The op on the second layer of a two-layer cache, as a program's attention calls it."""

    def forward(self, query, k_cache, v_cache, start, k_extra, v_extra, visible):
        return OP(query, k_cache, v_cache, 1, start, k_extra, v_extra, visible, 0.3, 0)


def two_layers(seed: int, rows: int, start: int, visible: torch.Tensor) -> tuple:
    query, k_cache, v_cache, k_extra, v_extra = tensors(seed, rows)
    k_cache, v_cache = torch.cat([k_cache, k_cache.flip(2)]), torch.cat([v_cache, v_cache.flip(2)])
    return query, k_cache, v_cache, torch.tensor([start]), k_extra, v_extra, visible.float()


@pytest.mark.skipif(importlib.util.find_spec("executorch") is None, reason="executorch not installed")
def test_executorch_runs_the_same_kernel_bit_for_bit_on_random_trees_and_threads(tmp_path):
    """One 16-row program (trees, starts and caches are its inputs) against the torch op, whose rows the
    property test above proves invariant: random trees of 1-16 nodes (pad rows see themselves), random
    starts, with ExecuTorch's threadpool at 2 threads and at 1."""
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from streamfuse.runtime.backends.runners import set_executorch_threads

    rows, g = 16, torch.Generator().manual_seed(7)
    example = two_layers(0, rows, 13, torch.eye(rows))
    program = to_edge_transform_and_lower(torch.export.export(Attend(), example, strict=False)).to_executorch()
    (tmp_path / "attend.pte").write_bytes(program.buffer)
    kernel_library.load_executorch_kernels()
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


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is None, reason="onnxruntime not installed")
def test_onnxruntime_runs_the_same_kernel_bit_for_bit_on_random_trees_and_threads(tmp_path):
    """The exported op (export/to_onnx.py's translation) in an ONNX Runtime session with the custom-op library,
    against the torch op: random trees of 1-16 nodes and starts, ONNX Runtime's intra-op pool at 2 threads
    and at 1; a bad start is the op's one-line error, not a crash."""
    import onnxruntime as ort

    from streamfuse.export.to_onnx import custom_translations

    rows = 16
    path = tmp_path / "attend.onnx"
    program = torch.export.export(Attend(), two_layers(0, rows, 13, torch.eye(rows)), strict=False)
    torch.onnx.export(program, (), dynamo=True, custom_translation_table=custom_translations(), verbose=False).save(
        str(path)
    )
    for threads in (2, 1):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.register_custom_ops_library(str(kernel_library.onnxruntime_library_path()))
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        for nodes, start, inputs in random_tree_calls(rows, 6, torch.Generator().manual_seed(7)):
            (out,) = session.run(None, dict(zip(names, (t.numpy() for t in inputs))))
            assert np.array_equal(out, Attend()(*inputs).numpy()), (threads, nodes, start)
    bad = dict(zip(names, (t.numpy() for t in two_layers(0, rows, 13, torch.eye(rows)))))
    bad[names[3]] = np.array([CAPACITY + 1], dtype=np.int64)
    with pytest.raises(Exception, match="tree_attention: start 49 is outside the cache's 48 slots"):
        session.run(None, bad)


class Step(torch.nn.Module):
    """A tree step as the graphs run it: commit the previous step's accepted rows, then attend on the second
    layer with commit_rows' start (the data dependency that orders the two) and store the call's first rows."""

    def forward(self, query, k_cache, v_cache, start, accepted, k_extra, v_extra, visible):
        start = COMMIT(k_cache, v_cache, start, accepted)
        return OP(query, k_cache, v_cache, 1, start, k_extra, v_extra, visible, 0.3, STEP_STORE)


STEP_ROWS, STEP_STORE = 4, 3
# (start after the commit, accepted); the last stores one row past the capacity
STEPS = [(20, [0, 2, 3, -1]), (9, [1, 2, -1, -1]), (30, [-1, -1, -1, -1]), (46, [0, 1, -1, -1])]


def step_inputs(seed: int, start: int, accepted: list[int]) -> tuple:
    query, k_cache, v_cache, k_extra, v_extra = tensors(seed, STEP_ROWS)
    k_cache, v_cache = torch.cat([k_cache, k_cache.flip(2)]), torch.cat([v_cache, v_cache.flip(2)])
    return (
        query,
        k_cache,
        v_cache,
        torch.tensor([start]),
        torch.tensor(accepted),
        k_extra,
        v_extra,
        torch.tril(torch.ones(STEP_ROWS, STEP_ROWS)),
    )


def step_expected(inputs: tuple) -> tuple:
    """The eager step's output on copies of the caches, and the caches the references leave (the eager op's too)."""
    query, k_cache, v_cache, start, accepted, k_extra, v_extra, visible = inputs
    eager = [k_cache.clone(), v_cache.clone()]
    out = Step()(query, *eager, start, accepted, k_extra, v_extra, visible)
    want = [k_cache.numpy().copy(), v_cache.numpy().copy()]
    tree_attention.reference_commit(*want, int(start[0]), accepted.tolist())
    tree_attention.reference_store(*want, 1, int(start[0]), k_extra.numpy(), v_extra.numpy(), STEP_STORE)
    assert all(np.array_equal(e.numpy(), w) for e, w in zip(eager, want))
    return out, want


@pytest.mark.skipif(importlib.util.find_spec("executorch") is None, reason="executorch not installed")
def test_executorch_commits_and_stores_into_the_hosts_own_cache_buffers(tmp_path):
    """A program lowered with host_inputs() (the builds' config) writes into the torch tensors passed as its
    cache inputs: no copy of the cache is made, in or out."""
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from streamfuse.export.to_executorch import host_inputs

    program = torch.export.export(Step(), step_inputs(0, *STEPS[0]), strict=False)
    (tmp_path / "step.pte").write_bytes(to_edge_transform_and_lower(program).to_executorch(host_inputs()).buffer)
    kernel_library.load_executorch_kernels()
    method = Runtime.get().load_program(tmp_path / "step.pte").load_method("forward")
    for seed, (start, accepted) in enumerate(STEPS):
        inputs = step_inputs(seed, start, accepted)
        out, want = step_expected(inputs)
        assert torch.equal(method.execute(list(inputs))[0], out), (start, accepted)
        assert all(np.array_equal(c.numpy(), w) for c, w in zip(inputs[1:3], want)), (start, accepted)


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is None, reason="onnxruntime not installed")
def test_onnxruntime_commits_and_stores_into_the_hosts_own_cache_buffers(tmp_path):
    """The exported step in an ONNX Runtime session writes into the numpy arrays passed as its cache inputs; a
    bad commit is the op's one-line error."""
    import onnxruntime as ort

    from streamfuse.export.to_onnx import custom_translations

    path = tmp_path / "step.onnx"
    program = torch.export.export(Step(), step_inputs(0, *STEPS[0]), strict=False)
    torch.onnx.export(program, (), dynamo=True, custom_translation_table=custom_translations(), verbose=False).save(
        str(path)
    )
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(kernel_library.onnxruntime_library_path()))
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    for seed, (start, accepted) in enumerate(STEPS):
        inputs = step_inputs(seed, start, accepted)
        out, want = step_expected(inputs)
        feeds = dict(zip(names, (t.numpy() for t in inputs)))
        (got,) = session.run(None, feeds)
        assert np.array_equal(got, out.numpy()), (start, accepted)
        assert all(np.array_equal(feeds[n], w) for n, w in zip(names[1:3], want)), (start, accepted)
    feeds[names[4]] = np.array([0, 3, 3, -1], dtype=np.int64)
    with pytest.raises(Exception, match=re.escape("commit_rows: accepted [0, 3, 3, -1]'s nodes must be strictly")):
        session.run(None, feeds)
