"""Incremental detokenization with stop strings, against the real tokenizer."""

from __future__ import annotations

import pytest

from steadfast.model.tokenizer import GGUFTokenizer
from steadfast.worker.core.detokenizer import Detokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok(model_path):
    return GGUFTokenizer.from_gguf(model_path)


def stream(tok, text, stop=()):
    ids = tok.encode(text)
    d = Detokenizer(tok, tok.encode("Prompt:"), tuple(stop))
    pieces, stopped = [], False
    for i, t in enumerate(ids):
        stopped = d.add(t)
        pieces.append(d.take(final=stopped or i == len(ids) - 1))
        if stopped:
            break
    return pieces, stopped


def test_concatenated_deltas_equal_the_full_text(tok):
    text = " Héllo wörld — 日本語 🚀 code: `x = 1`\nnext line"
    pieces, stopped = stream(tok, text)
    assert "".join(pieces) == text and not stopped
    assert all("\ufffd" not in p for p in pieces)  # multi-byte characters never split


def test_stop_string_cuts_the_output_before_it(tok):
    pieces, stopped = stream(tok, " one two three STOP four five", stop=["STOP"])
    assert stopped
    assert "".join(pieces) == " one two three "


def test_text_that_may_begin_a_stop_string_is_held_back(tok):
    d = Detokenizer(tok, [], ("END!",))
    released = ""
    for t in tok.encode(" alpha beta EN"):
        assert not d.add(t)
        released += d.take(final=False)
    assert not released.endswith("EN")  # could still become "END!"
    assert released + d.take(final=True) == " alpha beta EN"


def test_no_stop_string_in_the_first_min_tokens_tokens_text(tok):
    ids = tok.encode(" STOP one STOP two")
    first = len(tok.encode(" STOP one"))
    d = Detokenizer(tok, [], ("STOP",), min_tokens=first)
    added = next(i for i, t in enumerate(ids) if d.add(t))
    assert added == len(ids) - len(tok.encode(" two")) - 1  # (the second STOP's last token)
    assert d.text == " STOP one "
