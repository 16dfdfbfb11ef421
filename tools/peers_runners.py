"""The peer runners behind tools/peers.py: one class per engine, one interface.

    runner.run(prompt_ids, max_new_tokens) -> PeerResult(token_ids, seconds, ttft_s, new_tokens)

All decode greedily at batch 1 from streamfuse's own prompt ids and stop at streamfuse's stop ids
and max_new_tokens (the EOS token is kept, as streamfuse's emitter keeps it). Timing is the same
for every engine: wall clock from the call to its return, and from the call to the first new token.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

from streamfuse.runtime.methods import registry
from streamfuse.runtime.request.api import Model
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.loader import Loaded
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.tools import peers_gguf


@dataclass(frozen=True)
class PeerResult:
    token_ids: list[int]  # new tokens, cut at the first stop id / max_new_tokens like streamfuse's emitter
    seconds: float  # wall clock of the whole call, prefill included
    ttft_s: float  # call start -> first new token available
    new_tokens: int


class PeerRunner(Protocol):
    name: str

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int) -> PeerResult: ...

    def info(self) -> dict: ...

    def close(self) -> None: ...


@dataclass
class PeerContext:
    """What a peer factory gets: the streamfuse-loaded checkpoint and the shared settings."""

    loaded: Loaded  # runtime.load(artifact): tokenizer, stop ids, and the merged HF model in its torch backend
    artifact: Path
    threads: int
    n_ctx: int = 1024  # llama.cpp context: >= prompt + max_new_tokens + pld_tokens
    pld_tokens: int = 10  # prompt lookup: tokens proposed per step (HF and llama.cpp alike)
    pld_ngram: int = 2  # prompt lookup: longest n-gram matched


def cut_at_stop(tokens: Sequence[int], stop_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """streamfuse's stop rule: keep tokens up to and including the first stop id, at most max_new_tokens."""
    kept = []
    for token in tokens[:max_new_tokens]:
        kept.append(int(token))
        if token in stop_ids:
            break
    return kept


def hf_model(loaded: Loaded):
    """The LoRA-merged transformers causal LM inside the torch backend (merge_and_unload returns it plain)."""
    from transformers import PreTrainedModel

    if loaded.backend.name != "torch":
        raise ValueError(
            f"the HF and GGUF peers take the model from the torch backend, not {loaded.backend.name!r}: "
            f"load the checkpoint with backend 'torch'"
        )
    model = loaded.backend.model.model  # SpeculativeStreamingLM.model
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"expected a plain transformers model after merging LoRA, got {type(model).__name__}")
    return model


class _FirstTokenClock:
    """A generate() streamer that only notes when the first new tokens arrive (put #1 is the prompt)."""

    def __init__(self):
        self.puts, self.first = 0, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self):
        pass


class HFRunner:
    def __init__(self, name: str, context: PeerContext, extra: dict | None = None, assistant=None):
        from transformers import GenerationConfig

        self.name, self.model, self.assistant = name, hf_model(context.loaded), assistant
        self.stop_ids = tuple(context.loaded.stop_token_ids)
        self.extra = extra or {}
        # Assisted generation adapts the assistant's settings in place; start every run from the same ones.
        self.assistant_config = copy.deepcopy(assistant.generation_config) if assistant is not None else None
        self.config = GenerationConfig(
            do_sample=False, num_beams=1, eos_token_id=list(self.stop_ids), pad_token_id=self.stop_ids[0], **self.extra
        )

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int) -> PeerResult:
        ids = torch.tensor([list(prompt_ids)], device=self.model.device)
        config = copy.deepcopy(self.config)
        config.max_new_tokens = max_new_tokens
        kwargs = {}
        if self.assistant is not None:
            self.assistant.generation_config = copy.deepcopy(self.assistant_config)
            kwargs["assistant_model"] = self.assistant
        clock = _FirstTokenClock()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=clock, **kwargs
            )
        seconds = time.perf_counter() - start
        tokens = cut_at_stop(out[0, ids.shape[1] :].tolist(), self.stop_ids, max_new_tokens)
        return PeerResult(tokens, seconds, (clock.first or start + seconds) - start, len(tokens))

    def info(self) -> dict:
        import transformers

        return {
            "engine": "transformers.generate",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "dtype": str(self.model.dtype),
            "threads": torch.get_num_threads(),
            **self.extra,
            "assistant": "un-fine-tuned base model" if self.assistant is not None else None,
        }

    def close(self) -> None:
        pass


