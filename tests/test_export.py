"""Export to ExecuTorch / ONNX / Core ML on a tiny model: the artifact's files and manifest, the build's parity,
resumption and refusal, bad artifacts named."""

import dataclasses
import json
import re

import pytest

from streamfuse.export.artifact import ArtifactBuilder, ExportConfig, start_lowering
from streamfuse.export.draft_vocab import DraftVocab
from streamfuse.runtime.artifact.contract import method_names, parse_batches
from streamfuse.runtime.artifact.format import SCHEMA, Artifact, ArtifactError, file_digest
from streamfuse.runtime.backends.base import CapacityError
from streamfuse.runtime.backends.runners import MissingBackend
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.loader import load
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.tree import TreeSpec

from tiny_export import CONFIG, DRAFT, TREES, Biased, copy_of, manifest, needs, prompts


def test_export_workers_do_not_change_the_artifact_key():
    assert CONFIG.key("t", "w", DRAFT) == ExportConfig(**{**CONFIG.__dict__, "workers": 1}).key("t", "w", DRAFT)
    assert CONFIG.key("t", "w", DRAFT) != CONFIG.key("t", "other weights", DRAFT)
    with_heads = CONFIG.key("t", "w", DRAFT, "heads-1")  # Medusa heads (their training key) are in the graphs
    assert with_heads not in (CONFIG.key("t", "w", DRAFT), CONFIG.key("t", "w", DRAFT, "heads-2"))
    assert CONFIG.key("t", "w", DRAFT, head=DraftVocab((1, 2), 1.0)) != CONFIG.key("t", "w", DRAFT)  # a pruned head
    with pytest.raises(ValueError, match="export.workers must be >= 1"):
        ExportConfig(workers=0).validate()


@needs("executorch", "onnxruntime")
def test_build_records_parity_for_backends_that_run_here(artifact):
    parity = manifest(artifact)["parity"]
    assert set(parity) == {"executorch", "onnxruntime"}
    for result in parity.values():
        assert result["ss_equals_torch_eager"] == result["prompts"] == 4
        assert result["ss_equals_own_plain"] == result["plain_prompts"]
        assert result["within_tolerance"], result["max_abs_diff"]
        # the engine's cache after each call (the rows it wrote and moved) against the reference's
        assert set(result["max_abs_diff"]) >= {
            "step_15.logits",
            "streams.stream_logits",
            "prefill.keys",
            "greedy_step_15.drafts",
            "greedy_step_15.values",
        }
        assert result["tolerance"]["greedy_step_15.targets"] == 0.0  # token ids must be equal
        # the other tree, and the chain filling the largest bucket (deeper than the streams: the draft methods')
        assert result["other_trees"] == {
            "prompts": 4,
            "ss_equals_own_plain": {TREES[1].hash(): 4, TreeSpec.chain(14).hash(): 4},
        }
        assert result["medusa"]["medusa_equals_own_plain"] == result["medusa"]["prompts"] == 4
        assert "heads.head_logits" in result["max_abs_diff"]


