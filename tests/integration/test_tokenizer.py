"""Tokenizer built from GGUF metadata matches transformers' tokenizer for the same file."""

from __future__ import annotations

import pytest

from steadfast.model.tokenizer import GGUFTokenizer

pytestmark = pytest.mark.integration

TEXTS = [
    "Hello, world! How are you today?",
    "  leading spaces, trailing spaces   \n\n\tand tabs",
    "Ünïcödé — 日本語のテキスト, Ελληνικά, русский, emoji 🚀🔥 and naïve café",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f'{f(3)=}')\n",
    "3.14159 26535 89793 2384626 1234567890 0x1F 2026-11-29 +1 (555) 010-9999 1e-5",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "",
]


@pytest.fixture(scope="module")
def ours(model_path):
    return GGUFTokenizer.from_gguf(model_path)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(ours, hf_tokenizer, text):
    assert ours.encode(text) == hf_tokenizer.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(ours, hf_tokenizer, text):
    ids = ours.encode(text)
    assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_chat_template_renders_the_files_template(ours):
    text = ours.render_chat([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template adds its default system prompt
    ids = ours.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1 and ids.count(1) == 3  # <|im_start|> kept whole, three times
