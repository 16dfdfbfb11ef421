"""runtime/request/text_stream.py: streamed text deltas are whole characters, never a stop string's text, and join to
the text of the whole generation."""

from pathlib import Path

import pytest

from streamfuse.runtime.request.text_stream import Detokenizer, certain_prefix, final_text, held_tail

from conftest import make_tiny_tokenizer

REAL_TOKENIZER = Path(__file__).resolve().parents[1] / "artifacts" / "dialogsum" / "tokenizer"


def byte_tokenizer():
    """A byte-level BPE without merges: one token per UTF-8 byte, so every multi-byte character is split."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def stream(tokenizer, steps: list[list[int]], stop=()) -> tuple[list[str], str, Detokenizer]:
    """Push each step's tokens; the deltas per push and the one finish gives."""
    text = Detokenizer.for_tokenizer(tokenizer, stop)
    deltas = [text.push(step) for step in steps]
    return deltas, text.finish(), text


def one_per_step(ids: list[int]) -> list[list[int]]:
    return [[token] for token in ids]


BYTES = [  # text, stop strings -> the delta of each one-byte push, then finish's
    ("héllo", (), ["h", "", "é", "l", "l", "o"], ""),
    ("a🙂b", (), ["a", "", "", "", "🙂", "b"], ""),
    ("日本", (), ["", "", "日", "", "", "本"], ""),
    ("ab END cd", ("END",), ["a", "b"] + [""] * 7, ""),  # the stop string and after: never streamed
    ("a EN b", ("END",), ["a", "", "", "", " EN", " b"], ""),  # "EN" was a stop's prefix, then it was not
    ("aE€b", ("E€",), ["a"] + [""] * 5, ""),  # a stop string that an unfinished character completes
    ("  hi ", (), ["", "", "h", "i", ""], ""),  # the final text is stripped
    ("x€", ("€y",), ["x", "", "", ""], "€"),  # a held stop prefix that the generation ends on
]


@pytest.mark.parametrize("text, stop, deltas, rest", BYTES, ids=[t for t, *_ in BYTES])
def test_bytes_stream_as_whole_characters_and_stop_before_a_stop_string(text, stop, deltas, rest):
    tokenizer = byte_tokenizer()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte: the characters really are split
    got, tail, detokenizer = stream(tokenizer, one_per_step(ids), stop)
    assert (got, tail) == (deltas, rest)
    assert "".join(got) + tail == final_text(tokenizer.decode(ids), stop) == detokenizer.text()
    assert not any("\ufffd" in delta for delta in got)


def test_an_unfinished_character_at_the_end_is_given_as_the_decoder_writes_it():
    tokenizer = byte_tokenizer()
    ids = tokenizer("ok é", add_special_tokens=False)["input_ids"][:-1]  # é's second byte never comes
    got, tail, _ = stream(tokenizer, one_per_step(ids))
    assert got == ["o", "k", "", ""] and tail == " \ufffd"


def test_words_stream_with_special_tokens_skipped_and_a_stop_string_across_tokens():
    tokenizer = make_tiny_tokenizer()
    ids = tokenizer("the a <|im_start|> and to of is", add_special_tokens=False)["input_ids"]
    got, tail, detokenizer = stream(tokenizer, [ids[:2], ids[2:4], ids[4:5], ids[5:]], stop=("to of",))
    assert got == ["the a", " and", "", ""] and tail == "" and detokenizer.stopped
    assert "".join(got) == final_text(tokenizer.decode(ids, skip_special_tokens=True), ("to of",)) == "the a and"
    assert detokenizer.push(ids[:1]) == ""  # after a stop, nothing more is streamed


def test_a_stop_prefix_that_does_not_complete_is_streamed_once_it_cannot():
    tokenizer = make_tiny_tokenizer()
    ids = tokenizer("the to in to of", add_special_tokens=False)["input_ids"]
    got, tail, _ = stream(tokenizer, one_per_step(ids), stop=("to of",))
    assert got == ["the", "", " to in", "", ""] and tail == ""


HELD = [  # text, patterns -> the tail that may still grow into a pattern
    ("abc", ("cd",), 1),
    ("abc", ("bcd", "cd"), 2),
    ("abc", ("abc",), 0),  # a whole pattern is no prefix: the caller cuts there
    ("abc", ("x",), 0),
    ("", ("ab",), 0),
]


@pytest.mark.parametrize("text, patterns, length", HELD)
def test_held_tail_is_the_longest_suffix_that_starts_a_pattern(text, patterns, length):
    assert held_tail(text, patterns) == length


def test_a_clean_up_pattern_is_held_until_it_cannot_rewrite_the_text():
    assert certain_prefix("do n", (), (" n't",)) == "do"
    assert certain_prefix("do n't", (), (" n't",)) == "do n't"
    assert certain_prefix("x . \ufffd", (), ()) == "x ."


@pytest.mark.skipif(not REAL_TOKENIZER.is_dir(), reason=f"no real artifact tokenizer at {REAL_TOKENIZER}")
@pytest.mark.parametrize("text", ["Die Straße ist schön 🙂 — 日本語のテキスト", "#Person1#: naïve café 😀😀"])
def test_the_real_byte_level_bpe_streams_exactly_its_text(text):
    from streamfuse.runtime.artifact.tokenizer import Tokenizer

    tokenizer = Tokenizer(REAL_TOKENIZER)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    for stop in [(), ("ist",), ("😀😀",)]:
        got, tail, _ = stream(tokenizer, one_per_step(ids), stop)
        assert "".join(got) + tail == final_text(tokenizer.decode(ids, skip_special_tokens=True), stop)
        assert not any("\ufffd" in delta for delta in got) and not any(s in "".join(got) for s in stop)
