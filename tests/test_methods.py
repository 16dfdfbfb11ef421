"""runtime/methods/registry.py: one registry of decoding methods; a new one is a folder (or a module) and a
registry line."""

import dataclasses
import json
import subprocess
import sys
import types

import pytest

from streamfuse.runtime.commands import generate
from streamfuse.runtime.methods import registry
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.tree import TreeSpec
from streamfuse.tools import bench, profiler

# method -> (speculative, drafts from the streams, drafts a chain, takes a threshold, artifact entries)
BUILT_IN = {
    "ar": (False, False, False, False, ()),
    "ss": (True, True, False, False, ()),
    "sd": (True, False, True, False, ("sd",)),
    "medusa": (True, False, False, False, ("medusa",)),
    "specdec++": (True, False, True, True, ("sd", "specdec++")),
    "ss-adaptive": (True, True, False, False, ("ss-adaptive",)),
    "pearl": (True, False, True, False, ("sd",)),
    "parallelspec": (True, False, False, False, ("parallelspec",)),
    "falcon": (True, False, False, False, ("falcon",)),
}


def test_the_registry_declares_the_nine_methods():
    assert registry.names() == tuple(BUILT_IN)
    for name, row in BUILT_IN.items():
        method = registry.get(name)
        assert (method.speculative, method.streams, method.chain, method.threshold, method.artifact_entries) == row
        assert (method.build_flags is None) == (not method.artifact_entries), name
    assert (registry.plain(), registry.default()) == ("ar", "ss")


def test_each_method_is_a_folder_whose_torch_code_is_a_part():
    """A method's runtime modules import no torch; its torch pass is found as a part of its folder."""
    code = (
        "import sys; from streamfuse.runtime.methods import registry; registry.names(); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('streamfuse.adapters')))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
    parts = {name: registry.part(name, "torch_pass") for name in registry.names()}
    assert {name for name, part in parts.items() if part is not None} == {"medusa", "parallelspec", "falcon"}


# bench --methods variants: label value -> the settings fields, or the error
VARIANTS = [
    ("sd", "3", {"tree": TreeSpec.chain(3)}),
    ("sd", "0", "G >= 1"),
    ("sd", "x", "G >= 1"),
    ("pearl", "6", {"tree": TreeSpec.chain(6)}),
    ("parallelspec", "3-2-1-1", {"tree": TreeSpec(((0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0)))}),
    ("parallelspec", "2-0", "children per depth >= 1"),
    ("parallelspec", "2,1", "children per depth >= 1"),
    ("falcon", "2-1", {"tree": TreeSpec(((0,), (1,), (0, 0)))}),
    ("medusa", "2-1", {"tree": TreeSpec(((0,), (1,), (0, 0)))}),
    ("specdec++", "0.25", {"threshold": 0.25}),
    ("specdec++", "1.5", "0 <= H <= 1"),
]


@pytest.mark.parametrize("name, value, expected", VARIANTS)
def test_variants_parse_their_value(name, value, expected):
    if isinstance(expected, dict):
        assert registry.get(name).variant(value) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            registry.get(name).variant(value)


def test_an_unknown_method_and_a_misplaced_threshold_are_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match="method must be one of ar, ss"):
        DecodeSettings("nope", StopRules(4))
    with pytest.raises(ValueError, match="SpecDec\\+\\+'s, not method sd's"):
        DecodeSettings("sd", StopRules(4), tree=TreeSpec.chain(2), threshold=0.5)
    clash = types.ModuleType("clash")  # a package that declares a built-in method's name again
    clash.METHOD = dataclasses.replace(registry.get("ss"), label="another")
    monkeypatch.setitem(sys.modules, "clash", clash)
    with pytest.raises(ValueError, match="registered already"):
        registry.register_package("clash")


@pytest.fixture
def with_toy(monkeypatch):
    registry.names()  # the built-in methods, loaded
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))  # the registry as it was, after the test
    monkeypatch.setattr(registry, "_PACKAGES", dict(registry._PACKAGES))
    registry.register_package("toy_method")  # the one registry line
    assert registry.part("toy-repeat", "torch_pass") is None  # a module, not a folder: no parts


def test_a_method_added_in_one_file_runs_through_generate_bench_and_the_profiler(
    with_toy, checkpoint, tmp_path, capsys
):
    common = ["--artifact", str(checkpoint / "ckpt"), "--prompt", "hello world", "--max-new-tokens", "10", "--json"]
    assert generate.main([*common, "--method", "ar"]) == 0
    plain = json.loads(capsys.readouterr().out)
    trace = tmp_path / "toy.json"
    assert generate.main([*common, "--method", "toy-repeat", "--trace", str(trace)]) == 0
    toy = json.loads(capsys.readouterr().out)
    assert toy["token_ids"] == plain["token_ids"] and toy["method"] == "toy-repeat"
    assert toy["model_calls"] <= plain["model_calls"]

    out = tmp_path / "bench"
    assert (
        bench.main(
            [
                "--artifact",
                str(checkpoint / "ckpt"),
                "--task",
                "dialogsum",
                "--input-file",
                str(checkpoint / "data" / "dialogsum.test.jsonl"),
                "--limit",
                "2",
                "--warmup",
                "1",
                "--max-new-tokens",
                "8",
                "--threads",
                "1",
                "--methods",
                "ar,toy-repeat",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads((out / "bench.json").read_text())
    assert len(report["rows"]) == 2 and all(row["same_tokens"] for row in report["rows"])
    assert all(row["toy-repeat"]["token_ids"] == row["ar"]["token_ids"] for row in report["rows"])
    assert json.loads((out / "trace_toy-repeat.json").read_text())["runs"]

    assert profiler.main([str(trace), "--out", str(tmp_path / "profile")]) == 0
    profile = json.loads((tmp_path / "profile" / "profile.json").read_text())
    assert profile["call_reduction"] == pytest.approx(toy["new_tokens"] / toy["model_calls"])
