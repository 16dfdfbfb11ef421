"""The draft vocabulary: which tokens greedy_step's streams may propose.

Ranking drafts over the whole vocabulary reads the whole LM head (V x H, 113 MB in fp32 for
SmolLM2) once more per step; on a memory-bound CPU that costs as much as 8 transformer layers.
Drafts only have to be right often, so the streams rank the D tokens the task uses most
(the idea of FR-Spec and of EAGLE-3's draft vocabulary): the D rows are a constant of the graph.
The target's tokens still come from all V logits, so outputs are unchanged; a token outside
the set is simply never drafted, which costs acceptance in proportion to `coverage`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DraftVocab:
    ids: tuple[int, ...]  # ascending token ids
    coverage: float  # share of held-out answer tokens inside the set

    def to_dict(self) -> dict:
        return {"size": len(self.ids), "coverage": round(self.coverage, 4)}


def frequent_tokens(texts: Iterable[Sequence[int]], size: int, vocab_size: int) -> tuple[int, ...]:
    """The `size` most frequent ids in `texts` (prompts and answers: summaries copy names from the
    dialogue); if fewer distinct ids occur, the lowest remaining ids fill up, since a BPE
    vocabulary numbers its tokens roughly by how common they are."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size} (0 turns it off)")
    counts = Counter(token for text in texts for token in text)
    chosen = [token for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:size]]
    taken = set(chosen)
    chosen += [token for token in range(vocab_size) if token not in taken][: size - len(chosen)]
    return tuple(sorted(chosen))


def coverage(ids: Sequence[int], answers: Iterable[Sequence[int]]) -> float:
    inside, total = set(ids), 0
    hits = 0
    for answer in answers:
        total += len(answer)
        hits += sum(token in inside for token in answer)
    return hits / total if total else 1.0


def draft_vocab(
    train: Iterable[Sequence[int]], held_out_answers: Iterable[Sequence[int]], size: int, vocab_size: int
) -> DraftVocab | None:
    """None when size is 0 or covers the vocabulary: streams then rank all V tokens."""
    if size == 0 or size >= vocab_size:
        return None
    ids = frequent_tokens(train, size, vocab_size)
    return DraftVocab(ids, coverage(ids, held_out_answers))
