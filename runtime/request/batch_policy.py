"""When a batch runs its greedy speculative sequences as plain rows.

Sharing a call makes rows cheap only while the linears are bound by weight reads: past a few rows they are bound
by arithmetic, and B speculative sequences (B x T rows plus each one's streams) can cost more per token than B
plain rows. Greedy decoding emits the same tokens either way, so the batch picks, step by step, the mode that
makes more tokens per second at its size: a speculative step yields `rate` tokens per sequence (the mean of this
process's speculative batch steps), a plain step one, each at the seconds measured here for a step of that many
sequences in that mode. A mode not measured at a size yet, or not for `refresh` steps, is measured next (its
first step at a size is a warm-up and does not count), so the choice follows the machine and the caches' growth.
A lone sequence never runs plain rows for the policy: its method and its fallback decide, as they do outside a batch.

    policy.plain_rows(4) -> False       (speculative steps at 4 sequences not measured yet)
    policy.observe(4, False, 0.058, tokens=7); ...; policy.plain_rows(4) -> True   (plain: not measured yet)
    policy.observe(4, True, 0.019, tokens=4); ...; policy.plain_rows(4) -> 4 / 0.019 > 7 / 0.058
"""

from __future__ import annotations

from dataclasses import dataclass, field

Key = tuple[int, bool]  # (sequences, plain)
POLICIES = ("auto", "method")  # the commands' --batch-policy: auto picks as above, method never runs plain rows
POLICY_HELP = (
    "auto: greedy speculative sequences take plain steps while those make more tokens/s at the batch's size; "
    "method: every step is the method's own (default auto)"
)


@dataclass
class PlainRowsPolicy:
    weight: float = 0.25  # of the newest step in the means
    refresh: int = 64  # steps after which a mode is measured again
    seconds: dict[Key, float] = field(default_factory=dict)  # a step's seconds, a running mean
    rate: float | None = None  # tokens per sequence in a speculative step, a running mean
    counts: dict[Key, int] = field(default_factory=dict)  # steps observed, warm-ups included
    measured_at: dict[Key, int] = field(default_factory=dict)  # `steps` when last observed
    steps: int = 0

    def __post_init__(self):
        if not 0 < self.weight <= 1 or self.refresh < 1:
            raise ValueError(f"need 0 < weight <= 1 and refresh >= 1, got {self.weight} and {self.refresh}")

    def plain_rows(self, sequences: int) -> bool:
        """Whether the next step of `sequences` sequences runs plain."""
        if sequences < 2:
            return False
        speculative, plain = (sequences, False), (sequences, True)
        if not self._known(speculative) or self.rate is None:
            return False
        if not self._known(plain):
            return True
        return 1 / self.seconds[plain] > self.rate / self.seconds[speculative]

    def observe(self, sequences: int, plain: bool, seconds: float, tokens: int) -> None:
        """A step of `sequences` sequences took `seconds` and emitted `tokens` (all of them)."""
        self.steps += 1
        key = (sequences, plain)
        count = self.counts.get(key, 0)
        self.counts[key] = count + 1
        self.measured_at[key] = self.steps
        if not plain:
            self.rate = self._mean(self.rate, tokens / sequences)
        if count > 0 or sequences == 1:  # a batched shape's first call pays its warm-up
            self.seconds[key] = self._mean(self.seconds.get(key), seconds)

    def _known(self, key: Key) -> bool:
        return key in self.seconds and self.steps - self.measured_at[key] < self.refresh

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)