@needs("executorch", "onnxruntime")
def test_manifest_describes_the_graphs(artifact):
    data = manifest(artifact)
    assert data["schema"] == SCHEMA
    assert [tree["hash"] for tree in data["trees"]] == [tree.hash() for tree in TREES]
    assert data["calibration"] == {"acceptance": None, "backends": {}}  # the builder was given no acceptance model
    assert data["kv_layout"]["shape"] == [4, data["model"]["num_kv_heads"], 128, data["model"]["head_dim"]]
    assert list(data["graphs"]["methods"]) == method_names(
        (4, 15), heads=True, batches=parse_batches(CONFIG.batches)
    ) and data["graphs"]["buckets"] == [4, 15]
    assert data["graphs"]["methods"]["step_4"]["inputs"][0]["shape"] == [1, 4]
    step = data["graphs"]["methods"]["step_15"]
    assert step["inputs"][:4] == [
        {"name": "ids", "shape": [1, 15], "dtype": "int64"},
        {"name": "cache_len", "shape": [1], "dtype": "int64"},
        {"name": "tree", "shape": [15, 15], "dtype": "float32"},
        {"name": "depths", "shape": [15], "dtype": "int64"},
    ]
    assert step["inputs"][-1] == {"name": "commit", "shape": [15], "dtype": "int64"}  # the engine keeps the cache
    assert [o["name"] for o in step["outputs"]] == ["logits", "anchor", "hidden"]  # so no rows come out
    assert data["kv_layout"]["owner"] == {
        "executorch": "engine",
        "onnxruntime": "engine",
        "coreml": "host",
        "executorch_coreml": "host",
    }
    assert step["outputs"][0]["shape"] == [15, data["model"]["vocab_size"]]
    assert data["graphs"]["methods"]["streams"]["outputs"][0]["shape"] == [3, data["model"]["vocab_size"]]
    greedy = {o["name"]: o for o in data["graphs"]["methods"]["greedy_step_15"]["outputs"]}
    assert greedy["targets"]["shape"] == [15] and greedy["accepted"]["shape"] == [1]
    assert greedy["drafts"] == {"name": "drafts", "shape": [3, 14], "dtype": "int64"}  # any tree of 15 nodes
    assert data["graphs"]["greedy_step"] == {
        "schedules": ["fused", "fused"],
        "width": 14,
        "draft_vocab": {
            "path": "draft_vocab.safetensors",
            "size": 60,
            "coverage": 0.5,
            **file_digest(artifact / "draft_vocab.safetensors"),
        },
    }
    # every file of the tokenizer folder, hashed: each changes how text becomes ids
    assert set(data["tokenizer"]["files"]) == {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    assert data["graphs"]["heads"] == {"count": 2, "training_key": "test-heads"}
    assert data["graphs"]["methods"]["heads"]["outputs"][0]["shape"] == [2, data["model"]["vocab_size"]]
    assert {"torch", "executorch", "onnx"} <= set(data["versions"])


@needs("executorch")
def test_executorch_methods_read_the_hosts_buffers_and_share_one_packed_copy(artifact):
    """No input is planned into the program's arena (the KV cache would be copied in every call),
    and the session loads the methods with XNNPACK's weight cache on."""
    from executorch.runtime import Runtime

    from streamfuse.runtime.backends.runners import ExecuTorchRunner

    pte = artifact / manifest(artifact)["files"]["executorch"]["program"]["path"]
    program = Runtime.get().load_program(pte)
    for name in program.method_names:
        meta = program.metadata(name)
        planned = [meta.input_tensor_meta(i).is_memory_planned() for i in range(meta.num_inputs())]
        assert planned and not any(planned), (name, planned)
    assert ExecuTorchRunner(pte, threads=1).shares_weights


@needs("coreml")
def test_coreml_package_has_a_function_per_method_with_static_shapes(artifact):
    from streamfuse.export.to_coreml import spec_signature
    from streamfuse.runtime.artifact.contract import input_names, output_names

    data = manifest(artifact)
    spec = spec_signature(artifact / data["files"]["coreml"]["package"]["path"])
    assert set(spec) == set(method_names((4, 15), heads=True))
    assert data["kv_layout"]["owner"]["coreml"] == "host"  # no commit input; a call's rows come out
    for method in spec:  # the span graphs' signatures (the batched steps are the engine-cache graphs' only)
        inputs = {i["name"]: i for i in data["graphs"]["methods"][method]["inputs"]}
        want = [
            (name, inputs[name]["shape"], "int32" if inputs[name]["dtype"] == "int64" else "float32")
            for name in input_names(method, engine_cache=False)
        ]
        assert spec[method]["inputs"] == want
        assert spec[method]["outputs"] == output_names(method, engine_cache=False)


@needs("executorch_coreml")
def test_coreml_delegate_pte_lowers_to_a_program_with_every_method(artifact):
    """The Core ML-delegated .pte: built here, run in an app on the device (no such runtime here)."""
    from executorch.exir._serialize import _deserialize_pte_binary

    variant = "executorch_coreml"
    data = manifest(artifact)
    assert variant not in data["parity"]
    pte = artifact / data["files"][variant]["program"]["path"]
    program = _deserialize_pte_binary(pte.read_bytes()).program
    plans = {plan.name: plan for plan in program.execution_plan}
    assert set(plans) == set(method_names((4, 15), heads=True))
    delegate_ids = {d.id for plan in plans.values() for d in plan.delegates}
    assert delegate_ids == {"CoreMLBackend"}


@needs("onnxruntime")
def test_onnx_model_holds_every_method_over_one_copy_of_the_weights(artifact):
    """One model: an If per method side by side at the top (a nested If's branch would not find the
    top graph's weights to prepack), every weight an initializer of the top graph, each tensor once."""
    import onnx
    from onnx import numpy_helper

    from streamfuse.runtime.artifact.contract import METHOD_INPUT, method_output, output_names

    folder = artifact / "onnx"
    assert sorted(p.name for p in folder.iterdir()) == ["model.onnx", "weights.bin"]
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    methods = method_names((4, 15), heads=True, batches=parse_batches(CONFIG.batches))
    assert [n.name for n in model.graph.node if n.op_type == "If"] == methods
    assert METHOD_INPUT in [i.name for i in model.graph.input]
    assert [o.name for o in model.graph.output] == [
        method_output(m, n) for m in methods for n in output_names(m, engine_cache=True)
    ]
    for node in model.graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                assert not attribute.g.initializer and not attribute.g.value_info, node.name
                assert not [n for n in attribute.g.node if n.op_type == "If" or n.metadata_props], node.name
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert {e.value for t in external for e in t.external_data if e.key == "location"} == {"weights.bin"}
    onnx.load_external_data_for_model(model, str(folder))
    arrays = [numpy_helper.to_array(t) for t in model.graph.initializer if t.name in {e.name for e in external}]
    contents = {(a.dtype.str, a.shape, a.tobytes()) for a in arrays}
    assert len(contents) == len(arrays)  # no tensor twice
    stored = sum(a.nbytes for a in arrays)
    assert stored <= (folder / "weights.bin").stat().st_size < stored + 4096 * len(arrays)


@needs("executorch", "onnxruntime")
def test_truncated_or_corrupted_model_file_is_named(artifact, tmp_path):
    broken = copy_of(artifact, tmp_path)
    pte = broken / "model.pte"
    pte.write_bytes(pte.read_bytes()[:-100])
    with pytest.raises(ArtifactError, match="model.pte has .* bytes.*truncated"):
        load(broken, "executorch")
    weights = broken / "onnx" / "weights.bin"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="weights.bin does not match its sha256"):
        load(broken, "onnxruntime")


