"""Shared fixtures: tiny random Llama models with fixed seeds (hidden 32, 4 layers)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from filelock import FileLock

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ["QT_QPA_PLATFORM"] = "offscreen"  # before any Qt import (the demo's tests): no display in-process
torch.set_num_threads(min(2, torch.get_num_threads()))


def make_tiny_llama(seed: int = 0, layers: int = 4, vocab: int = 97, hidden: int = 32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.2,  # frozen tied embeddings need logits that can leave uniform
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def tiny_llama():
    return make_tiny_llama()


WORDS = (
    "<unk> <pad> <|im_start|> <|im_end|> user assistant system #Person1#: #Person2#: the a and to of is "
    "in it you i we he she they was for on with at by this that be have are not but what all "
    "were when there can an your which their said if do will each about how up out them then "
    "many some so these would other into has more her two like him see time could no make than "
    "first been its who now people my made over did down only way"
).split()


def make_tiny_tokenizer():
    """A whitespace word-level tokenizer with a ChatML-like template; vocabulary < 97."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(WORDS)}
    assert len(vocab) <= 97
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    return tokenizer


def write_tiny_dialogsum(directory, seed: int = 0, rows: int = 24):
    """DialogSum-format files whose summaries are a learnable function of the dialogue."""
    import json
    import random

    rng = random.Random(seed)
    content = WORDS[9:]
    directory.mkdir(parents=True, exist_ok=True)

    def row(index: int) -> tuple[str, str]:
        words = [rng.choice(content) for _ in range(6)]
        dialogue = f"#Person1#: {' '.join(words[:3])}\n#Person2#: {' '.join(words[3:])}"
        return dialogue, " ".join(["#Person1#:", *words[:3], "and", "#Person2#:", *words[3:]])

    for split, count in (("train", rows), ("dev", 8), ("test", 6)):
        with (directory / f"dialogsum.{split}.jsonl").open("w") as handle:
            for index in range(count):
                dialogue, summary = row(index)
                record = {"fname": f"{split}_{index}", "dialogue": dialogue, "topic": "t"}
                if split == "test":
                    record.update(
                        {
                            "summary1": summary,
                            "summary2": summary,
                            "summary3": summary,
                            "topic1": "t",
                            "topic2": "t",
                            "topic3": "t",
                        }
                    )
                else:
                    record["summary"] = summary
                handle.write(json.dumps(record) + "\n")
    with (directory / "dialogsum.train-unlabelled.jsonl").open("w") as handle:  # dialogues only
        for index in range(4):
            handle.write(json.dumps({"fname": f"unlabelled_{index}", "dialogue": row(index)[0]}) + "\n")
    return directory


def smoke_build_args(base, data, work, *extra: str) -> list[str]:
    """`streamfuse build`'s flags for the smoke preset on the tiny base and task data (tests/test_build*.py)."""
    return ["--task", "dialogsum", "--preset", "smoke", "--base-model", str(base), "--data-dir", str(data)] + [
        "--work-dir",
        str(work),
        *extra,
    ]


def end_half_the_answers(monkeypatch) -> None:
    """The tiny model never stops by itself: end every other own answer early, so a build's stages that keep only
    finished answers (distillation, the drafters' training) have some."""
    from streamfuse.training import distill

    real_answers = distill.greedy_answer_ids

    def half_finished(model, tokenizer, prompts, *args, **kwargs):
        answers = real_answers(model, tokenizer, prompts, *args, **kwargs)
        return [a[:3] + [tokenizer.eos_token_id] if i % 2 == 0 else a for i, a in enumerate(answers)]

    monkeypatch.setattr(distill, "greedy_answer_ids", half_finished)


@pytest.fixture
def tiny_base_dir(tmp_path):
    """A saved tiny Llama + tokenizer folder, usable as --base-model."""
    folder = tmp_path / "tiny-base"
    make_tiny_llama().save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return folder


