"""The optimum-executorch peer: the plain-decoding .pte an ExecuTorch user makes with Hugging Face Optimum.

optimum-executorch pins transformers 5.0.0rc1 and huggingface-hub < 2, which conflict with ours, so
it gets a package folder of its own (cache_root()/optimum-executorch/site-<version>: PACKAGES,
installed by pip on first use with --no-deps, everything else shared with this environment) and its
export runs in a subprocess with that folder first on PYTHONPATH:

    optimum-cli export executorch --model <merged checkpoint> --task text-generation RECIPE --max_seq_len N

RECIPE is optimum-executorch's documented LLM recipe for XNNPACK: custom SDPA and KV cache, 8da4w
linear layers (int8 dynamic activations, int4 weights in groups of 32), 8-bit embedding. The .pte it
writes runs here on our ExecuTorch runtime (the same executorch release its export used) with
optimum's own decode loop (ExecuTorchModelForCausalLM.generate): one prefill call over the prompt,
then one `forward` call per token, greedy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from streamfuse.runtime.artifact.durable import replace_folder
from streamfuse.tools import peers_gguf
from streamfuse.tools.peers_runners import PeerResult

VERSION = "1.1.0"
PACKAGES = (
    f"optimum-executorch=={VERSION}",
    "optimum==2.0.0",
    "transformers==5.0.0rc1",
    "huggingface-hub>=1.2.1,<2",
    "tokenizers>=0.22,<0.23",
    "httpx",
    "httpcore",
    "typer-slim",
    "hf-xet",
    "shellingham",
)
RECIPE = (
    "--recipe",
    "xnnpack",
    "--use_custom_sdpa",
    "--use_custom_kv_cache",
    "--qlinear",
    "8da4w",
    "--qembedding",
    "8w",
)


def site_dir() -> Path:
    return peers_gguf.cache_root() / "optimum-executorch" / f"site-{VERSION}"


def ensure_site() -> Path:
    """optimum-executorch's own package folder, installed once (a partial install is redone)."""
    site = site_dir()
    if (site / ".complete").is_file():
        return site
    staging = site.with_name(site.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    print(f"[peers] installing optimum-executorch {VERSION} into {site} (once)", file=sys.stderr, flush=True)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(staging), *PACKAGES],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"pip could not install optimum-executorch ({done.returncode}): {done.stderr[-2000:]}")
    (staging / ".complete").write_text(json.dumps(PACKAGES))
    replace_folder(staging, site)  # the old install deleted once the new one is in place
    return site


def max_seq_len(n_ctx: int) -> int:
    """The .pte's KV length: one export (minutes) serves every run up to 768 positions (DialogSum's
    prompts and answers); a longer context gets its own, in steps of 256."""
    return max(768, -(-n_ctx // 256) * 256)


def pte_path(artifact: Path, max_seq_len: int) -> Path:
    return (
        peers_gguf.cache_root()
        / "optimum-executorch"
        / peers_gguf.artifact_key(artifact)
        / f"model-8da4w-{max_seq_len}.pte"
    )


def export_pte(model, tokenizer, artifact: Path, max_seq_len: int) -> Path:
    """The cached .pte of `artifact`'s LoRA-merged transformers model, made on first use (minutes)."""
    target = pte_path(artifact, max_seq_len)
    if target.is_file():
        return target
    site = ensure_site()
    target.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"[peers] exporting the merged checkpoint with optimum-executorch (once) -> {target}",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        hf_dir, out = Path(tmp) / "hf", Path(tmp) / "out"
        model.save_pretrained(hf_dir, safe_serialization=True)
        tokenizer.save_pretrained(hf_dir)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
            "HF_HUB_OFFLINE": "1",
        }
        command = [
            sys.executable,
            "-m",
            "optimum.commands.optimum_cli",
            "export",
            "executorch",
            "--model",
            str(hf_dir),
            "--task",
            "text-generation",
            *RECIPE,
            "--max_seq_len",
            str(max_seq_len),
            "--output_dir",
            str(out),
        ]
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        produced = sorted(out.glob("*.pte"))
        if done.returncode != 0 or not produced:
            raise RuntimeError(f"optimum-cli export executorch failed ({done.returncode}):\n{done.stderr[-3000:]}")
        produced[0].replace(target)
    target.with_suffix(".json").write_text(
        json.dumps(
            {
                "artifact": str(Path(artifact).resolve()),
                "optimum_executorch": VERSION,
                "command": command[2:],
                "packages": list(PACKAGES),
            },
            indent=1,
        )
    )
    return target


class OptimumExecuTorchRunner:
    """optimum-executorch's .pte, driven as ExecuTorchModelForCausalLM.generate drives it. module: the
    loaded program (forward((ids [1, T], cache_position [T])) -> logits, method_meta); see `open`."""

    def __init__(self, name: str, module, stop_ids: Sequence[int], max_seq_len: int, info: dict | None = None):
        self.name, self.module, self.max_seq_len, self.details = name, module, max_seq_len, info or {}
        self.stop_ids = tuple(stop_ids)
        self.vocab = int(module.method_meta("forward").output_tensor_meta(0).sizes()[-1])

    @classmethod
    def open(cls, name: str, pte: Path, stop_ids: Sequence[int], threads: int, max_seq_len: int):
        from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  (custom SDPA and KV cache kernels)
        from executorch.kernels import quantized  # noqa: F401  (the 8-bit embedding's kernel)

        from streamfuse import seams
        from streamfuse.runtime.backends.runners import set_executorch_threads

        set_executorch_threads(threads)
        info = {
            "engine": f"ExecuTorch (XNNPACK), exported by optimum-executorch {VERSION}",
            "pte": str(pte),
            "pte_bytes": Path(pte).stat().st_size,
            "recipe": " ".join(RECIPE),
            "max_seq_len": max_seq_len,
            "threads": threads,
            # the setting our own .pte runs with (it frees the unpacked weights once packed), not the
            # one left behind by whichever engine this process loaded first
            "xnnpack_weight_cache": seams.share_xnnpack_weights(),
        }
        return cls(name, seams.load_executorch_program(pte), stop_ids, max_seq_len, info)

    def _logits(self, ids: Sequence[int], start: int) -> torch.Tensor:
        inputs = (torch.tensor([list(ids)], dtype=torch.long), torch.arange(start, start + len(ids), dtype=torch.long))
        return self.module.forward(inputs)[0]

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int) -> PeerResult:
        if len(prompt_ids) + max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"{self.name}: prompt {len(prompt_ids)} + {max_new_tokens} new tokens exceed the .pte's "
                f"max_seq_len {self.max_seq_len}; pass a larger --n-ctx"
            )
        start = time.perf_counter()
        token = int(self._logits(prompt_ids, 0).reshape(-1, self.vocab)[-1].argmax())
        first, tokens = time.perf_counter(), [token]
        while token not in self.stop_ids and len(tokens) < max_new_tokens:
            token = int(self._logits([token], len(prompt_ids) + len(tokens) - 1).reshape(-1).argmax())
            tokens.append(token)
        seconds = time.perf_counter() - start
        return PeerResult(tokens, seconds, first - start, len(tokens))

    def info(self) -> dict:
        return self.details

    def close(self) -> None:
        self.module = None
