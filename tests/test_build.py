"""export/build.py end to end on a tiny base model and tiny DialogSum-format data."""

import dataclasses
import json

import pytest
import torch
from conftest import write_tiny_dialogsum
from safetensors.torch import load_file, save_file

from streamfuse.adapters.checkpoint import weights_digest
from streamfuse.export import build, distill
from streamfuse.runtime.backends.base import process_peak_rss_bytes
from streamfuse.runtime.calibration import AcceptanceModel
from streamfuse.runtime.tree import TreeSpec


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
    export = ["--distill", "--distill-main-targets", "frozen", "--distill-init-rank", "4", "--distill-with-references",
              "--distill-unlabelled",
              "--backends", "torch,onnx", "--context", "256", "--parity-prompts", "3", "--profile-limit", "2",
              "--draft-vocab", "40", "--out", str(tmp_path / "artifact")]
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
    own_answers = run_dir / "distill" / f"{build.model_key(run_dir / 'ss_stage1')}-train.jsonl"
    assert len(own_answers.read_text().splitlines()) == 16
    unlabelled = own_answers.with_name(own_answers.name.replace("-train.jsonl", "-unlabelled.jsonl"))
    assert len(unlabelled.read_text().splitlines()) == 4  # the dialogues without references
    assert summary["test_examples"] == 6 and len(summary["bars"]) == 3
    # identifiers 3 x 32, f_eta down 32 x (3 * 4) and up 3 x 4 x 32, pruning head 2 x 32 x 8
    assert summary["extra_parameters"]["total"] == 3 * 32 + 2 * 3 * 4 * 32 + 2 * 32 * 8
    lora = [load_file(str(run_dir / stage / "lora" / "adapter_model.safetensors")) for stage in ("ss_stage1", "ss")]
    assert lora[0].keys() == lora[1].keys() and all(torch.equal(lora[0][k], lora[1][k]) for k in lora[0])
    assert not list(run_dir.glob("*.snapshot")), "snapshots are removed once a checkpoint is saved"
    manifest = json.loads((run_dir / "ss" / "streamfuse.json").read_text())
    assert manifest["info"]["prompt"]["source_template"] == "{dialogue}"  # the runtime formats inputs from it
    out = capsys.readouterr().out
    assert "on 10 of 20 own answers (the rest did not finish) and 16 references" in out
    assert "| Speculative Streaming |" in out and "stream-1 top-1" in out
    artifact = json.loads((tmp_path / "artifact" / "manifest.json").read_text())
    assert set(artifact["files"]) == {"onnx"} and artifact["parity"]["onnx"]["ss_equals_torch_eager"] == 3
    greedy = artifact["graphs"]["greedy_step"]
    # Calibrated: the acceptance model from validation answers, the best tree of each size timed on torch here;
    # the graphs get its choice first, then the tree of up to 8 nodes with most expected tokens (fp32: no 2-node tree).
    calibration = artifact["calibration"]
    assert calibration["acceptance"]["positions"] > 0 and calibration["acceptance"]["depth"] == 3
    assert set(calibration["backends"]) == {"torch", "onnxruntime"}
    trees = [TreeSpec.from_dict(tree) for tree in artifact["trees"]]
    assert trees[0].hash() == calibration["backends"]["torch"]["choice"]["hash"]
    acceptance = AcceptanceModel.from_dict(calibration["acceptance"])
    wide = [t for n, t in acceptance.best_trees().items() if n <= 8]
    assert trees[-1] == max(wide, key=acceptance.expected_tokens) and len(trees) <= 2
    assert len(calibration["backends"]["torch"]["trees"]) >= 2  # every size the acceptance model reaches
    onnx_trees = calibration["backends"]["onnxruntime"]["trees"]
    assert [row["tree"]["hash"] for row in onnx_trees] == [tree.hash() for tree in trees]  # the graphs it has
    assert all(row["step_ms"] > 0 and row["expected_tokens"] >= 1 and row["realised_tokens"] >= 1 for row in onnx_trees)
    assert greedy["schedules"] == ["fused" if t.num_nodes <= 7 else "deferred" for t in trees]
    assert greedy["draft_vocab"]["size"] == 40
    assert "## Calibration: the draft tree per backend on this machine" in out
    assert 0.3 < greedy["draft_vocab"]["coverage"] <= 1.0 and "draft vocabulary: 40 tokens" in out
    assert artifact["profile"]["bench"]["inputs"] == 2 and artifact["profile"]["bench"]["parity_mismatches"] == 0
    # Profiled in a fresh process: its peak is the runtime's, below this process's (which trained and exported).
    assert 0 < artifact["profile"]["profile"]["peak_memory_bytes"] < process_peak_rss_bytes()
    assert "| onnx |" in out and "call reduction CR" in out
    assert not list(tmp_path.glob(".artifact.partial-*")), "the staging folder is renamed into place"

    # A rerun with the same settings trains, evaluates, exports and profiles nothing.
    assert run_build(tiny_base_dir, data, tmp_path / "work", *export) == 0
    out = capsys.readouterr().out
    assert out.count("[train] reusing") == 2 and out.count("[distil] reusing") == 1 and out.count("[eval] reusing") == 5  # + acceptance, torch calibration
    assert "[export] reusing" in out and "[profile] reusing" in out and "reusing onnxruntime's calibration" in out

    # A profile whose SS output differs from plain decoding fails the build, naming the inputs.
    from streamfuse.runtime import cli
    from streamfuse.runtime.artifact import Artifact

    opened = Artifact.open(tmp_path / "artifact")
    opened.update(profile={**opened.manifest["profile"], "bench": {**opened.manifest["profile"]["bench"],
                                                                   "mismatched_inputs": ["test_1"]}})
    argv = ["--task", "dialogsum", "--preset", "smoke", "--base-model", str(tiny_base_dir), "--data-dir", str(data),
            "--work-dir", str(tmp_path / "work"), *export]
    assert cli.run(build.main, argv, prog="build.py") == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("build.py: error: profile: SS differs from plain decoding on") and "test_1" in err

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

    from streamfuse.export.config import preset

    cpu = preset("cpu")
    other = replace(cpu, streams=replace(cpu.streams, num_streams=4), train=replace(cpu.train, stream_weight=0.5))
    assert cpu.training_key("dialogsum", "m", with_streams=False) == other.training_key("dialogsum", "m", with_streams=False)
    assert cpu.training_key("dialogsum", "m", with_streams=True) != other.training_key("dialogsum", "m", with_streams=True)
    longer = replace(cpu, train=replace(cpu.train, epochs=3.0))
    assert cpu.training_key("dialogsum", "m", with_streams=False) != longer.training_key("dialogsum", "m", with_streams=False)


