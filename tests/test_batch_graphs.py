"""The batched steps (batch_step_{B}x{T}): row b * T + t of one batched call equals sequence b's own step_T (decode
for T = 1) call bit for bit on ExecuTorch and ONNX Runtime, each sequence's cache after it equals its own call's
(pending commits, different lengths, a scratch sequence padding the batch), the manifest lists them, and the build's
parity refuses a batched graph that is not exact."""

import json
from pathlib import Path

import numpy as np
import pytest

from streamfuse.export import graph
from streamfuse.export.artifact_batch import batch_case, batch_parity, batched_call, check_batches, single_calls
from streamfuse.export.verify import ParityError
from streamfuse.runtime.artifact.contract import (
    GraphSpec,
    base_method,
    batch_inputs,
    batch_method,
    batch_shape,
    cache_of,
    input_names,
    method_names,
    output_names,
    parse_batches,
)
from streamfuse.runtime.artifact.format import Artifact, ArtifactError, parse_manifest
from streamfuse.runtime.backends.runners import open_runner
from streamfuse.runtime.speculation.tree import TreeSpec

from tiny_export import CONFIG, EXPORTED, manifest

BATCHES = parse_batches(CONFIG.batches)


def test_batched_step_names_and_inputs_follow_the_contract():
    method = batch_method(4, 8)
    assert method == "batch_step_4x8" and batch_shape(method) == (4, 8) and base_method(method) == "batch_step"
    assert batch_shape("step_8") is None and base_method("step_8") == "step"
    assert input_names("batch_step_2x4", True) == [
        *("ids", "cache_len", "tree", "depths", "keys_0", "values_0", "keys_1", "values_1", "commit")
    ]
    assert output_names("batch_step_2x4", True) == ["logits", "anchor", "hidden"]
    assert [cache_of(n) for n in ("keys", "values_3", "keys_x", "tree")] == ["keys", "values", None, None]
    assert method_names([4], batches=[(2, 1)])[-1] == "batch_step_2x1"
    assert parse_batches("4x4, 2x1;2x4,") == ((2, 1), (2, 4), (4, 4))
    with pytest.raises(ValueError, match="SEQUENCESxROWS"):
        parse_batches("4by4")


def test_batch_inputs_stack_each_sequences_tree_with_pad_rows():
    tree, depths = batch_inputs([TreeSpec.chain(2), TreeSpec(())], 4)
    assert tree.shape == (2, 4, 4) and depths.tolist() == [[0, 1, 2, -1], [0, -1, -1, -1]]
    assert np.array_equal(tree[1], np.eye(4)) and tree[0, 2, :3].tolist() == [1, 1, 1]


def test_graph_spec_picks_the_smallest_batch_that_holds_the_sequences():
    spec = GraphSpec(1, 1, 4, 10, 1, 64, 8, (4,), ("fused",), 9, batches=((2, 1), (4, 1), (2, 4)))
    assert spec.batch(3, 1) == (4, 1) and spec.batch(2, 4) == (2, 4)
    assert spec.batch(3, 4) is None and spec.batch(5, 1) is None


@pytest.mark.parametrize("pair", [(1, 4), (2, 3), (2, 16)])
def test_batches_must_hold_two_sequences_of_one_row_or_a_bucket(pair):
    with pytest.raises(ValueError, match="export.batches"):
        graph.GraphShapes(64, 8, (4, 15), batches=(pair,))


def open_engine(artifact, backend):
    opened = Artifact.open(artifact)
    return open_runner(backend, opened.backend_files(backend), threads=1), opened.graph_spec(backend)


@pytest.mark.parametrize("backend", EXPORTED)
def test_the_manifest_lists_the_batched_steps_and_parity_checked_them(artifact, backend):
    recorded = manifest(artifact)
    assert [tuple(pair) for pair in recorded["graphs"]["batches"]] == list(BATCHES)
    assert {batch_method(*pair) for pair in BATCHES} <= set(recorded["graphs"]["methods"])
    assert recorded["parity"][backend]["batches"] == {
        batch_method(*pair): {"outputs": True, "caches": True} for pair in BATCHES
    }
    assert open_engine(artifact, backend)[1].batches == BATCHES


