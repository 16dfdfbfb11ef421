"""The tools and command lines on an exported tiny artifact: memory, call times, soak, calibration, generate's
one-line errors, ONNX Runtime generation without torch (and from the wheel), the probe."""

import json
import math
import os
import pathlib
import shutil
import sys
import time

import pytest

from streamfuse.runtime.artifact.format import Artifact, ArtifactError
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.loader import load
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.sampling import SamplingConfig
from streamfuse.runtime.speculation.tree import TreeSpec

from tiny_export import CONFIG, EXPORTED, HERE, copy_of, manifest, needs, prompts


@needs("executorch", "onnxruntime")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tools.memory reads /proc")
def test_memory_tool_measures_each_engine_in_a_fresh_process(artifact, capsys, tmp_path):
    from streamfuse.tools import memory

    out = tmp_path / "memory.json"
    engines = "executorch,onnxruntime" + (",coreml" if "coreml" in HERE else "")
    assert (
        memory.main(
            [
                "--artifact",
                str(artifact),
                "--backends",
                engines,
                "--task",
                "dialogsum",
                "--limit",
                "1",
                "--threads",
                "1",
                "--max-new-tokens",
                "8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = {r["backend"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"executorch", "onnxruntime"}  # coreml: built, but not run on Linux
    data = manifest(artifact)
    cache = 2 * 4 * math.prod(data["kv_layout"]["shape"])  # keys and values, fp32
    for backend in ("executorch", "onnxruntime"):
        row = rows[backend]
        assert row["file_bytes"] == sum(f["bytes"] for f in data["files"][backend].values())
        assert row["kv_cache_allocated_bytes"] == cache and row["inputs"] == 1
        assert 0 < row["kv_cache_decoded_bytes"] <= cache and row["kv_cache_bytes"] <= row["kv_cache_decoded_bytes"]
        assert row["load_bytes"] > 0 and row["decode_peak_bytes"] >= row["load_bytes"]  # the peak holds the load
    assert "| executorch |" in capsys.readouterr().out
    for bad, message in ((["--backends", "bogus"], "not an exported backend"), (["--limit", "0"], "must be >= 1")):
        assert memory.main(["--artifact", str(artifact), *bad]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and /proc: Linux")
def test_resident_bytes_counts_the_pages_written_not_those_allocated():
    from streamfuse.runtime.backends.static_graph import lazy_zeros
    from streamfuse.tools.process_memory import resident_bytes

    page = os.sysconf("SC_PAGE_SIZE")
    cache = lazy_zeros((4 << 20,))  # 16 MiB in small pages (NumPy's own arrays this large take huge pages)
    assert resident_bytes(cache) == 0
    cache[: 3 * page // 4] = 1.0  # three pages' worth of floats
    assert resident_bytes(cache) == 3 * page
    cache[:: page // 4] = 1.0  # one float in every page
    assert resident_bytes(cache) == cache.nbytes


@needs("executorch", "onnxruntime")
def test_call_times_tool_times_every_decode_method_by_span(artifact, capsys, tmp_path):
    from streamfuse.runtime.commands import errors
    from streamfuse.tools import call_times

    out = tmp_path / "calls.json"
    methods = set(manifest(artifact)["graphs"]["methods"]) - {"prefill"}
    largest = max(manifest(artifact)["graphs"]["buckets"])
    commit = f"greedy_step_{largest}, commit {largest - 1}"  # the largest step, moving the rows it accepts
    for backend in ("executorch", "onnxruntime"):
        argv = [
            "--artifact",
            str(artifact),
            "--backend",
            backend,
            "--spans",
            f"{largest},20",
            "--rounds",
            "2",
            "--threads",
            "1",
        ]
        assert call_times.main([*argv, "--out", str(out)]) == 0
        data = json.loads(out.read_text())
        assert data["backend"] == backend and set(data["ms"]) == {str(largest), "20"}
        assert all(
            set(row) - methods == {commit} and methods <= set(row) and min(row.values()) > 0
            for row in data["ms"].values()
        )
    assert "greedy_step_" in capsys.readouterr().out
    graphs = manifest(artifact)["graphs"]
    most = graphs["capacity"] - max(graphs["buckets"])
    assert (
        errors.run(
            call_times.main,
            ["--artifact", str(artifact), "--backend", "executorch", "--spans", f"{largest},{most + 1}"],
            prog="call_times",
        )
        == 2
    )
    assert f"--spans must lie in [{largest}, {most}]" in capsys.readouterr().err
    assert (
        errors.run(
            call_times.main,
            ["--artifact", str(artifact), "--backend", "executorch", "--spans", "a,3"],
            prog="call_times",
        )
        == 2
    )
    assert "--spans takes slot counts" in capsys.readouterr().err


@pytest.mark.parametrize("backend", EXPORTED)
def test_a_thousand_generations_keep_memory_and_file_handles_flat(artifact, backend):
    from streamfuse.tools.soak import soak

    loaded = load(artifact, backend, threads=1)
    settings = DecodeSettings("ss", StopRules(6), tree=loaded.tree)
    result = soak(loaded, prompts(4, seed=8), settings, generations=1000, warmup=100)
    assert result.tokens >= 1000 and result.rss_after_warmup > 0
    assert result.passed(), result.to_dict()


@needs("onnxruntime")
def test_the_soak_catches_a_leak_of_memory_or_of_a_file(artifact, monkeypatch, tmp_path):
    from streamfuse.tools import soak

    loaded = load(artifact, "onnxruntime", threads=1)
    settings = DecodeSettings("ss", StopRules(2), tree=loaded.tree)
    real, kept = soak.Model.run, []  # every generation the soak drives goes through Model.run
    monkeypatch.setattr(soak.Model, "run", lambda *args, **kw: kept.append(bytearray(1 << 20)) or real(*args, **kw))
    leaking = soak.soak(loaded, prompts(2), settings, generations=120, warmup=20)
    grown = leaking.rss_end - leaking.rss_after_warmup
    assert grown >= 90 * 2**20  # the 100 MiB leaked after the warm-up show in RSS
    # Against this process's RSS (GBs in a full test run) 100 MiB may be under 2 %; in the tool's own
    # process it is far over. Judged at half the growth it caused, the leak fails the run.
    assert not leaking.passed(max_growth=0.5 * 100 * 2**20 / leaking.rss_after_warmup)
    kept.clear()
    handle = tmp_path / "handle"
    monkeypatch.setattr(soak.Model, "run", lambda *args, **kw: kept.append(open(handle, "a")) or real(*args, **kw))
    leaking = soak.soak(loaded, prompts(2), settings, generations=40, warmup=20)
    assert leaking.fds_end == leaking.fds_after_warmup + 20 and not leaking.passed()
    for file in kept:
        file.close()


class SlowRunner:
    """Methods made artificially expensive: calibration must notice."""

    def __init__(self, session, methods: set[str], seconds: float):
        self.session, self.name, self.methods, self.seconds = session, session.name, methods, seconds

    def run(self, method, inputs):
        if method in self.methods:
            time.sleep(self.seconds)
        return self.session.run(method, inputs)


def with_acceptance(artifact, tmp_path):
    """A copy whose manifest carries an acceptance model (the build measures one; the fixture has none)."""
    from test_calibration import MODEL

    copy = copy_of(artifact, tmp_path)
    data = manifest(copy)
    data["calibration"]["acceptance"] = MODEL.to_dict()
    (copy / "manifest.json").write_text(json.dumps(data))
    return copy


@needs("onnxruntime")
@pytest.mark.parametrize("slow", [0, 1])
def test_calibration_picks_the_other_tree_when_one_is_made_expensive(artifact, tmp_path, slow):
    from streamfuse.runtime.measure.timing import calibrate_backend

    from test_calibration import MODEL

    loaded = load(artifact, "onnxruntime", threads=1)
    rows = CONFIG.buckets[slow]
    loaded.backend.runner = SlowRunner(loaded.backend.runner, {f"greedy_step_{rows}", f"step_{rows}"}, 0.01)
    calibration = calibrate_backend(loaded, MODEL, prompts(2, seed=5), StopRules(12), "cpu", 1)
    candidates = bucket_candidates()
    assert [cost.tree for cost in calibration.trees] == candidates
    assert calibration.tree == candidates[1 - slow]
    assert calibration.step_cost(candidates[slow]) > calibration.step_cost(candidates[1 - slow]) + 1.0  # 10 ms, ~1 ms


@needs("onnxruntime")
@pytest.mark.parametrize("slow", [0, 1])
def test_calibration_runs_a_bucket_as_step_then_streams_where_its_greedy_step_is_slower(artifact, tmp_path, slow):
    from streamfuse.runtime.measure.timing import calibrate_backend

    from test_calibration import MODEL

    copy = with_acceptance(artifact, tmp_path)
    loaded = load(copy, "onnxruntime", threads=1)
    loaded.backend.runner = SlowRunner(loaded.backend.runner, {f"greedy_step_{CONFIG.buckets[slow]}"}, 0.01)
    calibration = calibrate_backend(loaded, MODEL, prompts(2, seed=5), StopRules(12), "cpu", 1)
    slowed = calibration.trees[slow]
    assert all(cost.other_seconds is not None for cost in calibration.trees)  # every tree timed both ways
    assert slowed.two_calls and slowed.other_seconds > slowed.step_seconds + 0.005
    assert not loaded.backend.two_calls  # timing leaves the backend as it found it
    Artifact.open(copy).save_calibration("onnxruntime", calibration)
    again = load(copy, "onnxruntime")
    assert not again.backend.one_call(slowed.tree)  # loading applies the choice
    assert again.backend.one_call(calibration.trees[1 - slow].tree) == (not calibration.trees[1 - slow].two_calls)
    assert load(copy, "onnxruntime", calibrated=False).backend.one_call(slowed.tree)


def bucket_candidates() -> list[TreeSpec]:
    """What calibration times on the exported engines: per bucket (4 and 15 rows), the acceptance model's best
    tree that fits it and not the smaller bucket: 3 nodes (2.0 tokens a step; a 4th node adds none), 6 (2.5)."""
    from test_calibration import MODEL

    best = MODEL.best_trees(15)
    return [best[3], best[6]]


@needs("executorch", "onnxruntime")
def test_the_calibrate_cli_records_the_choice_that_loading_then_uses(artifact, tmp_path, capsys):
    from streamfuse.runtime.commands.generate import main as generate
    from streamfuse.runtime.request.loader import fastest_backend
    from streamfuse.tools import calibrate

    copy = with_acceptance(artifact, tmp_path)
    assert fastest_backend(copy) == "executorch"  # no calibration yet: the CPU preference order
    for backend in ("onnxruntime", "executorch"):
        assert (
            calibrate.main(
                [
                    "--artifact",
                    str(copy),
                    "--backend",
                    backend,
                    "--limit",
                    "2",
                    "--max-new-tokens",
                    "8",
                    "--threads",
                    "1",
                ]
            )
            == 0
        )
    printed = capsys.readouterr().out
    assert "<- chosen" in printed and "written to" in printed
    opened = Artifact.open(copy)
    seconds = {}
    for backend in ("onnxruntime", "executorch"):
        calibration = opened.calibration(backend)
        assert [cost.tree for cost in calibration.trees] == bucket_candidates()
        assert all(cost.realised_tokens >= 1 and cost.step_seconds > 0 for cost in calibration.trees)
        assert all(cost.other_seconds is not None for cost in calibration.trees)  # greedy steps timed both ways
        loaded = load(copy, backend)
        assert loaded.tree == calibration.tree and loaded.calibration == calibration
        assert loaded.fallback(loaded.tree).step_cost == pytest.approx(calibration.step_cost(loaded.tree))
        assert calibration.prefill_seconds_per_token > 0 and calibration.prompt_tokens > 0
        answer = 1 + opened.acceptance.positions / len(opened.acceptance.answers)  # the validation answers' mean
        seconds[backend] = calibration.request_seconds(answer)
    assert fastest_backend(copy) == min(seconds, key=seconds.get)
    assert generate(["--artifact", str(copy), "--prompt", "hello", "--max-new-tokens", "6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"].startswith(fastest_backend(copy))


@needs("onnxruntime")
def test_an_unreadable_calibration_is_named_and_calibrating_again_replaces_it(artifact, tmp_path):
    from streamfuse.tools import calibrate

    copy = with_acceptance(artifact, tmp_path)
    data = manifest(copy)
    data["calibration"]["backends"]["onnxruntime"] = {"device": "a calibration of another format"}
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="calibration recorded for onnxruntime .*tools.calibrate"):
        load(copy, "onnxruntime")
    assert (
        calibrate.main(
            [
                "--artifact",
                str(copy),
                "--backend",
                "onnxruntime",
                "--limit",
                "1",
                "--max-new-tokens",
                "4",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    assert load(copy, "onnxruntime").calibration.tree in bucket_candidates()


def last_line(err: str) -> str:
    """stderr's last line, after any progress bar's carriage returns."""
    return err.rstrip("\n").split("\n")[-1].split("\r")[-1]


@pytest.mark.parametrize(
    "argv, status, message",
    [
        (["--backend", "onnxruntime", "--limit", "0"], 2, "--limit must be >= 1"),
        (["--backend", "onnxruntime", "--threads", "0"], 2, "--threads must be >= 1"),
        (["--backend", "onnxruntime", "--max-nodes", "1"], 2, "--max-nodes must be >= 2"),
        (["--backend", "onnxruntime"], 1, "has no acceptance model"),
    ],
)
@needs("onnxruntime")
def test_calibrate_bad_input_is_one_line(artifact, argv, status, message, capsys):
    from streamfuse.runtime.commands import errors
    from streamfuse.tools import calibrate

    assert errors.run(calibrate.main, ["--artifact", str(artifact), *argv], prog="calibrate") == status
    err = capsys.readouterr().err
    assert last_line(err).startswith("calibrate: error: ") and message in err and "Traceback" not in err


# Probes of an exported artifact: argv, how to break a copy of it -> exit status, stderr's line
ARTIFACT_PROBES = [
    (["--backend", "onnxruntime", "--tree", "gamma=2,k=4"], None, 2, "larger than the artifact's largest step graph"),
    (["--backend", "coreml"], None, 1, "macOS only"),
    (["--backend", "onnxruntime"], "manifest", 1, "manifest.json is not valid JSON"),
    (["--backend", "executorch"], "pte", 1, "model.pte has"),
    (["--backend", "onnxruntime", "--method", "sd"], None, 2, "has no drafter for it"),
]


@pytest.mark.parametrize("argv, broken, status, message", ARTIFACT_PROBES, ids=[p[3] for p in ARTIFACT_PROBES])
@needs("executorch", "onnxruntime", "coreml")
def test_generate_on_a_bad_artifact_or_tree_is_one_line(artifact, tmp_path, capsys, argv, broken, status, message):
    from streamfuse.runtime.commands import errors
    from streamfuse.runtime.commands.generate import main as generate

    folder = copy_of(artifact, tmp_path) if broken else artifact
    if broken:
        victim = folder / ("manifest.json" if broken == "manifest" else "model.pte")
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    assert errors.run(generate, ["--artifact", str(folder), "--prompt", "the water", *argv], prog="generate") == status
    err = capsys.readouterr().err
    assert last_line(err).startswith("generate: error: ") and message in err and "Traceback" not in err, err


# A device app's generation: the artifact's ONNX model, its tokenizer and the decode loop, through
# tools/footprint.py (generate's output, then the process's footprint). It must not load torch,
# Transformers or the training code (the default artifact's run is the same code on a larger model).
def generate_without_torch(python: str, artifact, temperature: str, cwd) -> list[dict]:
    import subprocess

    records = []
    for method in ("ss", "ar"):
        done = subprocess.run(
            [
                python,
                "-m",
                "streamfuse.tools.footprint",
                "--artifact",
                str(artifact),
                "--backend",
                "onnxruntime",
                "--prompt",
                "hello world",
                "--max-new-tokens",
                "6",
                "--json",
                "--method",
                method,
                "--temperature",
                temperature,
            ],
            capture_output=True,
            text=True,
            cwd=cwd,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        record, footprint = map(json.loads, done.stdout.strip().splitlines())
        assert footprint["heavy_modules"] == [] and footprint["status"] == 0, footprint
        records.append(record)
    return records


@needs("onnxruntime")
@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_onnxruntime_generation_loads_neither_torch_nor_transformers(artifact, tmp_path, temperature):
    """In a subprocess (this one has torch): ss and plain decoding, greedy and sampled; SS gives plain
    decoding's tokens when greedy, and the same tokens as the torch-loaded runtime here."""
    ss, plain = generate_without_torch(sys.executable, artifact, temperature, tmp_path)
    if temperature == "0":
        assert ss["token_ids"] == plain["token_ids"] and len(ss["token_ids"]) == 6
    loaded = load(artifact, "onnxruntime")
    from streamfuse.runtime.request.api import Model
    from streamfuse.runtime.request.inputs import prompt_ids

    ids = prompt_ids(loaded, "hello world", as_task=False)
    here = Model(loaded).run(
        ids,
        settings=DecodeSettings("ar", StopRules(6, loaded.stop_token_ids), sampling=SamplingConfig(float(temperature))),
    )
    assert here.token_ids == plain["token_ids"]


@needs("onnxruntime")
def test_the_wheel_with_only_its_onnxruntime_extra_decodes_an_artifact(artifact, tmp_path):
    """The package as a wheel in a fresh virtual environment with `streamfuse[onnxruntime]` alone (pip
    fetches what the base install and the extra need): generation runs from there."""
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[1]
    source = tmp_path / "source"
    source.mkdir()
    import tomllib

    folders = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    for folder in sorted({f.split("/")[0] for f in folders} - {"."}):  # the package's folders, as the wheel takes them
        shutil.copytree(root / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for path in [root / "pyproject.toml", root / "README.md", *root.glob("*.py")]:  # and its root modules
        shutil.copy2(path, source / path.name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)],
        check=True,
        cwd=tmp_path,
        timeout=600,
    )
    (wheel,) = (tmp_path / "dist").glob("streamfuse-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    subprocess.run(
        [python, "-m", "pip", "--disable-pip-version-check", "-q", "install", f"{wheel}[onnxruntime]"],
        check=True,
        timeout=900,
    )
    found = subprocess.run(
        [python, "-c", "import importlib.util as u; print([m for m in ('torch', 'transformers') if u.find_spec(m)])"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.strip() == "[]"  # the environment has neither: the run below cannot load them
    ss, plain = generate_without_torch(python, artifact, "0", tmp_path)
    assert ss["token_ids"] == plain["token_ids"]


@needs("onnxruntime")
def test_probe_gives_one_line_errors_and_catches_a_bad_input_accepted(artifact):
    """tools/probe.py's tampered copies on the tiny artifact (the real one: its command in docs/export.md), and a
    case that expects an error from a well-formed request: the probe must report that as a failure."""
    from streamfuse.tools.probe import Case, probe

    lenient = Case("a well-formed request taken for a bad one", ("--prompt", "Hi", "--max-new-tokens", "2"))
    outcomes = probe(artifact, "onnxruntime", only="manifest", extra=(lenient,))
    failed = {o.case: o.message for o in outcomes if not o.passed}
    assert failed == {lenient.name: "accepted a bad input"}, failed
    assert len(outcomes) >= 6