def test_stream_overrides_reach_the_config():
    config = build.build_config(build.parse_args(["--preset", "smoke", "--gamma", "2", "--msa-layers", "3",
                                                  "--stream-weight", "0.5", "--epochs", "2"]))
    assert (config.streams.num_streams, config.streams.msa_layers) == (2, 3)
    assert (config.train.stream_weight, config.train.epochs) == (0.5, 2.0)


def test_init_rank_override_gives_each_stream_its_own_f_eta():
    config = build.build_config(build.parse_args(["--preset", "smoke", "--init-rank", "16", "--init-lr-scale", "3"]))
    assert (config.streams.init_rank, config.streams.init_per_stream, config.train.init_lr_scale) == (16, True, 3.0)
    identity = build.build_config(build.parse_args(["--preset", "cpu", "--init-rank", "0"]))
    assert (identity.streams.init_rank, identity.streams.init_per_stream) == (0, False)
    identity.streams.validate(30)
    # A first stage with its own f_eta keeps training it in a second stage instead of growing another.
    assert build.build_config(build.parse_args(["--preset", "cpu", "--distill"])).distill.init_rank == 0
    assert build.build_config(build.parse_args(["--preset", "cpu-distill"])).distill.init_rank == 128


def test_the_core_ml_delegated_pte_is_asked_for_not_built_by_default():
    from streamfuse.export.artifact import BACKENDS, DEFAULT_BACKENDS, ExportConfig

    assert ExportConfig().backends == DEFAULT_BACKENDS == ("torch", "executorch", "onnx", "coreml")
    assert set(BACKENDS) - set(DEFAULT_BACKENDS) == {"executorch_coreml"}
    assert build.export_config(build.parse_args([])).backends == DEFAULT_BACKENDS


def test_distill_flags_reach_the_config():
    cpu = build.build_config(build.parse_args(["--preset", "cpu-distill"]))
    assert cpu.distill.enabled and cpu.distill.main_targets == "frozen"  # the benchmarked recipe (docs/results.md)
    assert not build.build_config(build.parse_args(["--preset", "cpu"])).distill.enabled  # make build's hour
    assert not build.build_config(build.parse_args(["--preset", "smoke"])).distill.enabled
    on = build.build_config(build.parse_args(["--preset", "cpu-distill", "--distill", "--distill-stream-weight", "0.2",
                                              "--distill-main-targets", "own", "--distill-init-rank", "0",
                                              "--distill-lr", "3e-4", "--distill-epochs", "3"]))
    assert on.distill.stream_weight == 0.2 and on.distill.main_targets == "own" and on.distill.epochs == 3.0
    assert (on.distill.init_rank, on.distill.learning_rate) == (0, 3e-4)
    assert not on.distill.with_references  # the preset's choice belongs to its frozen recipe
    assert not build.build_config(build.parse_args(["--preset", "cpu-distill", "--no-distill"])).distill.enabled
    # The distilled model is retrained when its first stage or its own recipe changes.
    assert on.distill_key("a-ss") != on.distill_key("b-ss") != cpu.distill_key("b-ss")
    assert cpu.distill.with_references
    own_only = build.build_config(build.parse_args(["--preset", "cpu-distill", "--no-distill-with-references"]))
    assert not own_only.distill.with_references and own_only.distill_key("b-ss") != cpu.distill_key("b-ss")
    with pytest.raises(ValueError, match="with_references applies to main_targets 'frozen'"):
        build.build_config(build.parse_args(["--preset", "cpu-distill", "--distill-with-references",
                                             "--distill-main-targets", "own"]))


