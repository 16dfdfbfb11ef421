import pytest
import torch

from streamfuse.methods.ss.drafter import draft_tokens
from streamfuse.runtime.speculation.lookup import PromptLookup
from streamfuse.runtime.speculation.tree import TreeSpec


def test_lookup_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    lookup = PromptLookup([5, 6, 7, 8, 9, 6, 7, 1, 2, 3, 7])
    # Suffix (7,) last occurred at index 6, followed by 1, 2, 3 (3-gram (2, 3, 7) and 2-gram (3, 7) are new).
    assert lookup.draft(3) == [1, 2, 3]
    lookup.extend([8])
    # (7, 8) occurred at 2..3 and is followed by 9, 6: the 2-gram beats the 1-gram (8,), which has no earlier match.
    assert lookup.draft(3) == [9, 6, 7]
    assert lookup.draft(1) == [9]


def test_lookup_without_a_match_or_continuation_drafts_nothing():
    assert PromptLookup([1, 2, 3]).draft(3) == []
    assert PromptLookup([]).draft(3) == []
    assert PromptLookup([4, 4]).draft(3) == [4]  # only one token follows the earlier 4
    with pytest.raises(ValueError, match="max_ngram"):
        PromptLookup([1], max_ngram=0)


def test_lookup_tokens_fill_the_lookup_branch_and_keep_siblings_distinct():
    tree = TreeSpec.parse("gamma=3,k=1,lookup=3")  # nodes: root, [0], [1], [0,0], [1,0], [0,0,0], [1,0,0]
    ranked = torch.tensor([[10, 11], [20, 21], [30, 31]])
    assert draft_tokens(tree, 1, ranked) == ([1, 10, 11, 20, 20, 30, 30], 0)
    assert draft_tokens(tree, 1, ranked, [40, 41, 42]) == ([1, 10, 40, 20, 41, 30, 42], 3)
    assert draft_tokens(tree, 1, ranked, [40]) == ([1, 10, 40, 20, 20, 30, 30], 1)
    # 10 is already node [0]'s token: a repeated sibling is never filled, nor is anything below it.
    assert draft_tokens(tree, 1, ranked, [10, 41, 42]) == ([1, 10, 11, 20, 20, 30, 30], 0)
