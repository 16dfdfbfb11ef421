"""tools/peers.py: peer baselines give streamfuse's plain greedy tokens on the same model and inputs."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from streamfuse.runtime.request.api import Model
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.frontend import DEFAULT_TREE
from streamfuse.runtime.request.inputs import prompt_ids
from streamfuse.runtime.request.inputs import read_input_file as read_requests
from streamfuse.runtime.request.loader import load
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.tree import TreeSpec
from streamfuse.tools import peers, peers_gguf
from streamfuse.tools.peer_registry import PEERS, available, build_peers
from streamfuse.tools.peers_runners import PeerContext, cut_at_stop, hf_model

MAX_NEW = 16
REAL_CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints" / "dialogsum-cpu" / "ss"
REAL_INPUTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "dialogsum" / "dialogsum.test.jsonl"


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load(checkpoint / "ckpt")


@pytest.fixture(scope="module")
def prompts(checkpoint, loaded):
    requests = read_requests(checkpoint / "data" / "dialogsum.test.jsonl", loaded, True, 3)
    return [prompt_ids(loaded, r.text, True) for r in requests]


def plain_tokens(loaded, ids, max_new=MAX_NEW):
    settings = DecodeSettings("ar", StopRules(max_new, loaded.stop_token_ids), tree=TreeSpec.parse(DEFAULT_TREE))
    return Model(loaded).run(ids, settings=settings).token_ids


@pytest.mark.parametrize("name", ["hf", "hf_pld", "hf_assisted"])
def test_hf_peers_equal_streamfuse_plain_greedy(checkpoint, loaded, prompts, name):
    runners, skipped = build_peers([name], PeerContext(loaded, checkpoint / "ckpt", threads=1))
    assert skipped == {} and runners[name].name == name
    lengths, verified = [], []  # tokens per target call; > 1 after the prefill: a draft was verified
    hook = hf_model(loaded).register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        for ids in prompts:
            lengths.clear()
            result = runners[name].run(ids, MAX_NEW)
            verified += lengths[1:]
            assert result.token_ids == plain_tokens(loaded, ids)
            assert result.new_tokens == len(result.token_ids) == MAX_NEW  # the random model never says EOS here
            assert 0 < result.ttft_s < result.seconds
    finally:
        hook.remove()
    assert (max(verified) > 1) == (name != "hf")  # the speculative peers did draft


def test_cut_at_stop_is_streamfuse_stop_rule():
    assert cut_at_stop([5, 6, 2, 7], (2,), 10) == [5, 6, 2]
    assert cut_at_stop([5, 6, 2, 7], (2,), 2) == [5, 6]
    assert cut_at_stop([], (2,), 3) == []


def test_missing_llama_cpp_is_skipped_with_reason(checkpoint, loaded, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    reasons = available()
    assert reasons["hf"] is None and reasons["hf_pld"] is None
    assert "llama-cpp-python" in reasons["llamacpp_f32"] and "llama-cpp-python" in reasons["llamacpp_base_q4_1_pld"]
    runners, skipped = build_peers(["llamacpp_f32", "hf"], PeerContext(loaded, checkpoint / "ckpt", 1))
    assert list(runners) == ["hf"] and "llama-cpp-python" in skipped["llamacpp_f32"]


def test_base_gguf_peer_needs_the_bundled_base(checkpoint, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "llama_cpp" else real(name, *a)
    )
    reasons = available(checkpoint / "ckpt")  # the tiny checkpoint's base is a local folder
    assert "no bundled GGUF" in reasons["llamacpp_base_q4_1"] and reasons["llamacpp_f32"] is None
    assert "no bundled GGUF" in reasons["llamacpp_q4_1_lora_pld"]


FAKE_CONVERTER = """import json, sys
from pathlib import Path
args = sys.argv[1:]
if Path(args[0]).parts[-3] == "fail":
    sys.exit("no LoRA tensors found")
