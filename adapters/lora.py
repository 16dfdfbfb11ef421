"""LoRA through peft, shared by the main stream and the streams (they run the same layers)."""

from __future__ import annotations

from torch import nn

from .config import LoraSettings


def add_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Wrap an HF causal LM with trainable LoRA adapters; base weights are frozen."""
    from peft import LoraConfig, get_peft_model

    num_layers = model.config.num_hidden_layers
    settings.validate(num_layers)
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        layers_to_transform=settings.layers(num_layers),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)
