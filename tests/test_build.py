"""export/build.py end to end on a tiny base model and tiny DialogSum-format data."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from streamfuse.adapters.checkpoint import weights_digest
from streamfuse.runtime.backends.base import process_peak_rss_bytes
from streamfuse.runtime.calibration import AcceptanceModel
from streamfuse.runtime.tree import TreeSpec
from streamfuse.training import build, distill, pipeline, stages

from conftest import write_tiny_dialogsum


def run_build(base, data, work, *extra):
    return build.main(["--task", "dialogsum", "--preset", "smoke", "--base-model", str(base),
                       "--data-dir", str(data), "--work-dir", str(work), *extra])


def test_build_trains_evaluates_exports_and_reuses(tiny_base_dir, tmp_path, capsys, monkeypatch):
    data = write_tiny_dialogsum(tmp_path / "data")
    # The tiny model never stops by itself; end every other answer early so the distillation stage
    # has finished answers to train on and its filter (unfinished answers are dropped) is exercised.
    real_answers = distill.greedy_answer_ids

    def half_finished(model, tokenizer, prompts, *args, **kwargs):
        answers = real_answers(model, tokenizer, prompts, *args, **kwargs)
        return [a[:3] + [tokenizer.eos_token_id] if i % 2 == 0 else a for i, a in enumerate(answers)]

    monkeypatch.setattr(distill, "greedy_answer_ids", half_finished)
    # Frozen (the cpu recipe): only the streams, with a per-stream f_eta, train in the second stage,
    # on the own answers and the references.
    export = ["--backends", "torch,onnxruntime", "--out", str(tmp_path / "artifact")] + [f"--set={a}" for a in (
        "distill.enabled=true", "distill.main_targets=frozen", "distill.init_rank=4", "distill.with_references=true",
        "distill.unlabelled=true", "export.capacity=256", "export.parity_prompts=3", "stages.profile_limit=2",
        "export.draft_vocab=40")]
    assert run_build(tiny_base_dir, data, tmp_path / "work", *export) == 0
    run_dir = tmp_path / "work" / "dialogsum-smoke"
    summary = json.loads((run_dir / "ss" / "eval.json").read_text())
    assert set(summary["quality"]) == {"ss", "lora_baseline", "zero_shot"}
    assert set(summary["quality"]["ss"]) == {"rouge1", "rouge2", "rougeL", "rougeLsum"}
    assert set(summary["stream_accuracy"]) == {"main", "pruning_head", "stream_1", "stream_2", "stream_3"}
    # The SS model is the self-distilled second stage; against its own greedy answers, the main
    # stream's teacher-forced argmax is those answers (a rounding tie could differ, hence not 100).
    assert set(summary["training"]) == {"ss", "ss_first_stage", "lora_baseline"}
    assert summary["stream_accuracy_own"]["main"]["top1"] >= 90.0
    first = json.loads((run_dir / "ss_stage1" / "streamfuse.json").read_text())["info"]
    first_ss_key = json.loads((run_dir / "ss" / "streamfuse.json").read_text())["info"]["training_key"]
    assert json.loads((run_dir / "ss" / "streamfuse.json").read_text())["info"]["first_stage"]["training_key"] == first["training_key"]
    own_answers = run_dir / "distill" / f"{stages.model_key(run_dir / 'ss_stage1')}-train.jsonl"
    assert len(own_answers.read_text().splitlines()) == 16
    unlabelled = own_answers.with_name(own_answers.name.replace("-train.jsonl", "-unlabelled.jsonl"))
    assert len(unlabelled.read_text().splitlines()) == 4  # the dialogues without references
    assert summary["test_examples"] == 6 and len(summary["bars"]) == 3
    # identifiers 3 x 32, f_eta down 32 x (3 * 4) and up 3 x 4 x 32, pruning head 2 x 32 x 8
    assert summary["extra_parameters"]["total"] == 3 * 32 + 2 * 3 * 4 * 32 + 2 * 32 * 8
    lora = [load_file(str(run_dir / stage / "lora" / "adapter_model.safetensors")) for stage in ("ss_stage1", "ss")]
    assert lora[0].keys() == lora[1].keys() and all(torch.equal(lora[0][k], lora[1][k]) for k in lora[0])
    assert not list(run_dir.glob("*.snapshot")), "snapshots are removed once a checkpoint is saved"
    assert not list(run_dir.glob(".*.partial-*")) and not list(run_dir.glob(".*.old")), "stages' staging folders"
    manifest = json.loads((run_dir / "ss" / "streamfuse.json").read_text())
    assert manifest["info"]["prompt"]["source_template"] == "{dialogue}"  # the runtime formats inputs from it
    out = capsys.readouterr().out
    assert "on 10 of 20 own answers (the rest did not finish) and 16 references" in out
    assert "| Speculative Streaming |" in out and "stream-1 top-1" in out
    # lowered in a worker from the end of training, before calibration chose the trees
    assert out.index("[export] lowering onnxruntime in a worker process") < out.index("[calibrate]")
    artifact = json.loads((tmp_path / "artifact" / "manifest.json").read_text())
    assert set(artifact["files"]) == {"onnxruntime"} and artifact["parity"]["onnxruntime"]["ss_equals_torch_eager"] == 3
    greedy = artifact["graphs"]["greedy_step"]
    # Calibrated: the acceptance model from validation answers, the best tree of each size timed on torch here;
    # the artifact's trees are its choice among those the largest bucket (8 rows) holds, then the tree of up to
    # 8 nodes with most expected tokens, then the best 4-node tree where the acceptance model reaches one (fp32:
    # no 2-node tree).
    calibration = artifact["calibration"]
    assert calibration["acceptance"]["positions"] > 0 and calibration["acceptance"]["depth"] == 3
    assert set(calibration["backends"]) == {"torch", "onnxruntime"}
    trees = [TreeSpec.from_dict(tree) for tree in artifact["trees"]]
    torch_costs = [row for row in calibration["backends"]["torch"]["trees"] if row["tree"]["num_nodes"] <= 8]
    assert trees[0].hash() == max(torch_costs, key=lambda row: row["expected_speedup"])["tree"]["hash"]
    acceptance = AcceptanceModel.from_dict(calibration["acceptance"])
    wide = [t for n, t in acceptance.best_trees().items() if n <= 8]
    best_wide, cheap = max(wide, key=acceptance.expected_tokens), acceptance.best_trees().get(4)
    expected = [trees[0]] + [t for t in (best_wide, cheap) if t is not None and t != trees[0]]
    assert trees == list(dict.fromkeys(expected)) and len(trees) <= 3
    assert len(calibration["backends"]["torch"]["trees"]) >= 2  # every size the acceptance model reaches
    # ONNX Runtime times one tree per bucket: the most expected tokens among the sizes each holds
    onnx_trees = calibration["backends"]["onnxruntime"]["trees"]
    best = acceptance.best_trees(8)
    per_bucket = [max((t for n, t in best.items() if low < n <= high), key=acceptance.expected_tokens)
                  for low, high in ((0, 4), (4, 8)) if any(low < n <= high for n in best)]
    assert [row["tree"]["hash"] for row in onnx_trees] == [tree.hash() for tree in per_bucket]
    assert all(row["step_ms"] > 0 and row["expected_tokens"] >= 1 and row["realised_tokens"] >= 1 for row in onnx_trees)
    assert artifact["graphs"]["buckets"] == [4, 8] and greedy["schedules"] == ["fused", "deferred"]
    assert greedy["draft_vocab"]["size"] == 40
    assert "## Calibration: the draft tree per backend on this machine" in out
    assert 0.3 < greedy["draft_vocab"]["coverage"] <= 1.0 and "draft vocabulary: 40 tokens" in out
    assert artifact["profile"]["bench"]["inputs"] == 2 and artifact["profile"]["bench"]["parity_mismatches"] == 0
    # Profiled in a fresh process: its peak is the runtime's, below this process's (which trained and exported).
    assert 0 < artifact["profile"]["profile"]["peak_memory_bytes"] < process_peak_rss_bytes()
    assert "| onnxruntime |" in out and "call reduction CR" in out
    assert not list(tmp_path.glob(".artifact.partial-*")), "the staging folder is renamed into place"

    # A rerun with the same settings trains, evaluates, exports and profiles nothing.
    assert run_build(tiny_base_dir, data, tmp_path / "work", *export) == 0
    out = capsys.readouterr().out
    assert out.count("[train] reusing") == 2 and out.count("[distil] reusing") == 1 and out.count("[eval] reusing") == 5  # + acceptance, torch calibration
    assert "[export] reusing" in out and "[profile] reusing" in out and "reusing onnxruntime's calibration" in out
    assert "in a worker process" not in out

    # Methods sd, medusa and specdec++ added to the built artifact: SS's stages are reused; the draft model
    # (the base's first 2 layers) and 2 Medusa heads train on the SS model's own answers, the acceptance head
    # on the draft model's states over them, and all land in drafters/. The graphs are exported again with
    # the heads method; the chains sd and specdec++ verify (3 and 2..4 drafts) fit the 8-row bucket.
    with_sd = [*export, "--set=sd.enabled=true", "--set=sd.layers=2", "--set=sd.gamma=3", "--set=sd.epochs=2", "--set=sd.vocab=40",
               "--set=medusa.enabled=true", "--set=medusa.heads=2", "--set=medusa.batch=16",
               "--set=specdec.enabled=true", "--set=specdec.max_drafts=4", "--set=specdec.batch=16",
               "--set=adaptive.enabled=true", "--set=adaptive.batch=16",
               "--set=parallelspec.enabled=true", "--set=parallelspec.masks=1", "--set=parallelspec.vocab=40",
               "--set=parallelspec.epochs=1", "--set=parallelspec.capacity=32", "--set=parallelspec.tree=2-1",
               "--set=falcon.enabled=true", "--set=falcon.vocab=40", "--set=falcon.epochs=1", "--set=falcon.capacity=32",
               "--set=falcon.tree=2-1-1", "--set=falcon.max_passes=2"]
    assert run_build(tiny_base_dir, data, tmp_path / "work", *with_sd) == 0
    out = capsys.readouterr().out
    assert "[export] reusing" not in out and out.count("[train] reusing") == 2
    rebuilt = json.loads((tmp_path / "artifact" / "manifest.json").read_text())  # ss-adaptive adds cheap trees
    assert [TreeSpec.from_dict(t) for t in rebuilt["trees"]][: len(trees)] == trees
    assert rebuilt["graphs"]["buckets"] == [4, 8]
    assert "[sd] draft model added to" in out and "[medusa] heads added to" in out
    assert "[specdec++] acceptance head added to" in out and "[ss-adaptive] acceptance head added to" in out
    assert "[parallelspec] drafter added to" in out and "parallelspec head vocabulary: 40 tokens" in out
    assert "[falcon] drafter added to" in out and "falcon head vocabulary: 40 tokens" in out
    own_answers = run_dir / "distill" / f"{stages.model_key(run_dir / 'ss')}-train.jsonl"
    assert len(own_answers.read_text().splitlines()) == 16  # the target's, beside its first stage's
    assert json.loads((run_dir / "sd" / "streamfuse.json").read_text())["base_layers"] == 2
    drafters = json.loads((tmp_path / "artifact" / "manifest.json").read_text())["drafters"]
    assert (drafters["sd"]["layers"], drafters["sd"]["path"], drafters["medusa"]["heads"]) == (2, "drafters/sd", 2)
    assert (drafters["specdec++"]["draft"], drafters["specdec++"]["threshold"]) == ("sd", 0.5)
    parallel = drafters["parallelspec"]  # its pass exported for the artifact's engine, parity checked
    assert (parallel["masks"], parallel["vocab"], parallel["capacity"]) == (1, 40, 32)
    assert set(parallel["graphs"]) == {"onnxruntime"} and parallel["parity"]["onnxruntime"] <= 1e-4
    falcon = drafters["falcon"]  # k = 2, scratch for 2 passes past its 32 rows
    assert (falcon["block"], falcon["vocab"], falcon["slots"], falcon["max_passes"]) == (2, 40, 34, 2)
    assert set(falcon["graphs"]) == {"onnxruntime"} and falcon["parity"]["onnxruntime"] <= 1e-4
    from streamfuse.runtime.decode import generate
    from streamfuse.runtime.emitter import StopRules
    from streamfuse.runtime.loader import load
    from streamfuse.runtime.settings import DecodeSettings

    loaded = load(tmp_path / "artifact", "torch")
    assert loaded.methods == ("ar", "ss", "sd", "medusa", "specdec++", "ss-adaptive", "pearl", "parallelspec", "falcon")
    assert loaded.method_tree("sd") == TreeSpec.chain(3)
    assert loaded.method_tree("specdec++") == TreeSpec.chain(4)
    assert loaded.method_tree("medusa").depth <= 2 and set(loaded.method_tree("medusa").paths) <= set(trees[0].paths)
    assert loaded.method_tree("parallelspec").paths == ((0,), (1,), (0, 0))
    assert loaded.method_tree("falcon").paths == ((0,), (1,), (0, 0), (0, 0, 0))
    rules = StopRules(12, loaded.stop_token_ids)
    with pytest.raises(ValueError, match="has no calibration for torch: run python -m streamfuse.tools.calibrate"):
        dataclasses.replace(loaded, calibration=None, resources={}).tree_choice()
    for method in ("sd", "medusa", "specdec++", "ss-adaptive", "pearl", "parallelspec", "falcon"):
        settings = DecodeSettings(method, rules, tree=loaded.method_tree(method))
        for prompt in ([5, 9, 14, 3], [7, 7, 21]):
            result = generate(loaded.backend, prompt, settings, drafter=loaded.drafter(settings))
            assert result.token_ids == generate(loaded.backend, prompt, DecodeSettings("ar", rules)).token_ids
            assert (result.run.draft_calls > 0) == (method in ("sd", "specdec++", "pearl", "parallelspec", "falcon"))
    assert run_build(tiny_base_dir, data, tmp_path / "work", *with_sd) == 0
    out = capsys.readouterr().out
    assert "[sd] reusing" in out and "[medusa] reusing" in out and "[specdec++] reusing" in out
    assert "[ss-adaptive] reusing" in out and "[parallelspec] reusing the drafter's graphs" in out
    assert out.count("[falcon] reusing") == 2 and "[falcon] reusing the drafter's graphs" in out  # stage, graphs
    assert "[export] reusing" in out
    # The draft-model methods on the exported target (ONNX Runtime): chains of every length, plain's tokens;
    # Medusa through the graphs' heads method.
    exported_target = load(tmp_path / "artifact", "onnxruntime")
    assert json.loads((tmp_path / "artifact" / "manifest.json").read_text())["graphs"]["heads"]["count"] == 2
    for method, threshold in (("sd", None), ("specdec++", 0.5), ("specdec++", 1.0), ("medusa", None),
                              ("ss-adaptive", None), ("pearl", None), ("parallelspec", None), ("falcon", None)):
        settings = DecodeSettings(method, rules, tree=exported_target.method_tree(method), threshold=threshold)
        exported_target.check_method_tree(method, settings.tree)
        for prompt in ([5, 9, 14, 3], [7, 7, 21]):
            result = generate(exported_target.backend, prompt, settings, drafter=exported_target.drafter(settings))
            plain = generate(exported_target.backend, prompt, DecodeSettings("ar", rules))
            assert result.token_ids == plain.token_ids
    # sd's draft model was exported too (its own artifact in drafters/sd, parity checked); specdec++ drives
    # it there as well, its head on the final states the draft's graphs return.
    assert {key for key in exported_target.resources if key.startswith("sd:")} == {"sd:onnxruntime"}
    assert exported_target.resources["pearl:onnxruntime"].name.startswith("onnxruntime")  # PEARL's worker too
    assert exported_target.resources["sd:onnxruntime"].name.startswith("onnxruntime")
    assert len(exported_target.resources["parallelspec:onnxruntime"].vocab_ids) == 40  # its graph, not torch
    assert exported_target.resources["falcon:onnxruntime"].slots == 34
    draft_parity = json.loads((tmp_path / "artifact" / "drafters" / "sd" / "manifest.json").read_text())["parity"]["onnxruntime"]
    assert draft_parity["ss_equals_own_plain"] == draft_parity["plain_prompts"] > 0
    # Its LM head keeps the 40 tokens the SS model's answers use most, on every engine it runs on.
    head = json.loads((tmp_path / "artifact" / "drafters" / "sd" / "manifest.json").read_text())["model"]["head_vocab"]
    assert head["size"] == 40 and 0.3 < head["coverage"] <= 1.0 and "draft head vocabulary: 40 tokens" in out
    assert len(exported_target.resources["sd:onnxruntime"].spec.head_ids) == 40
    assert len(loaded.resources["sd:torch"].spec.head_ids) == 40
    # One bench table for every method: SD's draft calls beside SS's none, both equal to plain decoding.
    from streamfuse.tools import bench

    assert bench.main(["--artifact", str(tmp_path / "artifact"), "--task", "dialogsum", "--input-file",
                       str(data / "dialogsum.test.jsonl"), "--limit", "2", "--warmup", "0", "--max-new-tokens", "8",
                       "--threads", "1", "--backends", "torch",
                       "--methods", "ar,ss,sd,medusa,specdec++,sd:2,specdec++:1,ss-adaptive,parallelspec,falcon:1-1",
                       "--out",
                       str(tmp_path / "bench")]) == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "bench" / "bench.json").read_text())["table"]}
    assert rows["sd/torch"]["mismatches"] == rows["ss/torch"]["mismatches"] == rows["medusa/torch"]["mismatches"] == 0
    assert rows["sd/torch"]["draft_calls"] > 0 and rows["ss/torch"]["draft_calls"] == rows["ar/torch"]["draft_calls"] == 0
    assert rows["sd/torch"]["draft_ms_per_step"] > 0 and rows["ar/torch"]["draft_ms_per_step"] is None
    assert rows["specdec++/torch"]["mismatches"] == rows["sd:2/torch"]["mismatches"] == 0
    assert rows["ss-adaptive/torch"]["mismatches"] == 0 and rows["ss-adaptive/torch"]["draft_calls"] == 0
    assert rows["parallelspec/torch"]["mismatches"] == 0 and rows["parallelspec/torch"]["draft_calls"] > 0
    assert rows["falcon:1-1/torch"]["mismatches"] == 0 and rows["falcon:1-1/torch"]["mean_draft_nodes"] == 2
    # Variants in the same run: sd:2 verifies 2 drafts a step; specdec++ at threshold 1 never stops before its 4.
    assert rows["sd:2/torch"]["mean_draft_nodes"] == 2 and rows["specdec++:1/torch"]["mean_draft_nodes"] == 4
    assert "| sd/torch |" in (tmp_path / "bench" / "bench.md").read_text()
    # PEARL replayed on this machine's measured calls (and a given device): the matches of the artifact's draft.
    from streamfuse.tools import pearl_replay

    assert pearl_replay.main(["--artifact", str(tmp_path / "artifact"), "--input-file", str(data / "dialogsum.test.jsonl"),
                              "--limit", "2", "--max-new-tokens", "8", "--threads", "1", "--gamma", "2",
                              "--device", "given:10,12,1", "--matches", str(tmp_path / "matches.json"),
                              "--out", str(tmp_path / "replay.json")]) == 0
    replayed = json.loads((tmp_path / "replay.json").read_text())["rows"]
    assert [row["device"] for row in replayed][1] == "given" and replayed[0]["latencies_ms"]["draft_ms"] > 0
    assert [0 < len(row) <= 8 for row in json.loads((tmp_path / "matches.json").read_text())["matches"]] == [True] * 2

    # A profile whose SS output differs from plain decoding fails the build, naming the inputs.
    from streamfuse.runtime import cli
    from streamfuse.runtime.artifact import Artifact

    opened = Artifact.open(tmp_path / "artifact")
    opened.update(profile={**opened.manifest["profile"], "bench": {**opened.manifest["profile"]["bench"],
                                                                   "mismatched_inputs": ["test_1"]}})
    argv = ["--task", "dialogsum", "--preset", "smoke", "--base-model", str(tiny_base_dir), "--data-dir", str(data),
            "--work-dir", str(tmp_path / "work"), *with_sd]  # the artifact as it is now, chains included
    assert cli.run(build.main, argv, prog="build.py") == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("build.py: error: profile: SS differs from plain decoding on") and "test_1" in err

    # A backend that is not lossless is refused at verify, naming the test dialogue; the installed artifact stays.
    from streamfuse.runtime.backends import sessions

    from test_export import Biased

    installed = (tmp_path / "artifact" / "manifest.json").read_bytes()
    real = sessions.open_session
    monkeypatch.setattr(sessions, "open_session", lambda *args, **kwargs: Biased(real(*args, **kwargs)))
    assert cli.run(build.main, [*argv, "--set", "export.parity_prompts=2"], prog="build.py") == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("build.py: error: parity failed on onnxruntime: SS vs its own plain decoding differs on test_"), err
    assert (tmp_path / "artifact" / "manifest.json").read_bytes() == installed
    monkeypatch.setattr(sessions, "open_session", real)

    # Other first-stage weights under the same settings (a retrain, a copied-in checkpoint): what
    # was computed from the old ones is stale. The second stage trains again, from them; its new
    # weights keep their key, and still its evaluation, export and profile run again.
    streams = run_dir / "ss_stage1" / "streams.safetensors"
    save_file({name: tensor + 0.01 for name, tensor in load_file(str(streams)).items()}, str(streams))
    assert run_build(tiny_base_dir, data, tmp_path / "work", *export) == 0
    out = capsys.readouterr().out
    assert out.count("[train] reusing") == 2 and "[distil] reusing" not in out and out.count("[eval] reusing") == 2
    assert "[export] reusing" not in out and "[profile] reusing" not in out
    second = json.loads((run_dir / "ss" / "streamfuse.json").read_text())["info"]
    assert second["training_key"] == first_ss_key and second["first_stage"]["weights"] == weights_digest(run_dir / "ss_stage1")
    artifact = json.loads((tmp_path / "artifact" / "manifest.json").read_text())
    assert artifact["adapter"]["weights_sha256"] == weights_digest(run_dir / "ss")


def test_baseline_checkpoint_key_ignores_stream_settings():
    from dataclasses import replace

    from streamfuse.training.config import preset

    def inputs(config, with_streams):
        return stages.train_inputs(config, "dialogsum", "m", with_streams)

    cpu = preset("cpu")
    other = replace(cpu, streams=replace(cpu.streams, num_streams=4), train=replace(cpu.train, stream_weight=0.5))
    assert inputs(cpu, with_streams=False) == inputs(other, with_streams=False)
    assert inputs(cpu, with_streams=True) != inputs(other, with_streams=True)
    longer = replace(cpu, train=replace(cpu.train, epochs=3.0))
    assert inputs(cpu, with_streams=False) != inputs(longer, with_streams=False)


def config_of(*argv: str):
    return build.build_config(build.parse_args(list(argv)))


# --set assignments -> the fields they reach (section.field: value)
OVERRIDES = [
    (["streams.num_streams=2", "streams.msa_layers=3"], {"streams.num_streams": 2, "streams.msa_layers": 3}),
    (["train.stream_weight=0.5", "train.epochs=2"], {"train.stream_weight": 0.5, "train.epochs": 2.0}),
    (["streams.init_rank=16", "streams.init_per_stream=true", "train.init_lr_scale=3"],
     {"streams.init_rank": 16, "streams.init_per_stream": True, "train.init_lr_scale": 3.0}),
    (["data.train_limit=none", "data.test_limit=7"], {"data.train_limit": None, "data.test_limit": 7}),
    (["distill.enabled=true", "distill.main_targets=own", "distill.init_rank=0", "distill.learning_rate=3e-4"],
     {"distill.enabled": True, "distill.main_targets": "own", "distill.init_rank": 0, "distill.learning_rate": 3e-4}),
    (["export.trees=gamma=3,k=1;gamma=3,k=2", "export.capacity=512", "export.buckets=4,16"],
     {"export.trees": ("gamma=3,k=1", "gamma=3,k=2"), "export.capacity": 512, "export.buckets": (4, 16)}),
    (["stages.baseline=false", "stages.profile_limit=0"], {"stages.baseline": False, "stages.profile_limit": 0}),
]


@pytest.mark.parametrize("assignments, expected", OVERRIDES, ids=[a[0] for a, _ in OVERRIDES])
def test_set_reaches_exactly_the_fields_it_names(assignments, expected):
    import dataclasses

    base = config_of("--preset", "smoke")
    config = config_of("--preset", "smoke", *(f"--set={a}" for a in assignments))
    for path, value in expected.items():
        section, name = path.split(".")
        assert getattr(getattr(config, section), name) == value, path
    changed = {f"{section}.{name}" for section, fields in dataclasses.asdict(config).items() if isinstance(fields, dict)
               for name, value in fields.items() if value != dataclasses.asdict(base)[section][name]}
    assert changed <= set(expected)  # nothing else moved behind the user's back


# --set assignments on a preset -> the one-line refusal
REFUSED = [
    ("cpu", ["streams.gamma=2"], "streams has no field 'gamma'"),
    ("cpu", ["training.epochs=2"], "SECTION one of"),
    ("cpu", ["train.epochs=abc"], "'abc' is not a valid float"),
    ("cpu", ["distill.enabled=maybe"], "'maybe' is not true or false"),
    ("cpu", ["streams.init_rank=0"], "set streams.init_per_stream=false"),
    ("cpu", ["distill.enabled=true", "distill.init_rank=64"], "set distill.init_rank=0"),
    ("cpu-distill", ["distill.main_targets=own"], "set distill.with_references=false"),
    ("cpu", ["stages.calibration_inputs=0"], "stages.calibration_inputs must be >= 1"),
    ("cpu", ["export.trees=gamma=x"], "gamma=x"),
    ("cpu", ["export.buckets=4,x"], "'4,x' is not a list of whole numbers"),
    ("cpu", ["export.buckets=8,4"], "distinct row counts >= 2"),
    ("cpu", ["export.trees=gamma=3,k=2", "export.buckets=4,8"], "a tree of 15 nodes, more than the largest of "
                                                                "export.buckets (8): add a bucket of 15 or more"),
    ("cpu", ["parallelspec.masks=1", "parallelspec.tree=2-1-1"], "deeper than the 2 depths a pass drafts"),
    ("cpu", ["parallelspec.tree=2-x"], "children per depth >= 1, got '2-x'"),
    ("cpu", ["parallelspec.quantize=int4"], "parallelspec.quantize must be none or int8, got 'int4'"),
    ("cpu", ["falcon.max_passes=1", "falcon.tree=2-1-1"], "deeper than falcon.max_passes x falcon.block = 2"),
    ("cpu", ["falcon.block=0"], "falcon.block, falcon.passes, falcon.max_passes and falcon.items must be >= 1"),
]


@pytest.mark.parametrize("name, assignments, message", REFUSED, ids=[r[1][-1] for r in REFUSED])
def test_contradictory_or_unknown_settings_are_refused_naming_the_field(name, assignments, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        config_of("--preset", name, *(f"--set={a}" for a in assignments))


def test_q4_native_without_base_codes_is_refused_before_training(tiny_base_dir, tmp_path, capsys):
    from streamfuse.runtime import cli

    argv = ["--task", "dialogsum", "--base-model", str(tiny_base_dir), "--work-dir", str(tmp_path / "work"),
            "--out", str(tmp_path / "artifact"), "--backends", "torch,onnxruntime"]  # the cpu preset: q4-native
    assert cli.run(build.main, argv, prog="build.py") == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("build.py: error: --quantize q4-native keeps the base model's GGUF codes") and "\n" not in err
    assert "has no .gguf file" in err and not (tmp_path / "work").exists()
    assert cli.run(build.main, [*argv, "--quantize", "none", "--print-config"], prog="build.py") == 0


def test_presets_are_consistent_and_flags_set_only_their_field(capsys):
    from streamfuse.export.artifact import BACKENDS, DEFAULT_BACKENDS, ExportConfig
    from streamfuse.training.config import PRESETS

    for name in PRESETS:
        config_of("--preset", name)  # validates
    assert config_of("--preset", "cpu-distill").distill.enabled  # the benchmarked recipe (docs/results.md)
    assert not config_of("--preset", "cpu").distill.enabled  # make build's hour
    assert config_of("--preset", "cpu", "--set", "distill.enabled=true").distill.init_rank == 0  # trains the first's f_eta
    assert ExportConfig().backends == DEFAULT_BACKENDS == config_of().export.backends
    assert set(BACKENDS) - set(DEFAULT_BACKENDS) == {"coreml", "executorch_coreml"}  # Apple's: asked for
    assert config_of().export.trees == ()  # calibration picks them
    # make build ships the 4-bit artifact and skips the paper's comparisons; the smoke preset stays fp32
    cpu = config_of("--preset", "cpu")
    assert (cpu.export.quantize, cpu.stages.baseline, cpu.stages.zero_shot) == ("q4-native", False, False)
    assert config_of("--preset", "cpu-distill").export.quantize == "q4-native"
    assert config_of("--preset", "smoke").export.quantize == "none" and config_of("--preset", "smoke").stages.baseline
    quantized = config_of("--backends", "torch,onnxruntime", "--quantize", "int8")
    assert (quantized.export.backends, quantized.export.quantize) == (("torch", "onnxruntime"), "int8")
    assert build.main(["--preset", "smoke", "--set", "train.epochs=3", "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["train"]["epochs"] == 3.0 and printed["preset"] == "smoke" and printed["export"]["trees"] == []


def test_each_task_brings_its_lengths_to_the_cpu_presets_and_several_tasks_share_one_artifact(capsys):
    e2e = config_of("--task", "e2e_nlg")
    assert (e2e.data.max_target_tokens, e2e.eval.max_new_tokens, e2e.train.epochs) == (64, 64, 0.3)
    assert config_of("--task", "e2e_nlg", "--set", "train.epochs=1").train.epochs == 1.0  # the user's --set wins
    assert config_of("--task", "e2e_nlg", "--preset", "smoke").train.epochs == 1.0  # smoke keeps its own
    assert config_of().data.max_target_tokens == 80 and not config_of().export.task_inputs
    args = build.parse_args(["--task", "dialogsum,e2e_nlg"])
    assert args.out == Path("artifacts/dialogsum+e2e_nlg")
    runs = build.task_runs(args)
    assert [(run.task, config.export.task_inputs, config.train.epochs) for run, config in runs] == \
        [("dialogsum", True, 1.2), ("e2e_nlg", True, 0.3)]
    with pytest.raises(ValueError, match="the drafters of sd, medusa are per task: build them into a one-task artifact"):
        build.task_runs(build.parse_args(["--task", "dialogsum,e2e_nlg", "--set", "sd.enabled=true",
                                          "--set", "medusa.enabled=true"]))
    with pytest.raises(SystemExit):
        build.parse_args(["--task", "dialogsum,samsum"])
    assert "--task: unknown task 'samsum'; known tasks: dialogsum, e2e_nlg, sqlcontext" in capsys.readouterr().err


def test_distilled_model_is_keyed_on_its_first_stage_and_its_recipe():
    cpu = config_of("--preset", "cpu-distill")
    own = config_of("--preset", "cpu-distill", "--set", "distill.with_references=false")
    assert stages.distill_inputs(cpu, "a-ss") != stages.distill_inputs(cpu, "b-ss") != stages.distill_inputs(own, "b-ss")


def test_validation_rows_past_the_held_out_slice_can_train(tiny_base_dir, tmp_path):
    data = write_tiny_dialogsum(tmp_path / "data")  # 24 train rows, 8 dev rows
    common = ["--preset", "smoke", "--base-model", str(tiny_base_dir), "--data-dir", str(data), "--set", "data.train_limit=30"]
    plain = pipeline.Build(args := build.parse_args(common), build.build_config(args))
    plain.load_data()
    more = pipeline.Build(args := build.parse_args([*common, "--set", "data.train_on_validation_rest=true"]),
                       build.build_config(args))
    more.load_data()
    validation = [ex.id for ex in more.validation]
    assert validation == [ex.id for ex in plain.validation] == [f"dev_{i}" for i in range(8)]  # smoke keeps 8
    assert [ex.id for ex in plain.train_examples] == [f"train_{i}" for i in range(24)]
    # The smoke preset holds out all 8 dev rows, so nothing joins; with a 5-row slice, 3 do (then the limit cuts).
    assert [ex.id for ex in more.train_examples] == [f"train_{i}" for i in range(24)]
    config = dataclasses.replace(more.config, data=dataclasses.replace(more.config.data, validation_limit=5))
    sliced = pipeline.Build(args, config)
    sliced.load_data()
    assert [ex.id for ex in sliced.validation] == [f"dev_{i}" for i in range(5)]
    assert [ex.id for ex in sliced.train_examples] == [f"train_{i}" for i in range(24)] + ["dev_5", "dev_6", "dev_7"]
    # Which rows train then depends on the slice, so the checkpoint key does; without the option it does not.
    key = lambda c: stages.train_inputs(c, "dialogsum", "m", with_streams=True)  # noqa: E731
    assert key(config) != key(more.config) != key(plain.config)
    unsliced = dataclasses.replace(plain.config, data=dataclasses.replace(plain.config.data, validation_limit=5))
    assert key(unsliced) == key(plain.config)
    with pytest.raises(ValueError, match="needs a validation_limit"):
        dataclasses.replace(config.data, validation_limit=None).validate()


def test_the_cpu_preset_trains_on_the_rest_of_the_validation_split_and_the_key_follows_what_trains():
    from dataclasses import replace

    from streamfuse.training.config import preset

    assert preset("cpu").data.train_on_validation_rest and not preset("cpu-distill").data.train_on_validation_rest
    assert (preset("cpu").lora.dropout, preset("cpu-distill").lora.dropout) == (0.0, 0.05)

    def key(config):
        return stages.train_inputs(config, "dialogsum", "m", True)

    for name in ("cpu", "cpu-distill"):  # the test cut never trains; the validation cut only where its rest does
        config = preset(name)
        assert key(config) == key(replace(config, data=replace(config.data, test_limit=7)))
        moved = key(replace(config, data=replace(config.data, validation_limit=50)))
        assert (moved != key(config)) == config.data.train_on_validation_rest
    assert not config_of("--preset", "cpu", "--set", "data.train_on_validation_rest=false").data.train_on_validation_rest


def test_new_models_start_from_the_training_seed_whatever_the_generator_held(tiny_base_dir):
    args = build.parse_args(["--preset", "smoke", "--base-model", str(tiny_base_dir), "--set", "streams.init_rank=4",
                             "--set", "streams.init_per_stream=true"])
    builder = pipeline.Build(args, build.build_config(args))
    first = {n: p.detach().clone() for n, p in builder.new_model().named_parameters() if p.requires_grad}
    torch.seed()  # what an import may do: reseed from the OS
    torch.rand(7)
    second = {n: p for n, p in builder.new_model().named_parameters() if p.requires_grad}
    assert first.keys() == second.keys() and any("lora_A" in n for n in first)
    for name, value in first.items():
        assert torch.equal(value, second[name]), name
    assert any(value.abs().sum() > 0 and "init" in name for name, value in first.items())  # f_eta: random, not zeros


@pytest.mark.parametrize("argv, message", [
    (["--set", "export.trees=gamma=x"], "gamma=x"),
    (["--backends", "tflite"], "tflite"),
    (["--set", "stages.calibration_inputs=0"], "stages.calibration_inputs must be >= 1"),
    (["--set", "export.capacity=8"], "capacity 8 must hold at least one prefill chunk"),
])
def test_bad_export_flags_are_one_line_before_any_work(tiny_base_dir, tmp_path, capsys, argv, message):
    from streamfuse.runtime import cli

    argv = ["--preset", "smoke", "--base-model", str(tiny_base_dir), "--work-dir", str(tmp_path / "work"), *argv]
    assert cli.run(build.main, argv, prog="build.py") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("build.py: error: ") and message in err
    assert not (tmp_path / "work").exists()  # refused before any work


def test_threads_below_one_is_an_argparse_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build.parse_args(["--threads", "0"])
    assert exit_info.value.code == 2 and "--threads must be >= 1" in capsys.readouterr().err


def test_a_second_build_into_the_same_folder_refuses_with_one_line(tiny_base_dir, tmp_path, capsys):
    import os

    from streamfuse.runtime import cli
    from streamfuse.training.lock import FolderBusy, exclusive

    out = tmp_path / "artifact"
    with exclusive(out):
        with pytest.raises(FolderBusy, match=rf"being written by another build \(pid {os.getpid()}\)"):
            with exclusive(out):
                pass
        argv = ["--preset", "smoke", "--base-model", str(tiny_base_dir), "--work-dir", str(tmp_path / "work"),
                "--out", str(out)]
        assert cli.run(build.main, argv, prog="build.py") == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("build.py: error: ") and "being written by another build" in err and "--out" in err
    with exclusive(out):  # released with its holder
        pass


def test_the_export_build_script_hands_the_process_to_the_training_build(tmp_path):
    """`python export/build.py` stays the documented command; export/ imports nothing of training/, so the
    script execs python -m streamfuse.training.build with the same arguments (and its exit status)."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "export" / "build.py"
    done = subprocess.run([sys.executable, str(script), "--print-config", "--preset", "smoke", "--task", "e2e_nlg"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["task"] == "e2e_nlg"
    bad = subprocess.run([sys.executable, str(script), "--preset", "nope"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and "invalid choice: 'nope'" in bad.stderr
