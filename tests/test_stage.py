"""training/stage.py: a stage's key, and the one decision to reuse its folder or make it again."""

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from streamfuse.training.stage import OutputFormat, Stage, content_key, recipe


def read(directory: Path) -> dict:
    manifest = json.loads((directory / "out.json").read_text())
    if manifest["version"] != 1:
        raise ValueError("another format")
    return manifest


FORMAT = OutputFormat("out.json", read)


def writer(calls: list, info: dict | None = None, fail: bool = False):
    """A run that writes a payload, then its manifest (recording the key), or fails halfway."""

    def run(folder: Path, stage: Stage) -> str:
        calls.append(folder)
        assert folder.is_dir() and not any(folder.iterdir()) and folder.parent == stage.directory.parent
        (folder / "payload").write_text(str(len(calls)))
        if fail:
            raise RuntimeError("interrupted")
        manifest = {"version": 1, "info": {"training_key": stage.key, **(info or {})}}
        (folder / "out.json").write_text(json.dumps(manifest))
        return f"made {len(calls)}"

    return run


def stage(tmp_path: Path, run, inputs: dict | None = None, **kwargs) -> Stage:
    return Stage("toy", tmp_path / "toy", "toy", inputs or {"a": 1}, FORMAT, run, **kwargs)


def test_the_key_is_the_inputs_hash_and_its_value_is_pinned():
    # Cached checkpoints and heads are found by these values: a change here retrains every build's stages.
    assert content_key({"b": [1, 2], "a": {"x": None}}, "sd") == content_key({"a": {"x": None}, "b": [1, 2]}, "sd")
    assert content_key({"a": 1}, "sd") == "f9d86028c6e0d64e-sd"
    assert content_key({"a": 1}, "medusa").endswith("-medusa") and content_key({"a": 2}, "sd") != "f9d86028c6e0d64e-sd"


def test_recipe_leaves_out_enabled_and_the_runtime_choices():
    @dataclass(frozen=True)
    class Section:
        enabled: bool = True
        epochs: float = 1.0
        threshold: float = 0.5

    assert recipe(Section(), "threshold") == {"epochs": 1.0}
    assert recipe(Section()) == {"epochs": 1.0, "threshold": 0.5}


def test_a_stage_runs_once_then_reuses_and_runs_again_when_its_inputs_change(tmp_path, capsys):
    calls = []
    first = stage(tmp_path, writer(calls))
    assert first.output() == tmp_path / "toy" and (tmp_path / "toy" / "payload").read_text() == "1"
    assert first.output() == tmp_path / "toy" and len(calls) == 1
    out = capsys.readouterr().out
    assert f"[toy] made 1 -> {tmp_path / 'toy'}" in out and f"[toy] reusing {tmp_path / 'toy'} (same settings)" in out
    stage(tmp_path, writer(calls), {"a": 2}).output()
    assert len(calls) == 2 and (tmp_path / "toy" / "payload").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toy"]  # no staging or set-aside folder left


def test_an_interrupted_run_leaves_the_previous_output_and_no_partial_one(tmp_path):
    calls = []
    stage(tmp_path, writer(calls)).output()
    with pytest.raises(RuntimeError, match="interrupted"):
        stage(tmp_path, writer(calls, fail=True), {"a": 2}).output()
    assert (tmp_path / "toy" / "payload").read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == ["toy"]
    stage(tmp_path, writer(calls)).output()
    assert len(calls) == 2  # the old output is still the first inputs' own


def test_scratch_is_kept_across_failures_and_removed_once_the_output_is_in_place(tmp_path):
    calls = []

    def resumable(folder: Path, stage: Stage) -> str:
        stage.scratch.mkdir(exist_ok=True)
        (stage.scratch / "step").write_text("kept")
        return writer(calls, fail=not calls)(folder, stage)

    with pytest.raises(RuntimeError):
        stage(tmp_path, resumable).output()
    made = stage(tmp_path, resumable)
    assert made.scratch == tmp_path / f"toy-{made.key}.snapshot" and (made.scratch / "step").is_file()
    made.output()
    assert not made.scratch.exists() and len(calls) == 2


def test_an_output_of_another_format_or_other_upstream_weights_is_made_again(tmp_path):
    calls = []
    stage(tmp_path, writer(calls, {"first": {"weights": "w1"}})).output()
    assert stage(tmp_path, writer(calls), made_from={"first": "w1"}).reusable()
    assert not stage(tmp_path, writer(calls), made_from={"first": "w2"}).reusable()
    stage(tmp_path, writer(calls)).output()  # same key: reused, and it records no upstream weights
    assert len(calls) == 1
    manifest = tmp_path / "toy" / "out.json"
    manifest.write_text(json.dumps({"version": 1, "info": json.loads(manifest.read_text())["info"] | {"first": {}}}))
    assert stage(tmp_path, writer(calls), made_from={"first": "w2"}).reusable()  # an output that records no weights
    manifest.write_text(json.dumps({"version": 0, "info": {}}))
    assert FORMAT.info(tmp_path / "toy") == {} and not stage(tmp_path, writer(calls)).reusable()