out = Path(args[args.index("--outfile") + 1])
config = json.loads((Path(args[args.index("--base") + 1]) / "config.json").read_text())
out.write_text(json.dumps({"lora": args[0], "hidden_size": config["hidden_size"], "outtype": args[-1]}))
"""


def test_lora_adapter_is_converted_once_from_the_checkpoints_lora(checkpoint, loaded, tmp_path, monkeypatch):
    converter = tmp_path / "llama.cpp"
    converter.mkdir()
    (converter / "convert_hf_to_gguf.py").write_text("")
    (converter / "convert_lora_to_gguf.py").write_text(FAKE_CONVERTER)
    monkeypatch.setenv("STREAMFUSE_LLAMA_CPP_DIR", str(converter))
    monkeypatch.setenv("STREAMFUSE_CACHE", str(tmp_path / "cache"))
    config = hf_model(loaded).config
    path = peers_gguf.export_lora_gguf(config, checkpoint / "ckpt")
    assert path == peers_gguf.lora_gguf_path(checkpoint / "ckpt") and path.name == "lora-f32.gguf"
    made = json.loads(path.read_text())
    assert made == {"lora": str(checkpoint / "ckpt" / "lora"), "hidden_size": config.hidden_size, "outtype": "f32"}
    assert [p.name for p in path.parent.iterdir()] == ["lora-f32.gguf"]  # the temp base folder is gone
    (converter / "convert_lora_to_gguf.py").write_text("raise SystemExit(3)")
    assert peers_gguf.export_lora_gguf(config, checkpoint / "ckpt") == path  # cached: not converted again
    failing = shutil.copytree(checkpoint / "ckpt", tmp_path / "fail" / "ckpt")
    adapter = next((failing / "lora").glob("*.safetensors"))
    adapter.write_bytes(adapter.read_bytes() + b" ")  # another LoRA: another cache key
    (converter / "convert_lora_to_gguf.py").write_text(FAKE_CONVERTER)
    with pytest.raises(RuntimeError, match="no LoRA tensors found"):
        peers_gguf.export_lora_gguf(config, failing)
    assert not peers_gguf.lora_gguf_path(failing).exists()


def test_gguf_cache_key_follows_training_key_and_weights(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMFUSE_CACHE", str(tmp_path / "cache"))
    ckpt = shutil.copytree(checkpoint / "ckpt", tmp_path / "ckpt")
    untracked = peers_gguf.artifact_key(ckpt)
    assert untracked.startswith("untracked-")
    manifest = json.loads((ckpt / "streamfuse.json").read_text())
    manifest["info"]["training_key"] = "abc123-ss"
    (ckpt / "streamfuse.json").write_text(json.dumps(manifest))
    tracked = peers_gguf.artifact_key(ckpt)
    assert tracked.startswith("abc123-ss-")
    adapter = next((ckpt / "lora").glob("*.safetensors"))
    adapter.write_bytes(adapter.read_bytes() + b" ")  # retrained weights, same settings
    assert peers_gguf.artifact_key(ckpt) != tracked
    path = peers_gguf.gguf_path(ckpt, "q8_0")
    assert path == tmp_path / "cache" / "peers-gguf" / peers_gguf.artifact_key(ckpt) / "model-q8_0.gguf"
    with pytest.raises(ValueError, match="choose one of"):
        peers_gguf.gguf_path(ckpt, "q3_k")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"GGUF")
    assert peers_gguf.export_gguf(None, None, ckpt, "q8_0", 1) == path  # cached: nothing is converted


def test_cli_writes_report_and_skips_with_reasons(checkpoint, tmp_path):
    out = tmp_path / "peers"
    code = peers.main(
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
            "6",
            "--threads",
            "1",
            "--peers",
            "hf,hf_pld,llamacpp_base_q4_1",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads((out / "peers.json").read_text())
    assert report["inputs"] == 2 and set(report["summary"]) == {"streamfuse_ar", "hf", "hf_pld"}
    assert "llamacpp_base_q4_1" in report["skipped"]
    for name in ("hf", "hf_pld"):
        assert report["summary"][name]["same_tokens_as_reference"] == 2
    assert report["machine"]["threads"] == 1 and report["machine"]["omp_wait_policy"] == "PASSIVE"
    assert len(report["machine"]["load_average_end"]) == 3
    assert "Skipped llamacpp_base_q4_1" in (out / "peers.md").read_text()


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed (extra 'bench')"
)
@pytest.mark.skipif(
    not REAL_CHECKPOINT.is_dir() or not REAL_INPUTS.is_file(), reason="needs `make build` output and ../shared/data"
)
def test_llamacpp_f32_on_the_real_checkpoint():
    import torch

    real = load(REAL_CHECKPOINT)
    ids = prompt_ids(real, next(read_requests(REAL_INPUTS, real, True, 1)).text, True)
    runners, skipped = build_peers(["llamacpp_f32", "llamacpp_f32_pld"], PeerContext(real, REAL_CHECKPOINT, 2))
    assert skipped == {}
    try:
        plain = runners["llamacpp_f32"].run(ids, 32)
        assert runners["llamacpp_f32_pld"].run(ids, 32).token_ids == plain.token_ids  # lossless drafting
    finally:
        for runner in runners.values():
            runner.close()
    reference = plain_tokens(real, ids, 32)
    # Both f32, different kernels: the outputs may part only where torch's top two logits nearly tie
    # (this dialogue: "asks" 25.0090 vs "tells" 25.0075 at token 3).
    split = next((i for i, (a, b) in enumerate(zip(plain.token_ids, reference)) if a != b), None)
    if split is not None:
        with torch.inference_mode():
            logits = hf_model(real)(torch.tensor([ids + reference[:split]])).logits[0, -1]
        assert logits[reference[split]] - logits[plain.token_ids[split]] < 0.05


def test_exported_artifact_resolves_to_its_adapter_checkpoint(checkpoint, tmp_path):
    from streamfuse.runtime.artifact.format import file_digest, write_manifest

    artifact = tmp_path / "artifact"
    shutil.copytree(checkpoint / "ckpt", artifact / "adapter")
    manifest = json.loads((Path(__file__).parent / "fuzz/manifest/seeds/tiny_onnx.json").read_text())
    manifest["adapter"].update(file_digest(artifact / "adapter"))  # a tiny artifact's manifest, this adapter's digest
    write_manifest(artifact, manifest)
    assert peers_gguf.checkpoint_dir(artifact) == artifact / "adapter"
    assert peers_gguf.artifact_key(artifact) == peers_gguf.artifact_key(checkpoint / "ckpt")
    with pytest.raises(FileNotFoundError, match="neither streamfuse.json nor manifest.json"):
        peers_gguf.checkpoint_dir(tmp_path)


class CountingProgram:
    """A stand-in for optimum's .pte: the next token is (last id + its position + 1) % 50, and every
    call's inputs are kept, so the runner's positions and stop rule can be read back."""

    class Meta:
        def output_tensor_meta(self, index):
            return type("T", (), {"sizes": lambda self: [1, 1, 50]})()

    def __init__(self):
        self.calls = []

    def method_meta(self, name):
        return self.Meta()

    def forward(self, inputs):
        import torch

        ids, positions = inputs
        self.calls.append((ids[0].tolist(), positions.tolist()))
        logits = torch.zeros(1, ids.shape[1], 50)
        logits[0, torch.arange(ids.shape[1]), (ids[0] + positions + 1) % 50] = 1.0
        return [logits]


@pytest.mark.parametrize("stop, expected", [((), [9, 13, 18]), ((13,), [9, 13])])
def test_optimum_executorch_runner_prefills_then_decodes_one_position_at_a_time(stop, expected):
    from streamfuse.tools.peers_optimum import OptimumExecuTorchRunner

    program = CountingProgram()
    runner = OptimumExecuTorchRunner("optimum", program, stop, max_seq_len=16)
    result = runner.run([4, 2, 6], 3)
    assert result.token_ids == expected and result.new_tokens == len(expected)
    assert program.calls[0] == ([4, 2, 6], [0, 1, 2])  # the prompt in one call
    assert [c[1] for c in program.calls[1:]] == [[3 + i] for i in range(len(expected) - 1)]
    with pytest.raises(ValueError, match="exceed the .pte's max_seq_len 16; pass a larger --n-ctx"):
        runner.run(list(range(14)), 3)


def test_the_optimum_peer_is_listed_needs_executorch_and_is_labelled_8da4w():
    from streamfuse.tools.bench_setup import peer_precision

    assert PEERS["optimum_executorch_8da4w"].requires == ("executorch",)
    assert [peer_precision(n) for n in ("optimum_executorch_8da4w", "llamacpp_q4_1_pld", "hf_pld")] == [
        "8da4w",
        "q4_1",
        "fp32",
    ]
