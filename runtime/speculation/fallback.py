"""Automatic fallback: decode plainly wherever speculation does not pay on this device.

A speculative step costs `step_cost` plain steps (measured on the device by tools/calibrate and
kept in the artifact's manifest; a method that changes its tree per step, ss-adaptive, gives each
calibrated tree's own cost in `tree_costs`) and yields its accepted drafts plus one token. The loop
judges speculation in blocks of steps: a block pays when its tokens are at least its cost in plain
steps. When one does not, the loop decodes plainly for `pause` tokens and then probes again with a
shorter block; a failed probe doubles the pause (up to `max_pause`), a probe that pays resets it.
Both modes emit exactly the tokens plain decoding would, so a switch changes speed only; each
switch is recorded in the run's trace.

    speculating --(block yields < step_cost x steps)--> plain for `pause` tokens --> probing
    probing --(probe pays)--> speculating (pause reset)   probing --(fails)--> plain, pause x 2
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class FallbackConfig:
    step_cost: float  # one speculative step in plain steps, as calibrated on this device
    tree_costs: tuple[tuple[Hashable, float], ...] = ()  # (tree's paths, its step's cost) where trees vary per step
    block: int = 8  # speculative steps judged together while speculation pays
    probe: int = 4  # steps of a probe (the first steps of a run are one): shorter, so a loss costs little
    pause: int = 32  # plain tokens after the first failed block or probe
    max_pause: int = 512

    def __post_init__(self):
        if not self.step_cost > 0:
            raise ValueError(f"fallback step_cost must be > 0 (a step's cost in plain steps), got {self.step_cost}")
        if any(not cost > 0 for _, cost in self.tree_costs):
            raise ValueError(f"fallback tree_costs must be > 0 plain steps, got {self.tree_costs}")
        if self.block < 1 or self.probe < 1:
            raise ValueError(f"fallback block and probe must be >= 1 steps, got {self.block} and {self.probe}")
        if not 1 <= self.pause <= self.max_pause:
            raise ValueError(f"fallback pause must be in [1, max_pause={self.max_pause}], got {self.pause}")

    def cost(self, paths: Hashable) -> float:
        """A step of the tree of these paths (its shape: the lookup branch costs nothing) in plain steps:
        its own calibrated cost, else step_cost."""
        return self._costs.get(paths, self.step_cost)

    @cached_property
    def _costs(self) -> dict:
        return dict(self.tree_costs)  # built once, not on every step


class Fallback:
    """The switch's state for one run. The decode loop asks `speculating`, reports each
    speculative step's tokens (`after_step`) and each plain token (`after_plain_token`)."""

    def __init__(self, config: FallbackConfig):
        self.config = config
        self.speculating = True
        self.probing = True  # a run starts on a probe: the calibration is an average, this input may differ
        self.pause = config.pause
        self.plain_left = 0
        self._tokens: list[int] = []  # tokens of the speculative steps in the current block
        self._costs: list[float] = []  # their costs in plain steps

    @property
    def last_plain_token(self) -> bool:
        """The next plain step is the last before a probe: it must bring the streams for the draft."""
        return not self.speculating and self.plain_left == 1

    def after_step(self, tokens: int, cost: float | None = None) -> float | None:
        """Record a speculative step (cost: its plain steps, default step_cost); returns the block's
        tokens per step when it failed (the loop goes plain from the next token on), else None."""
        self._tokens.append(tokens)
        self._costs.append(self.config.step_cost if cost is None else cost)
        size = self.config.probe if self.probing else self.config.block
        if len(self._tokens) < size:
            return None
        rate, pays = sum(self._tokens) / len(self._tokens), sum(self._tokens) >= sum(self._costs)
        self._tokens.clear()
        self._costs.clear()
        if pays:
            if self.probing:
                self.probing, self.pause = False, self.config.pause
            return None
        self.speculating, self.probing, self.plain_left = False, True, self.pause
        self.pause = min(2 * self.pause, self.config.max_pause)
        return rate

    def after_plain_token(self) -> bool:
        """Record a plain token; True when the loop goes back to speculating (a probe) next."""
        self.plain_left -= 1
        if self.plain_left > 0:
            return False
        self.speculating = True
        return True
