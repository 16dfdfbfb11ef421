"""SpecDec++'s stop rule (Huang et al. 2024): its acceptance head (runtime/speculation/acceptance_head.py) reads the
draft model's state at each fed draft; sd's drafter (methods/sd/drafter.py) stops the chain once the predicted
probability of a rejection among the drafts passes the threshold."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streamfuse.runtime.speculation.acceptance_head import AcceptancePredictor


@dataclass(frozen=True)
class StopRule:
    """Stop once the predicted probability of a rejection among the drafts passes `threshold`."""

    head: AcceptancePredictor
    threshold: float
    method = "specdec++"  # the drafter a rule stops is this method's

    def __post_init__(self):
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"the SpecDec++ stop threshold is a probability in [0, 1], got {self.threshold}")

    def accept_probability(self, hidden: np.ndarray) -> float:
        return float(self.head.probability(hidden))