def load_base_hf(artifact: Path, device):
    """The checkpoint's base model without LoRA, as a transformers model (the assistant of hf_assisted)."""
    from transformers import AutoModelForCausalLM

    name = peers_gguf.manifest_of(artifact)["base_model"]
    bundled = peers_gguf.bundled_base_gguf(name)
    if bundled is not None:  # the default base: dequantised from its GGUF, as adapters/base_model.py does
        model = AutoModelForCausalLM.from_pretrained(bundled.parent, gguf_file=bundled.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, attn_implementation="sdpa")
    return model.to(device).eval().requires_grad_(False)


class LlamaCppRunner:
    """llama.cpp on one GGUF; with `lora`, a GGUF adapter applied at run time (llama.cpp adds its product
    to each adapted matmul; the base weights stay as shipped)."""

    def __init__(self, name: str, context: PeerContext, gguf: Path, pld: bool, lora: Path | None = None):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.name, self.gguf, self.pld, self.context, self.lora = name, Path(gguf), pld, context, lora
        self.stop_ids = tuple(context.loaded.stop_token_ids)
        draft = (
            LlamaPromptLookupDecoding(max_ngram_size=context.pld_ngram, num_pred_tokens=context.pld_tokens)
            if pld
            else None
        )
        self.llm = Llama(
            model_path=str(gguf),
            n_ctx=context.n_ctx,
            n_batch=min(512, context.n_ctx),
            n_threads=context.threads,
            n_threads_batch=context.threads,
            seed=0,
            verbose=False,
            draft_model=draft,
            lora_path=str(lora) if lora else None,
        )
        vocab = context.loaded.tokenizer.vocab_size
        if self.llm.n_vocab() < vocab:
            raise ValueError(f"{gguf} has {self.llm.n_vocab()} tokens, the checkpoint's tokenizer {vocab}")

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int) -> PeerResult:
        needed = len(prompt_ids) + max_new_tokens + self.context.pld_tokens + 1
        if needed > self.context.n_ctx:
            raise ValueError(
                f"{self.name}: prompt {len(prompt_ids)} + {max_new_tokens} new tokens needs n_ctx >= "
                f"{needed}, have {self.context.n_ctx}; pass a larger --n-ctx"
            )
        self.llm.reset()  # no KV prefix reuse between inputs: every peer pays its full prefill
        tokens, first = [], None
        start = time.perf_counter()
        # temp 0 -> llama.cpp's greedy sampler (argmax); repeat_penalty 1 -> no penalty.
        for token in self.llm.generate(list(prompt_ids), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            if first is None:
                first = time.perf_counter()
            tokens.append(int(token))
            if token in self.stop_ids or len(tokens) >= max_new_tokens:
                break
        seconds = time.perf_counter() - start
        return PeerResult(tokens, seconds, (first or start + seconds) - start, len(tokens))

    def info(self) -> dict:
        import llama_cpp

        return {
            "engine": "llama.cpp (llama-cpp-python)",
            "llama_cpp_python": peers_gguf.llama_cpp_version(),
            "gguf": str(self.gguf),
            "gguf_bytes": self.gguf.stat().st_size,
            "n_threads": self.context.threads,
            "lora": str(self.lora) if self.lora else None,
            "lora_bytes": self.lora.stat().st_size if self.lora else None,
            "n_ctx": self.context.n_ctx,
            "prompt_lookup": {"num_pred_tokens": self.context.pld_tokens, "max_ngram_size": self.context.pld_ngram}
            if self.pld
            else None,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        }

    def close(self) -> None:
        self.llm.close()  # now, not in __del__ at interpreter exit (llama-cpp-python then raises)


class StreamfuseRunner:
    """streamfuse itself (the API's Model.run, its text included) behind the peer interface: the reference rows."""

    def __init__(self, name: str, loaded: Loaded, settings: DecodeSettings):
        self.name, self.loaded, self.settings = name, loaded, settings
        self.model = Model(loaded)

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int) -> PeerResult:
        settings = replace(self.settings, rules=StopRules(max_new_tokens, self.loaded.stop_token_ids))
        first: list[float] = []
        start = time.perf_counter()
        result = self.model.run(
            list(prompt_ids), settings=settings, on_step=lambda event: first or first.append(time.perf_counter())
        )
        seconds = time.perf_counter() - start
        return PeerResult(
            list(result.token_ids), seconds, (first[0] if first else start + seconds) - start, len(result.token_ids)
        )

    def info(self) -> dict:
        return {
            "engine": "streamfuse",
            "method": self.settings.method,
            "backend": self.loaded.backend.name,
            "tree": self.settings.tree.to_dict() if registry.get(self.settings.method).speculative else None,
            "stream_schedule": self.loaded.backend.stream_schedule(self.settings.tree) if self.settings.tree else None,
        }

    def close(self) -> None:
        pass
