"""Two-model speculative decoding's draft model, made from the base: its first layers, final norm and tied LM head.

No smaller model shares SmolLM2's tokenizer here (the SS paper's baseline pairs OPT-1.3b with a
smaller OPT), so the draft model is the base cut to its first `layers` decoder layers, with LoRA
to train it towards what the target decodes (its own greedy answers, training/distill.py).
It is wrapped like the target, as a SpeculativeStreamingLM whose one nominal stream never runs,
so the same training loop, backends and KV cache drive it (its drafter).
"""

from __future__ import annotations

from torch import nn

from streamfuse.adapters.config import LoraSettings, StreamConfig
from streamfuse.adapters.hf import keep_first_layers
from streamfuse.adapters.lora import add_lora
from streamfuse.adapters.model import SpeculativeStreamingLM

# The draft model's streams are never run: decoding calls it with_streams=False, training without streams.
NOMINAL_STREAMS = StreamConfig(num_streams=1, msa_layers=1)


def draft_model(base: nn.Module, layers: int, lora: LoraSettings) -> SpeculativeStreamingLM:
    """The base (an HF causal LM, cut in place) to its first `layers` layers, with trainable LoRA."""
    if layers < 2:
        raise ValueError(f"a draft model needs >= 2 layers (one below the nominal stream layer), got {layers}")
    return SpeculativeStreamingLM(add_lora(keep_first_layers(base, layers), lora), NOMINAL_STREAMS)