@pytest.mark.parametrize("backend", EXPORTED)
@pytest.mark.parametrize("pair", BATCHES)
def test_each_row_and_cache_of_a_batched_call_equals_its_sequences_own_call(artifact, backend, pair):
    session, spec = open_engine(artifact, backend)
    case = batch_case(spec, *pair, seed=5)
    # the case is what the host sends: different lengths, a pending commit, a scratch sequence last
    assert len(set(case.cache_len.tolist())) == pair[0] and (case.commit[0] >= 0).sum() == 2
    assert case.trees[-1].num_nodes == 1 and (case.commit[-1] == -1).all()
    outputs, caches = batched_call(session, case)
    rows = pair[1]
    for index, (own, (keys, values)) in enumerate(single_calls(session, case)):
        for name, out, want in zip(("logits", "anchor", "hidden"), outputs, own):
            assert out.shape[0] == pair[0] * rows
            assert np.array_equal(out[index * rows : (index + 1) * rows], want), (name, index)
        assert np.array_equal(caches[index][0], keys) and np.array_equal(caches[index][1], values), index
        before = case.cache(index)[0]
        written = slice(max(0, int(case.cache_len[index]) - 2), int(case.cache_len[index]) + rows)
        assert not np.array_equal(keys[:, :, written], before[:, :, written])  # the call moved and wrote rows


class Mixing:
    """A batched graph that is not exact: the second sequence's rows of every output come out changed."""

    def __init__(self, session):
        self.session, self.name = session, session.name

    def run(self, method, inputs):
        outputs = [np.array(out, copy=True) for out in self.session.run(method, inputs)]
        shape = batch_shape(method)
        if shape is not None:
            outputs[0][shape[1] : 2 * shape[1]] += 1.0
        return outputs


@pytest.mark.parametrize("backend", EXPORTED)
def test_parity_refuses_a_batched_graph_whose_rows_differ(artifact, backend):
    session, spec = open_engine(artifact, backend)
    result = {"batches": batch_parity(Mixing(session), spec)}
    assert all(not checks["outputs"] and checks["caches"] for checks in result["batches"].values())
    with pytest.raises(ParityError, match=f"parity failed on {backend}: batch_step_.*outputs differ"):
        check_batches(backend, result)
    check_batches(backend, {"batches": batch_parity(session, spec)})  # the graphs themselves pass


@pytest.mark.parametrize("backend", EXPORTED)
def test_a_single_sequence_call_still_runs_beside_the_batched_graphs(artifact, backend):
    """The single-sequence methods take one cache: ONNX Runtime feeds it for the batched steps' cache inputs too
    (no placeholder cache of the capacity per sequence)."""
    session, spec = open_engine(artifact, backend)
    if backend == "onnxruntime":
        assert not any(cache_of(name) for name in session.placeholders)
    case = batch_case(spec, 2, 1, seed=1)
    (own, _), (other, _) = single_calls(session, case)
    assert own[0].shape == (1, spec.vocab_size) and not np.array_equal(own[0], other[0])


@pytest.mark.parametrize("batches", [[[1, 4]], [[2, 3]], [[2, 4], [4, 16]]])
def test_a_manifest_batch_of_one_sequence_or_of_no_bucket_is_refused_naming_it(batches):
    seed = json.loads((Path(__file__).parent / "fuzz" / "manifest" / "seeds" / "tiny_onnx.json").read_text())
    seed["graphs"]["batches"] = batches
    with pytest.raises(ArtifactError, match=rf"graphs\.batches\[{len(batches) - 1}\] must be \[2 or more sequences"):
        parse_manifest(json.dumps(seed).encode(), Path("manifest.json"))
    seed["graphs"]["batches"] = [[2, 1], [8, seed["graphs"]["buckets"][0]]]
    parse_manifest(json.dumps(seed).encode(), Path("manifest.json"))