GGUF_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def llama_cpp_permute(rows, heads: int):
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (rotary halves interleaved per head)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def quantize_into_gguf(model, path: Path) -> None:
    """Write `model`'s decoder linears as Q4_1 and its tied embedding as Q8_0 into a GGUF (llama.cpp's
    names and q/k row order), and set the model's weights to their dequantized values, as a model
    converted from that GGUF has them."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    config = model.config
    writer = GGUFWriter(str(path), "llama")

    def add(name: str, weight, kind, heads: int | None = None) -> None:
        raw = quants.quantize(weight.detach().numpy(), kind)  # [N, bytes]: row-wise, so rows permute as bytes
        with torch.no_grad():
            weight.copy_(torch.from_numpy(quants.dequantize(raw, kind)))
        writer.add_tensor(name, raw if heads is None else llama_cpp_permute(raw, heads), raw_dtype=kind)

    add("token_embd.weight", model.model.embed_tokens.weight, GGMLQuantizationType.Q8_0)
    for index, layer in enumerate(model.model.layers):
        for name, module in GGUF_LAYER_TENSORS.items():
            heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(name)
            add(f"blk.{index}.{name}.weight", layer.get_submodule(module).weight, GGMLQuantizationType.Q4_1, heads)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_checkpoint(root: Path, layers: int = 4, msa_layers: int = 2, gguf: bool = False) -> Path:
    """A tiny SS checkpoint fine-tuned for nothing, with a dialogsum prompt record, at root/ckpt.
    gguf: its base model is converted from a Q4_1 GGUF kept in the base folder (for q4-native)."""
    from streamfuse.adapters.checkpoint import save_checkpoint
    from streamfuse.adapters.config import LoraSettings, StreamConfig
    from streamfuse.adapters.lora import add_lora
    from streamfuse.adapters.model import SpeculativeStreamingLM
    from streamfuse.runtime.artifact.prompt import PromptFormat

    prompt = PromptFormat("summarize {source}", "{dialogue}", 64)
    base = root / "base"
    base_model = make_tiny_llama(layers=layers)
    if gguf:
        base.mkdir(parents=True)
        quantize_into_gguf(base_model, base / "model.gguf")
    base_model.save_pretrained(base)
    make_tiny_tokenizer().save_pretrained(base)
    model = SpeculativeStreamingLM(
        add_lora(make_tiny_llama(layers=layers), LoraSettings(rank=4)), StreamConfig(3, msa_layers)
    )
    if gguf:  # LoRA B is zero at init: give the adapter an effect, so unmerged LoRA is exercised
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.05)
    save_checkpoint(
        model,
        make_tiny_tokenizer(),
        root / "ckpt",
        str(base),
        LoraSettings(rank=4),
        {"task": "dialogsum", "prompt": prompt.to_dict()},
    )
    return root


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny SS checkpoint (root/ckpt) plus tiny data (root/data)."""
    root = write_checkpoint(tmp_path_factory.mktemp("gen"))
    write_tiny_dialogsum(root / "data")
    return root


@pytest.fixture(scope="session")
def artifact(tmp_path_factory):
    """The tiny checkpoint exported to every backend installed here, with Medusa heads (tests/tiny_export.py): built
    once per run, since several test files read it (minutes of lowering). Under pytest-xdist the first worker to
    ask builds it in the run's shared temporary folder and the others wait on its lock, then read it."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return build_shared_artifact(tmp_path_factory.mktemp("export"))
    root = tmp_path_factory.getbasetemp().parent / "shared-export"
    with FileLock(f"{root}.lock"):
        if not (root / "built").exists():
            shutil.rmtree(root, ignore_errors=True)  # a worker that failed half-way
            build_shared_artifact(root)
            (root / "built").touch()
    return root / "artifact"


def build_shared_artifact(root: Path) -> Path:
    from tiny_export import build_artifact

    root.mkdir(parents=True, exist_ok=True)
    write_checkpoint(root)
    write_tiny_dialogsum(root / "data")
    return build_artifact(root, root)


def pytest_collection_modifyitems(config, items):
    """The real-model files (marked slow) first: under pytest-xdist's --dist loadfile a worker takes whole files in
    this order, and the longest one started last would run alone at the end while the other core idles."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)
