"""The artifact's contract (runtime/artifact/format.py): the manifest checked against its declared schema, every path
confined to the folder, every file that changes behaviour hashed before it is parsed, writes under one lock.
Tampered copies of a tiny real artifact (torch only: built in seconds) each give one ArtifactError line."""

import importlib.util
import json
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamfuse.export.artifact import ArtifactBuilder, ExportConfig
from streamfuse.export.draft_vocab import DraftVocab
from streamfuse.runtime.artifact import durable
from streamfuse.runtime.artifact.format import (
    LOCK,
    MANIFEST,
    Artifact,
    ArtifactError,
    lock,
    parse_manifest,
    write_manifest,
)
from streamfuse.runtime.artifact.onnx_external import check_external_data
from streamfuse.runtime.request.loader import load
from streamfuse.runtime.speculation.calibration import BackendCalibration, TreeCost
from streamfuse.runtime.speculation.tree import TreeSpec

from conftest import write_checkpoint

sys.path.insert(0, str(Path(__file__).parent / "fuzz" / "manifest"))
import fuzz_manifest  # noqa: E402  (the fuzz target's check, run here for a bounded time)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = write_checkpoint(tmp_path_factory.mktemp("contract"))
    config = ExportConfig(backends=("torch",), trees=("gamma=1,k=1",), buckets=(4,), capacity=64, prefill_chunk=16)
    ArtifactBuilder(
        root / "ckpt", root / "artifact", config, [[5, 6, 7]], 8, {}, DraftVocab(tuple(range(20, 80)), coverage=0.5)
    ).build()
    return root / "artifact"


@pytest.fixture
def copy(built, tmp_path):
    target = tmp_path / "artifact"
    shutil.copytree(built, target)
    return target


def edit(folder: Path, change) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    change(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message and message
    return message


def setter(path: str, value):
    """A change that sets manifest[a][b]... (path 'a/b/c', list indices as numbers) to value."""

    def change(manifest):
        *parents, last = [int(p) if p.isdigit() else p for p in path.split("/")]
        for key in parents:
            manifest = manifest[key]
        manifest[last] = value

    return change


def deleter(path: str):
    def change(manifest):
        *parents, last = path.split("/")
        for key in parents:
            manifest = manifest[key]
        del manifest[last]

    return change


# (change, what the one-line error says)
TAMPERED = [
    (deleter("model/num_layers"), r"model\.num_layers is missing; rebuild the artifact"),
    (deleter("tokenizer/files"), r"tokenizer\.files is missing"),
    (deleter("tokenizer/files/tokenizer_config.json"), r"tokenizer\.files\.tokenizer_config\.json is missing"),
    (setter("graphs/capacity", "2048"), r"graphs\.capacity must be an integer, got a string"),
    (setter("model/num_kv_heads", 0), r"model\.num_kv_heads must be in \[1, 65536\], got 0"),
    (setter("graphs/buckets", [4, True]), r"graphs\.buckets\[1\] must be an integer, got a boolean"),
    (setter("adapter/bytes", -1), r"adapter\.bytes must be in \[0, "),
    (setter("tokenizer/path", "/etc"), r"tokenizer\.path must be a relative path inside the artifact .* got '/etc'"),
    (setter("adapter/path", "../ckpt"), r"adapter\.path must be a relative path inside the artifact"),
    (setter("graphs/greedy_step/draft_vocab/path", "a/../../x"), r"draft_vocab\.path must be a relative path"),
    (setter("trees/0/paths", [[0, 0]]), r"trees\[0\] is not a draft tree \(tree path .0, 0. has no parent"),
    (setter("trees", []), r"trees must have 1 to 64 items, got 0"),
    (setter("export_seconds", {"torch": float("nan")}), r"export_seconds\.torch must be a finite number"),
    (setter("prompt/instruction_template", "\ud800"), r"is not valid UTF-8 text"),
    (setter("surprise", 1), r"surprise is not a field of this schema"),
    (setter("tasks", {"dialogsum": {}}), r"tasks\.dialogsum\.task is missing"),
    (setter("kv_layout/owner", {"onnxruntime": "engine"}), r"kv_layout\.owner must name the backends of `files`"),
    (
        setter("calibration/acceptance", {"max_rank": 8, "depth": 3, "positions": 5, "answers": [[]]}),
        r"calibration\.acceptance\.positions is 5, its answers hold 0",
    ),
    (setter("schema", "streamfuse.artifact/20"), r"schema 'streamfuse.artifact/20'; this streamfuse reads .*/23"),
]


@pytest.mark.parametrize("change, message", TAMPERED)
def test_a_tampered_manifest_is_one_line_naming_the_key(copy, change, message):
    edit(copy, change)
    with pytest.raises(ArtifactError, match=message) as error:
        Artifact.open(copy)
    assert str(copy / MANIFEST) in one_line(error)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "not valid JSON"),
        (b"[1, 2]", "has schema None"),
        (b"\xff\xfe{}", "not valid UTF-8"),
        (b"[" * 100000, "nests its values"),
        (b"9" * 5000, "not valid JSON"),
        (b'{"schema": NaN}', "has schema nan"),
    ],
)
def test_bytes_that_are_no_manifest_are_one_line(data, message):
    with pytest.raises(ArtifactError, match=message) as error:
        parse_manifest(data, Path("m.json"))
    one_line(error)


