"""The only file that knows Hugging Face module names and calling conventions.

Speculative Streaming drives the base model's own decoder layers (so LoRA wrapped by peft
applies unchanged) with explicit masks, positions and key/value providers. Supporting another
architecture means teaching `decoder_parts` where its modules are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from streamfuse import seams

# Families whose decoder layers take (hidden, attention_mask, position_embeddings,
# past_key_values) and whose attention calls past_key_values.update(k, v, layer_idx).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class DecoderParts:
    embed: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Module
    rotary: nn.Module
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def is_rms_norm(module: nn.Module) -> bool:
    """The RMSNorm of the supported families (LlamaRMSNorm, Qwen2RMSNorm, ...)."""
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


def rms_norm_epsilon(norm: nn.Module) -> float:
    return float(norm.variance_epsilon)


def register_attention(name: str, function) -> None:
    """Make `function` (transformers' attention signature) selectable by `set_attention`."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, function)


def set_attention(model: nn.Module, name: str) -> None:
    """Route every attention module of `model` to the registered implementation `name`; the
    modules read it from the config they share."""
    seams.set_attention_implementation(unwrap_peft(model).config, name)


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The underlying transformers model of a peft model (LoRA layers stay in place)."""
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


def decoder_parts(model: nn.Module) -> DecoderParts:
    base = unwrap_peft(model)
    config = base.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"model_type {config.model_type!r} is not supported yet (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}); add its module names to adapters/hf.py"
        )
    inner = base.model
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return DecoderParts(
        embed=inner.embed_tokens,
        layers=inner.layers,
        norm=inner.norm,
        lm_head=base.lm_head,
        rotary=inner.rotary_emb,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        max_positions=config.max_position_embeddings,
    )


def keep_first_layers(model: nn.Module, layers: int) -> nn.Module:
    """Cut an HF causal LM to its first `layers` decoder layers, in place: the embedding, the final
    norm and the (tied) LM head stay, so the cut model predicts tokens from a shallower stack."""
    parts = decoder_parts(model)
    if not 1 <= layers <= parts.num_layers:
        raise ValueError(f"keep 1..{parts.num_layers} decoder layers, got {layers}")
    del parts.layers[layers:]
    config = unwrap_peft(model).config
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:  # families with per-layer attention kinds (qwen3)
        config.layer_types = config.layer_types[:layers]
    return model


def call_layer(
    layer: nn.Module,
    hidden: torch.Tensor,
    mask: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    key_values: object,
) -> torch.Tensor:
    """Run one HF decoder layer. hidden [B, T, H]; mask additive [B, 1, T, K]; key_values has
    update(k, v, layer_idx) -> (all_k, all_v) as HF attention expects of a cache."""
    return layer(
        hidden,
        attention_mask=mask,
        position_embeddings=position_embeddings,
        past_key_values=key_values,
    )


def fresh_decoder_layer(model: nn.Module) -> nn.Module:
    """A new float decoder layer of the model's class and shape, layer index 0 (a drafter's own layer)."""
    base = unwrap_peft(model)
    layer = type(base.model.layers[0])(base.config, 0)
    return layer.to(next(base.parameters()).dtype)
