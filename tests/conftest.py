"""Shared fixtures: tiny random Llama models with fixed seeds (hidden 32, 4 layers)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
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
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>",
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
                    record.update({"summary1": summary, "summary2": summary, "summary3": summary,
                                   "topic1": "t", "topic2": "t", "topic3": "t"})
                else:
                    record["summary"] = summary
                handle.write(json.dumps(record) + "\n")
    return directory


@pytest.fixture
def tiny_base_dir(tmp_path):
    """A saved tiny Llama + tokenizer folder, usable as --base-model."""
    folder = tmp_path / "tiny-base"
    make_tiny_llama().save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return folder


def write_checkpoint(root: Path, layers: int = 4, msa_layers: int = 2) -> Path:
    """A tiny SS checkpoint fine-tuned for nothing, with a dialogsum prompt record, at root/ckpt."""
    from streamfuse.adapters.checkpoint import save_checkpoint
    from streamfuse.adapters.config import LoraSettings, StreamConfig
    from streamfuse.adapters.lora import add_lora
    from streamfuse.adapters.model import SpeculativeStreamingLM
    from streamfuse.runtime.prompt import PromptFormat

    prompt = PromptFormat("summarize {source}", "{dialogue}", 64)
    base = root / "base"
    make_tiny_llama(layers=layers).save_pretrained(base)
    make_tiny_tokenizer().save_pretrained(base)
    model = SpeculativeStreamingLM(add_lora(make_tiny_llama(layers=layers), LoraSettings(rank=4)), StreamConfig(3, msa_layers))
    save_checkpoint(model, make_tiny_tokenizer(), root / "ckpt", str(base), LoraSettings(rank=4),
                    {"task": "dialogsum", "prompt": prompt.to_dict()})
    return root


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny SS checkpoint (root/ckpt) plus tiny data (root/data)."""
    root = write_checkpoint(tmp_path_factory.mktemp("gen"))
    write_tiny_dialogsum(root / "data")
    return root
