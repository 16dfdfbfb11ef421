"""The build's settings: presets, --set and the flags, the checkpoint keys they feed, and the one-line refusals of
bad ones before any work."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from streamfuse.training import build, build_options, pipeline, stages

from conftest import write_tiny_dialogsum


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
    return build_options.build_config(build_options.parse_args(list(argv)))


# --set assignments -> the fields they reach (section.field: value)
OVERRIDES = [
    (["streams.num_streams=2", "streams.msa_layers=3"], {"streams.num_streams": 2, "streams.msa_layers": 3}),
    (["train.stream_weight=0.5", "train.epochs=2"], {"train.stream_weight": 0.5, "train.epochs": 2.0}),
    (
        ["streams.init_rank=16", "streams.init_per_stream=true", "train.init_lr_scale=3"],
        {"streams.init_rank": 16, "streams.init_per_stream": True, "train.init_lr_scale": 3.0},
    ),
    (["data.train_limit=none", "data.test_limit=7"], {"data.train_limit": None, "data.test_limit": 7}),
    (
        ["distill.enabled=true", "distill.main_targets=own", "distill.init_rank=0", "distill.learning_rate=3e-4"],
        {"distill.enabled": True, "distill.main_targets": "own", "distill.init_rank": 0, "distill.learning_rate": 3e-4},
    ),
    (
        ["export.trees=gamma=3,k=1;gamma=3,k=2", "export.capacity=512", "export.buckets=4,16"],
        {"export.trees": ("gamma=3,k=1", "gamma=3,k=2"), "export.capacity": 512, "export.buckets": (4, 16)},
    ),
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
    changed = {
        f"{section}.{name}"
        for section, fields in dataclasses.asdict(config).items()
        if isinstance(fields, dict)
        for name, value in fields.items()
        if value != dataclasses.asdict(base)[section][name]
    }
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
    (
        "cpu",
        ["export.trees=gamma=3,k=2", "export.buckets=4,8"],
        "a tree of 15 nodes, more than the largest of export.buckets (8): add a bucket of 15 or more",
    ),
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
    from streamfuse.runtime.commands import errors

    argv = [
        "--task",
        "dialogsum",
        "--base-model",
        str(tiny_base_dir),
        "--work-dir",
        str(tmp_path / "work"),
        "--out",
        str(tmp_path / "artifact"),
        "--backends",
        "torch,onnxruntime",
    ]  # the cpu preset: q4-native
    assert errors.run(build.main, argv, prog="build.py") == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("build.py: error: --quantize q4-native keeps the base model's GGUF codes") and "\n" not in err
    assert "has no .gguf file" in err and not (tmp_path / "work").exists()
    assert errors.run(build.main, [*argv, "--quantize", "none", "--print-config"], prog="build.py") == 0


def test_presets_are_consistent_and_flags_set_only_their_field(capsys):
    from streamfuse.export.artifact import BACKENDS, DEFAULT_BACKENDS, ExportConfig
    from streamfuse.training.config import PRESETS

    for name in PRESETS:
        config_of("--preset", name)  # validates
    assert config_of("--preset", "cpu-distill").distill.enabled  # the benchmarked recipe (docs/results.md)
    assert not config_of("--preset", "cpu").distill.enabled  # make build's hour
    assert (
        config_of("--preset", "cpu", "--set", "distill.enabled=true").distill.init_rank == 0
    )  # trains the first's f_eta
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
    args = build_options.parse_args(["--task", "dialogsum,e2e_nlg"])
    assert args.out == Path("artifacts/dialogsum+e2e_nlg")
    runs = build_options.task_runs(args)
    assert [(run.task, config.export.task_inputs, config.train.epochs) for run, config in runs] == [
        ("dialogsum", True, 1.2),
        ("e2e_nlg", True, 0.3),
    ]
    with pytest.raises(
        ValueError, match="the drafters of sd, medusa are per task: build them into a one-task artifact"
    ):
        build_options.task_runs(
            build_options.parse_args(
                ["--task", "dialogsum,e2e_nlg", "--set", "sd.enabled=true", "--set", "medusa.enabled=true"]
            )
        )
    with pytest.raises(SystemExit):
        build_options.parse_args(["--task", "dialogsum,samsum"])
    assert "--task: unknown task 'samsum'; known tasks: dialogsum, e2e_nlg, sqlcontext" in capsys.readouterr().err


def test_distilled_model_is_keyed_on_its_first_stage_and_its_recipe():
    cpu = config_of("--preset", "cpu-distill")
    own = config_of("--preset", "cpu-distill", "--set", "distill.with_references=false")
    assert (
        stages.distill_inputs(cpu, "a-ss") != stages.distill_inputs(cpu, "b-ss") != stages.distill_inputs(own, "b-ss")
    )


def test_validation_rows_past_the_held_out_slice_can_train(tiny_base_dir, tmp_path):
    data = write_tiny_dialogsum(tmp_path / "data")  # 24 train rows, 8 dev rows
    common = [
        "--preset",
        "smoke",
        "--base-model",
        str(tiny_base_dir),
        "--data-dir",
        str(data),
        "--set",
        "data.train_limit=30",
    ]
    plain = pipeline.Build(args := build_options.parse_args(common), build_options.build_config(args))
    plain.load_data()
    more = pipeline.Build(
        args := build_options.parse_args([*common, "--set", "data.train_on_validation_rest=true"]),
        build_options.build_config(args),
    )
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
    assert not config_of(
        "--preset", "cpu", "--set", "data.train_on_validation_rest=false"
    ).data.train_on_validation_rest


def test_new_models_start_from_the_training_seed_whatever_the_generator_held(tiny_base_dir):
    args = build_options.parse_args(
        [
            "--preset",
            "smoke",
            "--base-model",
            str(tiny_base_dir),
            "--set",
            "streams.init_rank=4",
            "--set",
            "streams.init_per_stream=true",
        ]
    )
    builder = pipeline.Build(args, build_options.build_config(args))
    first = {n: p.detach().clone() for n, p in builder.new_model().named_parameters() if p.requires_grad}
    torch.seed()  # what an import may do: reseed from the OS
    torch.rand(7)
    second = {n: p for n, p in builder.new_model().named_parameters() if p.requires_grad}
    assert first.keys() == second.keys() and any("lora_A" in n for n in first)
    for name, value in first.items():
        assert torch.equal(value, second[name]), name
    assert any(value.abs().sum() > 0 and "init" in name for name, value in first.items())  # f_eta: random, not zeros


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--set", "export.trees=gamma=x"], "gamma=x"),
        (["--backends", "tflite"], "tflite"),
        (["--set", "stages.calibration_inputs=0"], "stages.calibration_inputs must be >= 1"),
        (["--set", "export.capacity=8"], "capacity 8 must hold at least one prefill chunk"),
    ],
)
def test_bad_export_flags_are_one_line_before_any_work(tiny_base_dir, tmp_path, capsys, argv, message):
    from streamfuse.runtime.commands import errors

    argv = ["--preset", "smoke", "--base-model", str(tiny_base_dir), "--work-dir", str(tmp_path / "work"), *argv]
    assert errors.run(build.main, argv, prog="build.py") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("build.py: error: ") and message in err
    assert not (tmp_path / "work").exists()  # refused before any work


def test_threads_below_one_is_an_argparse_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_options.parse_args(["--threads", "0"])
    assert exit_info.value.code == 2 and "argument --threads: must be >= 1, got 0" in capsys.readouterr().err


def test_a_second_build_into_the_same_folder_refuses_with_one_line(tiny_base_dir, tmp_path, capsys):
    import os

    from streamfuse.runtime.commands import errors
    from streamfuse.training.lock import FolderBusy, exclusive

    out = tmp_path / "artifact"
    with exclusive(out):
        with pytest.raises(FolderBusy, match=rf"being written by another build \(pid {os.getpid()}\)"):
            with exclusive(out):
                pass
        argv = [
            "--preset",
            "smoke",
            "--base-model",
            str(tiny_base_dir),
            "--work-dir",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ]
        assert errors.run(build.main, argv, prog="build.py") == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("build.py: error: ") and "being written by another build" in err and "--out" in err
    with exclusive(out):  # released with its holder
        pass


def test_the_streamfuse_build_command_runs_the_training_build(tmp_path):
    """`streamfuse build` is the documented command: the console script runs this module's main with the same
    arguments (and its exit status)."""
    import subprocess
    import sys

    command = [str(Path(sys.executable).with_name("streamfuse")), "build"]
    done = subprocess.run(
        [*command, "--print-config", "--preset", "smoke", "--task", "e2e_nlg"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["task"] == "e2e_nlg"
    bad = subprocess.run([*command, "--preset", "nope"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and "streamfuse build: error: argument --preset: invalid choice: 'nope'" in bad.stderr