def test_validation_rows_past_the_held_out_slice_can_train(tiny_base_dir, tmp_path):
    data = write_tiny_dialogsum(tmp_path / "data")  # 24 train rows, 8 dev rows
    common = ["--preset", "smoke", "--base-model", str(tiny_base_dir), "--data-dir", str(data), "--train-limit", "30"]
    plain = build.Build(args := build.parse_args(common), build.build_config(args))
    plain.load_data()
    more = build.Build(args := build.parse_args([*common, "--train-on-validation-rest"]), build.build_config(args))
    more.load_data()
    validation = [ex.id for ex in more.validation]
    assert validation == [ex.id for ex in plain.validation] == [f"dev_{i}" for i in range(8)]  # smoke keeps 8
    assert [ex.id for ex in plain.train_examples] == [f"train_{i}" for i in range(24)]
    # The smoke preset holds out all 8 dev rows, so nothing joins; with a 5-row slice, 3 do (then the limit cuts).
    assert [ex.id for ex in more.train_examples] == [f"train_{i}" for i in range(24)]
    config = dataclasses.replace(more.config, data=dataclasses.replace(more.config.data, validation_limit=5))
    sliced = build.Build(args, config)
    sliced.load_data()
    assert [ex.id for ex in sliced.validation] == [f"dev_{i}" for i in range(5)]
    assert [ex.id for ex in sliced.train_examples] == [f"train_{i}" for i in range(24)] + ["dev_5", "dev_6", "dev_7"]
    # Which rows train then depends on the slice, so the checkpoint key does; without the option it does not.
    key = lambda c: c.training_key("dialogsum", "m", with_streams=True)  # noqa: E731
    assert key(config) != key(more.config) != key(plain.config)
    unsliced = dataclasses.replace(plain.config, data=dataclasses.replace(plain.config.data, validation_limit=5))
    assert key(unsliced) == key(plain.config)
    with pytest.raises(ValueError, match="needs a validation_limit"):
        dataclasses.replace(config.data, validation_limit=None).validate()


def test_the_cpu_preset_trains_on_the_rest_of_the_validation_split_and_the_key_follows_what_trains():
    from dataclasses import replace

    from streamfuse.export.config import preset

    assert preset("cpu").data.train_on_validation_rest and not preset("cpu-distill").data.train_on_validation_rest
    assert (preset("cpu").lora.dropout, preset("cpu-distill").lora.dropout) == (0.0, 0.05)

    def key(config):
        return config.training_key("dialogsum", "m", True)

    for name in ("cpu", "cpu-distill"):  # the test cut never trains; the validation cut only where its rest does
        config = preset(name)
        assert key(config) == key(replace(config, data=replace(config.data, test_limit=7)))
        moved = key(replace(config, data=replace(config.data, validation_limit=50)))
        assert (moved != key(config)) == config.data.train_on_validation_rest
    off = build.build_config(build.parse_args(["--preset", "cpu", "--no-train-on-validation-rest"]))
    assert not off.data.train_on_validation_rest


def test_new_models_start_from_the_training_seed_whatever_the_generator_held(tiny_base_dir):
    args = build.parse_args(["--preset", "smoke", "--base-model", str(tiny_base_dir), "--init-rank", "4"])
    builder = build.Build(args, build.build_config(args))
    first = {n: p.detach().clone() for n, p in builder.new_model().named_parameters() if p.requires_grad}
    torch.seed()  # what an import may do: reseed from the OS
    torch.rand(7)
    second = {n: p for n, p in builder.new_model().named_parameters() if p.requires_grad}
    assert first.keys() == second.keys() and any("lora_A" in n for n in first)
    for name, value in first.items():
        assert torch.equal(value, second[name]), name
    assert any(value.abs().sum() > 0 and "init" in name for name, value in first.items())  # f_eta: random, not zeros


def test_calibration_inputs_below_one_are_refused_before_any_work(capsys):
    with pytest.raises(SystemExit):
        build.parse_args(["--calibration-inputs", "0"])
    assert "--calibration-inputs must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--tree", "gamma=x"], "gamma=x"),
    (["--backends", "tflite"], "tflite"),
])
def test_bad_export_flags_are_one_line_before_any_work(tiny_base_dir, tmp_path, capsys, argv, message):
    from streamfuse.runtime import cli

    argv = ["--preset", "smoke", "--base-model", str(tiny_base_dir), "--work-dir", str(tmp_path / "work"), *argv]
    assert cli.run(build.main, argv, prog="build.py") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("build.py: error: ") and message in err
    assert not (tmp_path / "work").exists()  # refused before any work


def test_a_second_build_into_the_same_folder_refuses_with_one_line(tiny_base_dir, tmp_path, capsys):
    import os

    from streamfuse.export.lock import FolderBusy, exclusive
    from streamfuse.runtime import cli

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