@needs("onnxruntime")
def test_medusa_heads_added_after_the_export_are_refused_on_its_graphs(artifact, tmp_path):
    broken = copy_of(artifact, tmp_path)
    data = manifest(broken)
    data["drafters"]["medusa"]["training_key"] = "retrained-heads"  # heads newer than the graphs' heads method
    (broken / "manifest.json").write_text(json.dumps(data))
    loaded = load(broken, "onnxruntime")
    with pytest.raises(ValueError, match="have no heads method for its Medusa heads .* --set medusa.enabled=true"):
        loaded.drafter(DecodeSettings("medusa", StopRules(8), tree=loaded.method_tree("medusa")))


@needs("onnxruntime")
def test_other_schema_and_foreign_tokenizer_are_rejected(artifact, checkpoint, tmp_path):
    broken = copy_of(artifact, tmp_path)
    data = manifest(broken)
    data["schema"] = "streamfuse.artifact/1"  # an artifact of the previous format
    (broken / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="schema 'streamfuse.artifact/1'.*rebuild"):
        load(broken, "onnxruntime")
    data["schema"] = SCHEMA
    (broken / "manifest.json").write_text(json.dumps(data))
    tokenizer = json.loads((broken / "tokenizer" / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]  # another tokenizer of the same size: two words swap ids
    first, second = list(vocab)[5:7]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (broken / "tokenizer" / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ArtifactError, match="tokenizer.json differs"):
        load(broken, "onnxruntime")


@needs("onnxruntime", "coreml")
def test_runs_the_artifact_cannot_serve_fail_clearly(artifact, checkpoint):
    loaded = load(artifact, "onnxruntime")
    # Any tree of up to 15 nodes runs in a bucket; one of 21 nodes fits none.
    with pytest.raises(
        ValueError, match="a tree of 21 nodes is larger than the artifact's largest step graph \\(15 rows"
    ):
        generate(loaded.backend, [5, 6, 7], DecodeSettings("ss", StopRules(8), tree=TreeSpec.parse("gamma=2,k=4")))
    with pytest.raises(ValueError, match="exceeds the model's context of 128 positions"):
        generate(loaded.backend, [5] * 100, DecodeSettings("ss", StopRules(20), tree=loaded.tree))
    with pytest.raises(CapacityError, match="capacity 128; lower max_new_tokens"):
        loaded.backend.reset(129)
    with pytest.raises(MissingBackend, match="macOS only"):
        load(artifact, "coreml")
    with pytest.raises(ValueError, match="only the torch backend runs"):
        load(checkpoint / "ckpt", "executorch")


@needs("onnxruntime", "coreml", "executorch_coreml")
def test_interrupted_export_leaves_nothing_loadable_and_resumes(checkpoint, tmp_path, monkeypatch, capsys):
    out = tmp_path / "artifact"
    config = ExportConfig(
        backends=("torch", "onnxruntime", "coreml"), buckets=(4,), capacity=128, prefill_chunk=16, parity_prompts=2
    )
    original = ArtifactBuilder._export

    def crash_on_coreml(self, backend):
        if backend == "coreml":  # killed: what a process killed for memory leaves, no cleanup run
            (self.staging / "coreml-killed" / "decode.mlpackage").mkdir(parents=True)
            (self.staging / "model.tmp").write_bytes(b"half a program")
            raise KeyboardInterrupt("interrupted")
        return original(self, backend)

    monkeypatch.setattr(ArtifactBuilder, "_export", crash_on_coreml)
    with pytest.raises(KeyboardInterrupt):
        ArtifactBuilder(checkpoint / "ckpt", out, config, prompts(2), 16, {}).build()
    assert not out.exists()
    with pytest.raises(FileNotFoundError):
        load(out, "onnxruntime")
    monkeypatch.setattr(ArtifactBuilder, "_export", original)
    capsys.readouterr()
    ArtifactBuilder(checkpoint / "ckpt", out, config, prompts(2), 16, {}).build()
    printed = capsys.readouterr().out
    # Parity runs once every export is in, so the interrupted build never reached it.
    assert "[export] onnxruntime: done earlier, reusing" in printed and "[export] parity-onnxruntime-" in printed
    assert not re.search(r"parity-onnxruntime-\w+: done earlier", printed)
    assert set(Artifact.open(out).manifest["files"]) == {"onnxruntime", "coreml"}
    assert not list(tmp_path.glob(".artifact.partial-*"))
    assert not list(out.glob("coreml-*")) and not list(out.glob("*.tmp"))

    # Asking for one more backend exports only that one and keeps the others.
    more = ExportConfig(
        backends=("torch", "onnxruntime", "executorch_coreml"),
        buckets=(4,),
        capacity=128,
        prefill_chunk=16,
        parity_prompts=2,
    )
    ArtifactBuilder(checkpoint / "ckpt", out, more, prompts(2), 16, {}).build()
    printed = capsys.readouterr().out
    assert "onnxruntime: done earlier" in printed and "coreml: done earlier" in printed
    assert "[export] executorch_coreml:" in printed
    assert set(Artifact.open(out).manifest["files"]) == {"onnxruntime", "coreml", "executorch_coreml"}
    assert load(out, "onnxruntime").backend.name.startswith("onnxruntime")


@needs("onnxruntime")
def test_files_lowered_before_calibration_chose_the_trees_are_the_builds(checkpoint, tmp_path, monkeypatch, capsys):
    out = tmp_path / "artifact"
    early = ExportConfig(
        backends=("torch", "onnxruntime"),
        trees=("gamma=1,k=1",),
        buckets=(4,),
        capacity=128,
        prefill_chunk=16,
        parity_prompts=2,
    )
    arguments = (checkpoint / "ckpt", out, early, prompts(2), 16, {}, None, (), None)
    pending = start_lowering(arguments, ["onnxruntime"])  # a worker process lowers; the build calibrates meanwhile
    assert set(pending) == {"onnxruntime"}

    def exported_twice(self, backend):
        raise AssertionError(f"{backend} exported again")

    monkeypatch.setattr(ArtifactBuilder, "_export", exported_twice)
    chosen = dataclasses.replace(early, trees=("gamma=3,k=1",))
    built = ArtifactBuilder(checkpoint / "ckpt", out, chosen, prompts(2), 16, {}, pending=pending).build()
    assert [TreeSpec.from_dict(tree) for tree in built["trees"]] == [TreeSpec.chain(3)]
    assert built["parity"]["onnxruntime"]["ss_equals_own_plain"] == 2 and set(built["files"]) == {"onnxruntime"}
    # Another tree later: the finished files are lent, nothing lowers again, parity runs for the new trees.
    assert start_lowering((*arguments[:2], chosen, *arguments[3:]), ["onnxruntime"]) == {}
    capsys.readouterr()
    other = dataclasses.replace(early, trees=("gamma=2,k=1",))
    rebuilt = ArtifactBuilder(checkpoint / "ckpt", out, other, prompts(2), 16, {}).build()
    printed = capsys.readouterr().out
    assert "[export] onnxruntime: done earlier, reusing" in printed
    assert not re.search(r"parity-onnxruntime-\w+: done earlier", printed)
    assert rebuilt["files"] == built["files"] and rebuilt["build_key"] != built["build_key"]
    assert not list(tmp_path.glob(".artifact.partial-*"))


@needs("onnxruntime")
def test_a_build_whose_parity_fails_is_refused_and_the_installed_artifact_stays(
    artifact, checkpoint, tmp_path, monkeypatch
):
    from streamfuse.export.verify import ParityError
    from streamfuse.runtime.backends import runners

    out = copy_of(artifact, tmp_path)  # the installed artifact
    installed = (out / "manifest.json").read_bytes()
    real = runners.open_runner
    monkeypatch.setattr(runners, "open_runner", lambda *args, **kwargs: Biased(real(*args, **kwargs)))
    other = ExportConfig(backends=("torch", "onnxruntime"), capacity=128, prefill_chunk=16, parity_prompts=3)
    with pytest.raises(
        ParityError,
        match=r"^parity failed on onnxruntime: SS vs its own plain decoding differs on "
        r"dialogue_a from generated token \d+ \(\d+ mismatches in all\); the "
        r"artifact was not",
    ):
        ArtifactBuilder(
            checkpoint / "ckpt", out, other, prompts(3), 16, {}, prompt_names=["dialogue_a", "dialogue_b", "dialogue_c"]
        ).build()
    assert (out / "manifest.json").read_bytes() == installed  # the earlier artifact, untouched
    assert not list(tmp_path.glob(f".{out.name}.partial-*"))  # nothing half-written left
    assert load(out, "onnxruntime").backend.name.startswith("onnxruntime")
