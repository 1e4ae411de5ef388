"""Incremental detokenization: streamed pieces add up to the tokenizer's own decoding, split
characters wait for their last byte, and stop strings end the text exactly where they begin,
even split across tokens, with no prefix of one ever sent early."""

from __future__ import annotations

import pytest

from stride.scheduler.detokenizer import Detokenizer
from tests.helpers.models import make_tokenizer

TEXT = "hello world, café 🙂 日本 and the rest of it"


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def _stream(detok: Detokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    """Feed `ids` one at a time, taking the text after each; the pieces and any stop found."""
    pieces, stop = [], None
    for token in ids:
        stop = detok.add(token)
        if stop is not None:
            break
        pieces.append(detok.take(final=False))
    pieces.append(detok.take(final=True))
    return pieces, stop


def test_pieces_add_up_to_the_tokenizers_decoding(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT.split())  # several tokens per word: characters split across them
    pieces, stop = _stream(Detokenizer(tokenizer, [], skip_special_tokens=True), ids)
    assert stop is None
    assert "".join(pieces) == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in piece for piece in pieces)  # a split character waits for its bytes


def test_without_stop_strings_tokens_wait_until_taken(tokenizer):
    detok = Detokenizer(tokenizer, [], skip_special_tokens=True)
    for token in tokenizer.encode("hello world", add_special_tokens=False):
        assert detok.add(token) is None
    assert detok.text == ""  # nothing decoded yet: the engine may launch its next step first
    assert detok.take(final=False) == "hello world"
    assert detok.take(final=True) == ""


@pytest.mark.parametrize("stop", ["world", "o w", "🙂", "rest of"])
def test_a_stop_string_ends_the_text_where_it_begins(tokenizer, stop):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = Detokenizer(tokenizer, ["never there", stop], skip_special_tokens=True)
    pieces, found = _stream(detok, ids)
    assert found == stop
    assert "".join(pieces) == detok.text == TEXT[: TEXT.index(stop)]


def test_a_possible_stop_prefix_is_held_back_until_it_cannot_match(tokenizer):
    """The last len(stop) - 1 characters wait: they could still begin the stop string."""
    detok = Detokenizer(tokenizer, ["worlds"], skip_special_tokens=True)
    sent = ""
    for token in tokenizer.encode("hello world", add_special_tokens=False):
        assert detok.add(token) is None
        sent += detok.take(final=False)
        assert "w" not in sent  # never a prefix of "worlds"
    assert sent == "hello "  # "world" could still become "worlds"
    for token in tokenizer.encode(", and more", add_special_tokens=False):
        assert detok.add(token) is None
        sent += detok.take(final=False)
    assert sent + detok.take(final=True) == "hello world, and more"


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("hello", add_special_tokens=False) + [tokenizer.eos_token_id]
    for skip, want in ((True, "hello"), (False, "hello" + tokenizer.eos_token)):
        pieces, _ = _stream(Detokenizer(tokenizer, [], skip_special_tokens=skip), ids)
        assert "".join(pieces) == want
