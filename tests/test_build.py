"""streamfuse build end to end on a tiny base model and tiny DialogSum-format data."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from streamfuse.adapters.checkpoint import weights_digest
from streamfuse.runtime.backends.base import process_peak_rss_bytes
from streamfuse.runtime.speculation.calibration import AcceptanceModel
from streamfuse.runtime.speculation.tree import TreeSpec
from streamfuse.training import build, stages

from conftest import end_half_the_answers, smoke_build_args, write_tiny_dialogsum


def run_build(base, data, work, *extra):
    return build.main(smoke_build_args(base, data, work, *extra))


def test_build_trains_evaluates_exports_and_reuses(tiny_base_dir, tmp_path, capsys, monkeypatch):
    data = write_tiny_dialogsum(tmp_path / "data")
    # Distillation keeps finished answers only: its filter (unfinished answers dropped) is exercised.
    end_half_the_answers(monkeypatch)
    # Frozen (the cpu recipe): only the streams, with a per-stream f_eta, train in the second stage,
    # on the own answers and the references.
    export = ["--backends", "torch,onnxruntime", "--out", str(tmp_path / "artifact")] + [
        f"--set={a}"
        for a in (
            "distill.enabled=true",
            "distill.main_targets=frozen",
            "distill.init_rank=4",
            "distill.with_references=true",
            "distill.unlabelled=true",
            "export.capacity=256",
            "export.parity_prompts=3",
            "stages.profile_limit=2",
            "export.draft_vocab=40",
        )
    ]
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
    assert (
        json.loads((run_dir / "ss" / "streamfuse.json").read_text())["info"]["first_stage"]["training_key"]
        == first["training_key"]
    )
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
    per_bucket = [
        max((t for n, t in best.items() if low < n <= high), key=acceptance.expected_tokens)
        for low, high in ((0, 4), (4, 8))
        if any(low < n <= high for n in best)
    ]
    assert [row["tree"]["hash"] for row in onnx_trees] == [tree.hash() for tree in per_bucket]
    assert all(row["step_ms"] > 0 and row["expected_tokens"] >= 1 and row["realised_tokens"] >= 1 for row in onnx_trees)
    # an engine's greedy steps timed both ways; torch's (every size, to pick the trees to export) one way
    assert all(row["other_ms"] is not None for row in onnx_trees)
    assert all(row["other_ms"] is None and not row["two_calls"] for row in calibration["backends"]["torch"]["trees"])
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
    assert (
        out.count("[train] reusing") == 2 and out.count("[distil] reusing") == 1 and out.count("[eval] reusing") == 5
    )  # + acceptance, torch calibration
    assert "[export] reusing" in out and "[profile] reusing" in out and "reusing onnxruntime's calibration" in out
    assert "in a worker process" not in out

    # Methods sd, medusa and specdec++ added to the built artifact: SS's stages are reused; the draft model
    # (the base's first 2 layers) and 2 Medusa heads train on the SS model's own answers, the acceptance head
    # on the draft model's states over them, and all land in drafters/. The graphs are exported again with
    # the heads method; the chains sd and specdec++ verify (3 and 2..4 drafts) fit the 8-row bucket.
    with_sd = [
        *export,
        "--set=sd.enabled=true",
        "--set=sd.layers=2",
        "--set=sd.gamma=3",
        "--set=sd.epochs=2",
        "--set=sd.vocab=40",
        "--set=medusa.enabled=true",
        "--set=medusa.heads=2",
        "--set=medusa.batch=16",
        "--set=specdec.enabled=true",
        "--set=specdec.max_drafts=4",
        "--set=specdec.batch=16",
        "--set=adaptive.enabled=true",
        "--set=adaptive.batch=16",
        "--set=parallelspec.enabled=true",
        "--set=parallelspec.masks=1",
        "--set=parallelspec.vocab=40",
        "--set=parallelspec.epochs=1",
        "--set=parallelspec.capacity=32",
        "--set=parallelspec.tree=2-1",
        "--set=falcon.enabled=true",
        "--set=falcon.vocab=40",
        "--set=falcon.epochs=1",
        "--set=falcon.capacity=32",
        "--set=falcon.tree=2-1-1",
        "--set=falcon.max_passes=2",
    ]
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
    from streamfuse.runtime.request.decode import generate
    from streamfuse.runtime.request.emitter import StopRules
    from streamfuse.runtime.request.loader import load
    from streamfuse.runtime.request.settings import DecodeSettings

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
    for method, threshold in (
        ("sd", None),
        ("specdec++", 0.5),
        ("specdec++", 1.0),
        ("medusa", None),
        ("ss-adaptive", None),
        ("pearl", None),
        ("parallelspec", None),
        ("falcon", None),
    ):
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
    draft_parity = json.loads((tmp_path / "artifact" / "drafters" / "sd" / "manifest.json").read_text())["parity"][
        "onnxruntime"
    ]
    assert draft_parity["ss_equals_own_plain"] == draft_parity["plain_prompts"] > 0
    # Its LM head keeps the 40 tokens the SS model's answers use most, on every engine it runs on.
    head = json.loads((tmp_path / "artifact" / "drafters" / "sd" / "manifest.json").read_text())["model"]["head_vocab"]
    assert head["size"] == 40 and 0.3 < head["coverage"] <= 1.0 and "draft head vocabulary: 40 tokens" in out
    assert len(exported_target.resources["sd:onnxruntime"].spec.head_ids) == 40
    assert len(loaded.resources["sd:torch"].spec.head_ids) == 40
    # One bench table for every method: SD's draft calls beside SS's none, both equal to plain decoding.
    from streamfuse.tools import bench

    assert (
        bench.main(
            [
                "--artifact",
                str(tmp_path / "artifact"),
                "--task",
                "dialogsum",
                "--input-file",
                str(data / "dialogsum.test.jsonl"),
                "--limit",
                "2",
                "--warmup",
                "0",
                "--max-new-tokens",
                "8",
                "--threads",
                "1",
                "--backends",
                "torch",
                "--methods",
                "ar,ss,sd,medusa,specdec++,sd:2,specdec++:1,ss-adaptive,parallelspec,falcon:1-1",
                "--out",
                str(tmp_path / "bench"),
            ]
        )
        == 0
    )
    rows = {r["name"]: r for r in json.loads((tmp_path / "bench" / "bench.json").read_text())["table"]}
    assert rows["sd/torch"]["mismatches"] == rows["ss/torch"]["mismatches"] == rows["medusa/torch"]["mismatches"] == 0
    assert (
        rows["sd/torch"]["draft_calls"] > 0 and rows["ss/torch"]["draft_calls"] == rows["ar/torch"]["draft_calls"] == 0
    )
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

    assert (
        pearl_replay.main(
            [
                "--artifact",
                str(tmp_path / "artifact"),
                "--input-file",
                str(data / "dialogsum.test.jsonl"),
                "--limit",
                "2",
                "--max-new-tokens",
                "8",
                "--threads",
                "1",
                "--gamma",
                "2",
                "--device",
                "given:10,12,1",
                "--matches",
                str(tmp_path / "matches.json"),
                "--out",
                str(tmp_path / "replay.json"),
            ]
        )
        == 0
    )
    replayed = json.loads((tmp_path / "replay.json").read_text())["rows"]
    assert [row["device"] for row in replayed][1] == "given" and replayed[0]["latencies_ms"]["draft_ms"] > 0
    assert [0 < len(row) <= 8 for row in json.loads((tmp_path / "matches.json").read_text())["matches"]] == [True] * 2

    # A profile whose SS output differs from plain decoding fails the build, naming the inputs.
    from streamfuse.runtime.artifact.format import Artifact
    from streamfuse.runtime.commands import errors

    opened = Artifact.open(tmp_path / "artifact")
    opened.update(
        profile={
            **opened.manifest["profile"],
            "bench": {**opened.manifest["profile"]["bench"], "mismatched_inputs": ["test_1"]},
        }
    )
    argv = smoke_build_args(tiny_base_dir, data, tmp_path / "work", *with_sd)  # the artifact as it is now
    assert errors.run(build.main, argv, prog="build.py") == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("build.py: error: profile: SS differs from plain decoding on") and "test_1" in err

    # A backend that is not lossless is refused at verify, naming the test dialogue; the installed artifact stays.
    from streamfuse.runtime.backends import runners

    from tiny_export import Biased

    installed = (tmp_path / "artifact" / "manifest.json").read_bytes()
    real = runners.open_runner
    monkeypatch.setattr(runners, "open_runner", lambda *args, **kwargs: Biased(real(*args, **kwargs)))
    assert errors.run(build.main, [*argv, "--set", "export.parity_prompts=2"], prog="build.py") == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(
        "build.py: error: parity failed on onnxruntime: SS vs its own plain decoding differs on test_"
    ), err
    assert (tmp_path / "artifact" / "manifest.json").read_bytes() == installed
    monkeypatch.setattr(runners, "open_runner", real)

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
    assert second["training_key"] == first_ss_key and second["first_stage"]["weights"] == weights_digest(
        run_dir / "ss_stage1"
    )
    artifact = json.loads((tmp_path / "artifact" / "manifest.json").read_text())
    assert artifact["adapter"]["weights_sha256"] == weights_digest(run_dir / "ss")
