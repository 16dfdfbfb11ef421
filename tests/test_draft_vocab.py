"""The draft vocabulary: most frequent tokens first, filled up by id, and its coverage."""

import pytest

from streamfuse.export.draft_vocab import coverage, draft_vocab, frequent_tokens


def test_most_frequent_tokens_win_and_lowest_ids_fill_up():
    texts = [[7, 7, 7, 9, 9, 4], [9, 12, 7]]  # 7: 4 times, 9: 3, then 4 and 12 once each (tie: lower id)
    assert frequent_tokens(texts, 3, vocab_size=20) == (4, 7, 9)
    assert frequent_tokens(texts, 6, vocab_size=20) == (0, 1, 4, 7, 9, 12)  # 4 seen, then ids 0 and 1


def test_coverage_counts_answer_tokens_inside():
    assert coverage((1, 2, 3), [[1, 2, 5], [3]]) == 0.75


def test_size_zero_or_the_whole_vocabulary_turns_it_off_and_bad_sizes_are_named():
    assert draft_vocab([[1, 2]], [[1]], 0, vocab_size=10) is None
    assert draft_vocab([[1, 2]], [[1]], 10, vocab_size=10) is None
    found = draft_vocab([[1, 2, 2]], [[2, 8]], 1, vocab_size=10)
    assert found.ids == (2,) and found.coverage == 0.5 and found.to_dict() == {"size": 1, "coverage": 0.5}
    with pytest.raises(ValueError, match=r"draft vocabulary size must be in \[1, 10\], got -1"):
        frequent_tokens([[1]], -1, vocab_size=10)