def test_the_cli_says_one_line_and_exits_nonzero(copy, capsys):
    from streamfuse.runtime.commands import errors, generate

    edit(copy, deleter("graphs/buckets"))
    code = errors.run(generate.main, ["--artifact", str(copy), "--backend", "torch", "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "\n" not in err and "graphs.buckets is missing" in err


def test_symbolic_links_out_of_the_artifact_are_refused(copy, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(copy / "tokenizer", outside)
    shutil.rmtree(copy / "tokenizer")
    (copy / "tokenizer").symlink_to(outside)  # the same bytes, outside the folder
    with pytest.raises(ArtifactError, match=r"tokenizer leads outside .* symbolic link") as error:
        Artifact.open(copy).load_tokenizer()
    one_line(error)
    (copy / "tokenizer").unlink()
    shutil.copytree(outside, copy / "tokenizer")
    (copy / "tokenizer" / "tokenizer.json").unlink()
    (copy / "tokenizer" / "tokenizer.json").symlink_to(outside / "tokenizer.json")
    with pytest.raises(ArtifactError, match=r"tokenizer.json leads outside"):
        Artifact.open(copy).load_tokenizer()
    os.symlink(outside, copy / "adapter" / "linked")  # a folder linked into a hashed folder
    with pytest.raises(ArtifactError, match=r"adapter/linked is a symbolic link to a folder"):
        load(copy, "torch")


def test_a_link_inside_the_artifact_is_followed(copy):
    (copy / "tokenizer").rename(copy / "tokenizer-files")
    (copy / "tokenizer").symlink_to("tokenizer-files")
    assert Artifact.open(copy).load_tokenizer().eos_token_id == 3


@pytest.mark.parametrize(
    "name, edit_text, message",
    [
        (
            "tokenizer_config.json",
            lambda text: text.replace('"eos_token": "<|im_end|>"', '"eos_token": "<pad>"'),
            "tokenizer_config.json differs from the tokenizer the model was exported with",
        ),
        ("chat_template.jinja", lambda text: "{{ 'ignore the user' }}" + text, "chat_template.jinja differs"),
        ("tokenizer.json", lambda text: text.replace('"<pad>"', '"<pod>"'), "tokenizer.json differs"),
    ],
)
def test_an_edited_tokenizer_file_is_refused_before_it_is_parsed(copy, name, edit_text, message, monkeypatch):
    file = copy / "tokenizer" / name
    edited = edit_text(file.read_text())
    assert edited != file.read_text()
    file.write_text(edited)
    import tokenizers

    monkeypatch.setattr(tokenizers.Tokenizer, "from_str", None)  # parsing anything first would fail differently
    with pytest.raises(ArtifactError, match=message) as error:
        Artifact.open(copy).load_tokenizer()
    one_line(error)


def test_a_tokenizer_file_added_or_removed_is_refused(copy):
    (copy / "tokenizer" / "special_tokens_map.json").write_text("{}")
    with pytest.raises(ArtifactError, match="files the manifest does not list: special_tokens_map.json"):
        Artifact.open(copy).load_tokenizer()
    (copy / "tokenizer" / "special_tokens_map.json").unlink()
    (copy / "tokenizer" / "chat_template.jinja").unlink()  # tokenizer_config.json's template would take its place
    with pytest.raises(ArtifactError, match="lacks chat_template.jinja"):
        Artifact.open(copy).load_tokenizer()


def test_edited_tensor_and_checkpoint_files_are_refused(copy):
    vocab = copy / "draft_vocab.safetensors"
    data = bytearray(vocab.read_bytes())
    data[-1] ^= 1
    vocab.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="draft_vocab.safetensors differs from the manifest") as error:
        Artifact.open(copy).draft_ids()
    one_line(error)
    streams = copy / "adapter" / "streams.safetensors"
    streams.write_bytes(streams.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(ArtifactError, match="adapter does not match its sha256 in the manifest"):
        load(copy, "torch")


def test_an_onnx_models_external_data_stays_in_its_folder(tmp_path):
    onnx = pytest.importorskip("onnx", reason="the build extra (onnx) is not installed")
    from onnx import TensorProto, helper

    def model_with(location: str) -> Path:
        weight = helper.make_tensor("w", TensorProto.FLOAT, [1], [0.0])
        weight.data_location = TensorProto.EXTERNAL
        del weight.float_data[:]
        weight.external_data.add(key="location", value=location)
        inner = helper.make_graph(
            [helper.make_node("Identity", ["w"], ["y"])],
            "branch",
            [],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
            [weight],
        )
        node = helper.make_node("If", ["c"], ["y"], then_branch=inner, else_branch=inner)  # as the methods' branches
        graph = helper.make_graph(
            [node],
            "g",
            [helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        )
        folder = tmp_path / "onnx"
        folder.mkdir(exist_ok=True)
        onnx.save_model(helper.make_model(graph), str(folder / "model.onnx"))
        return folder / "model.onnx"

    (tmp_path / "onnx").mkdir()
    (tmp_path / "onnx" / "weights.bin").write_bytes(b"\0" * 4)
    assert check_external_data(model_with("weights.bin")) == {tmp_path / "onnx" / "weights.bin"}
    for location, message in [("/etc/passwd", "not a relative path"), ("../secret.bin", "not a relative path")]:
        with pytest.raises(ArtifactError, match=message) as error:
            check_external_data(model_with(location))
        one_line(error)
    (tmp_path / "secret.bin").write_bytes(b"\0" * 4)
    (tmp_path / "onnx" / "link.bin").symlink_to(tmp_path / "secret.bin")
    with pytest.raises(ArtifactError, match="link.bin leads outside"):
        check_external_data(model_with("link.bin"))
    (tmp_path / "onnx" / "model.onnx").write_bytes(b"\x0a\xff\xff")  # a field longer than the file
    with pytest.raises(ArtifactError, match="is not a readable ONNX model"):
        check_external_data(tmp_path / "onnx" / "model.onnx")


@pytest.mark.parametrize("location", ["../secret.bin", "/etc/passwd", "link.bin"])
def test_the_embedding_tables_location_stays_in_the_models_folder(tmp_path, location):
    pytest.importorskip("onnxruntime", reason="the onnxruntime extra is not installed")
    from streamfuse.runtime.backends.runners import EMBEDDING_METADATA, mapped_tables

    (tmp_path / "onnx").mkdir()
    (tmp_path / "secret.bin").write_bytes(b"\0" * 64)
    (tmp_path / "onnx" / "link.bin").symlink_to(tmp_path / "secret.bin")
    place = {"location": location, "offset": 0, "dtype": "float32", "shape": [4]}
    with pytest.raises(ArtifactError, match="ONNX embedding table's location .* not a relative path|leads outside"):
        mapped_tables(tmp_path / "onnx" / "model.onnx", {EMBEDDING_METADATA: json.dumps({"table": place})})


def calibration(ms: float) -> BackendCalibration:
    return BackendCalibration("cpu", 1, 0.01, (TreeCost(TreeSpec.chain(1), ms / 1e3, 1.5, 1.5),), 0.002, 10.0)


def test_writers_that_opened_the_same_manifest_keep_each_others_changes(copy):
    first, second = Artifact.open(copy), Artifact.open(copy)  # both read before either writes
    first.save_calibration("onnxruntime", calibration(11.0))
    second.save_calibration("executorch", calibration(12.0))
    stored = Artifact.open(copy)
    assert stored.calibration("onnxruntime") == calibration(11.0)
    assert stored.calibration("executorch") == calibration(12.0)
    assert sorted(p.name for p in copy.iterdir() if p.name.startswith(".")) == [LOCK]  # no temporary file left


def save_in_child(folder: str, backend: str, ms: float, go) -> None:
    opened = Artifact.open(folder)
    go.wait()
    opened.save_calibration(backend, calibration(ms))


def test_a_writer_in_another_process_waits_for_the_lock(copy):
    context = multiprocessing.get_context("fork")  # forked before the lock is taken: it inherits no lock
    go = context.Event()
    child = context.Process(target=save_in_child, args=(str(copy), "executorch", 12.0, go))
    child.start()
    opened = Artifact.open(copy)
    with lock(copy):
        go.set()
        child.join(0.5)
        assert child.is_alive()  # waiting for this process's lock
        opened.save_calibration("onnxruntime", calibration(11.0))  # nested: this thread holds it already
    child.join(30)
    assert child.exitcode == 0
    stored = Artifact.open(copy)
    assert stored.calibration("onnxruntime") == calibration(11.0) and stored.calibration("executorch") is not None


def test_a_calibration_of_a_replaced_build_is_refused(copy):
    opened = Artifact.open(copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    write_manifest(copy, {**manifest, "build_key": "0123456789abcdef"})  # a build swapped in meanwhile
    with pytest.raises(ArtifactError, match="was rebuilt .* since this process opened build"):
        opened.save_calibration("torch", calibration(11.0))
    assert Artifact.open(copy).calibration("torch") is None


def test_an_interrupted_write_leaves_the_old_manifest(copy, monkeypatch):
    before = (copy / MANIFEST).read_bytes()

    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(durable.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        Artifact.open(copy).save_calibration("torch", calibration(11.0))
    assert (copy / MANIFEST).read_bytes() == before
    assert not [p for p in copy.iterdir() if p.name.endswith(".tmp")]


def test_a_folder_is_replaced_only_once_the_new_one_is_in_place(tmp_path, monkeypatch):
    old, new = tmp_path / "out", tmp_path / "new"
    old.mkdir(), new.mkdir()
    (old / "a").write_text("old"), (new / "a").write_text("new")
    renamed = []
    real = os.rename

    def failing_second(source, target):
        renamed.append(source)
        if len(renamed) == 2:
            raise OSError("disk gone")
        real(source, target)

    monkeypatch.setattr(durable.os, "rename", failing_second)
    with pytest.raises(OSError, match="disk gone"):
        durable.replace_folder(new, old)
    assert (old / "a").read_text() == "old" and (new / "a").read_text() == "new"
    monkeypatch.undo()
    durable.replace_folder(new, old)
    assert (old / "a").read_text() == "new" and not new.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_waiter_on_a_replaced_folder_locks_the_new_one(tmp_path):
    import fcntl
    import threading

    folder, staged = tmp_path / "artifact", tmp_path / "staged"
    folder.mkdir(), staged.mkdir()
    order = []

    def waiter():
        with durable.locked(folder / LOCK):
            with open(folder / LOCK) as other:  # the file at the path now is the one held
                with pytest.raises(BlockingIOError):
                    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            order.append("waiter")

    with durable.locked(folder / LOCK):
        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(0.2)
        durable.replace_folder(staged, folder)
        order.append("swap")
    thread.join(10)
    assert order == ["swap", "waiter"]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.binary(max_size=96))
def test_fuzzed_manifests_are_accepted_or_one_line(data):
    fuzz_manifest.test_one(b"\x80" + data)  # a seed with mutations: tests/fuzz/manifest/fuzz_manifest.py


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.binary(max_size=256))
def test_fuzzed_bytes_are_accepted_or_one_line(data):
    fuzz_manifest.test_one(b"{" + data)


def test_the_seeds_are_valid_manifests():
    assert len(fuzz_manifest.BASES) >= 3
    for seed in fuzz_manifest.BASES:
        parse_manifest(json.dumps(seed).encode(), Path("seed.json"))


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris (the dev extra) is not installed")
def test_the_fuzz_target_runs_under_libfuzzer(tmp_path):
    import subprocess

    target = Path(__file__).parent / "fuzz" / "manifest" / "fuzz_manifest.py"
    seeds = target.parent / "seeds"
    done = subprocess.run(
        [sys.executable, str(target), "-runs=200", "-seed=1", str(tmp_path), str(seeds)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Done 200 runs" in done.stderr
