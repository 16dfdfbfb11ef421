"""An acceptance head on the host, in numpy: the runtime's reader of what adapters/acceptance.py
trains and saves (the format: streamfuse/head_format.py).

The head is D residual blocks h + SiLU(W h + b), then a linear layer to one logit: P(the target
accepts the token drafted from a state). The methods that stop or shape drafts by it read a draft
model's final state or the streams' states. A few H x H products per step: numpy does them
without torch.

    <dir>/acceptance.json      format_version, depth, hidden_size, info
    <dir>/heads.safetensors    blocks.<i>.weight / .bias, out.weight / .bias
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from streamfuse.head_format import ACCEPTANCE_MANIFEST, ACCEPTANCE_VERSION, WEIGHTS, read_head_manifest


class AcceptancePredictor:
    """weights: the trained module's state dict (numpy arrays, or anything np.asarray reads)."""

    def __init__(self, weights: Mapping[str, object]):
        arrays = {name: np.asarray(value, dtype=np.float32) for name, value in weights.items()}
        depth = sum(1 for name in arrays if name.startswith("blocks.") and name.endswith(".weight"))
        self.blocks = [(arrays[f"blocks.{i}.weight"].T.copy(), arrays[f"blocks.{i}.bias"]) for i in range(depth)]
        self.out = (arrays["out.weight"][0], arrays["out.bias"][0])

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """[..., H] final-normed states -> [...] logits of acceptance."""
        hidden = np.asarray(hidden, dtype=np.float32)
        for weight, bias in self.blocks:
            pre = hidden @ weight + bias
            hidden = hidden + pre / (1.0 + np.exp(-pre))  # SiLU
        weight, bias = self.out
        return hidden @ weight + bias

    def probability(self, hidden: np.ndarray) -> np.ndarray:
        """[..., H] -> [...] predicted probability that the target accepts each state's token."""
        return 1.0 / (1.0 + np.exp(-self.logits(hidden)))


def load_acceptance_predictor(directory: Path, option: str) -> AcceptancePredictor:
    """option: the build's config section that trains the head, for the error's fix."""
    from safetensors.numpy import load_file

    read_head_manifest(directory, ACCEPTANCE_MANIFEST, ACCEPTANCE_VERSION, "acceptance head", option)
    return AcceptancePredictor(load_file(str(Path(directory) / WEIGHTS)))
