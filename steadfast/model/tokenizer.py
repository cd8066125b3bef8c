"""Tokenizer and chat template, built from GGUF metadata alone (no files from a hub).

Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) uses the file's merges; a sentencepiece vocabulary
(`"llama"`) gets its merges derived from the token scores. Control tokens stay whole. The chat template
stored in the file is rendered with a sandboxed jinja2 environment; in a chat, control tokens come only
from the template: the same text in a message (`<|im_end|>`) is tokenized as the plain text it is.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from steadfast.model.gguf_file import GGUFFile
from steadfast.model.gguf_meta import ModelLoadError, field_value, open_gguf

CONTROL = 3
USER_DEFINED = 4
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: each of the 256 bytes has a printable stand-in (itself
    where printable and not a space, else 256 + its rank among the rest)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(rest)}


_UNICODE_TO_BYTE = _byte_alphabet()

# Split rules for GGUF pre-tokenizer names whose merges were learned on something other than GPT-2's.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# Private-use code points (planes 15 and 16) that stand in for control-token text found in a message
# while the template renders: one character each, so whatever string filters a template applies treat
# them as the text they replace would be treated; spelled back as plain text after.
_STAND_INS = re.compile("[\U000f0000-\U0010ffff]")
_FIRST_STAND_IN = 0xF0000


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte value."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    spelled = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


def _byte_level(tokens: list[str], merges: list[str], pre: str | None) -> Tokenizer:
    alphabet = set(_bytes_to_unicode().values())
    spelling = _bytes_to_unicode()
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i for i, t in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    split = _SPLITS.get(pre or "")
    if split:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(tokens: list[str], scores: list[float], unk_id: int) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    # Merge order: a pair is ranked by the score of the token it forms (higher merges first).
    ranked = []
    for token, score in zip(tokens, scores, strict=False):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((score, vocab[left], vocab[right], left, right))
    ranked.sort(key=lambda r: (-r[0], r[1], r[2]))
    merges = [(r[3], r[4]) for r in ranked]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk_id], fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok


@dataclass
class TokenizerInfo:
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos: bool
    chat_template: str


class GGUFTokenizer:
    """Text ↔ token ids for one GGUF model, plus its chat template."""

    def __init__(self, tokenizer: Tokenizer, info: TokenizerInfo, vocab_size: int, byte_level: bool = True) -> None:
        self.tok = tokenizer
        self.info = info
        self.vocab_size = vocab_size
        self.byte_level = byte_level  # GPT-2's byte-level BPE, else a sentencepiece vocabulary
        self._template = ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False).from_string(
            info.chat_template
        )
        # Text from clients is tokenized by a copy that never matches control tokens (the flag is the
        # tokenizer's own state, so the shared one cannot flip it per call: encoding runs on a pool).
        self._plain = Tokenizer.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True
        self._control = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        # Longest first: at one position the longest control token wins, as in the tokenizer.
        spelled = sorted(self._control, key=len, reverse=True)
        self._control_text = re.compile("|".join(map(re.escape, spelled))) if spelled else None
        self._template_chars = set(_STAND_INS.findall(info.chat_template))

    @classmethod
    def from_gguf(cls, path_or_reader: str | GGUFFile) -> GGUFTokenizer:
        reader = open_gguf(path_or_reader) if isinstance(path_or_reader, str) else path_or_reader
        kind = field_value(reader, "tokenizer.ggml.model")
        tokens = list(field_value(reader, "tokenizer.ggml.tokens") or [])
        if not tokens:
            raise ModelLoadError("GGUF has no tokenizer.ggml.tokens")
        types = list(field_value(reader, "tokenizer.ggml.token_type") or [])
        if kind == "gpt2":
            tok = _byte_level(
                tokens,
                list(field_value(reader, "tokenizer.ggml.merges") or []),
                field_value(reader, "tokenizer.ggml.pre"),
            )
            add_bos_default = False
        elif kind == "llama":
            scores = list(field_value(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens))
            tok = _sentencepiece(tokens, scores, int(field_value(reader, "tokenizer.ggml.unknown_token_id", 0)))
            add_bos_default = True
        else:
            raise ModelLoadError(f"unsupported tokenizer model {kind!r} (supported: gpt2, llama)")
        control = [
            AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=False) if ty == CONTROL
        ]
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=False)
            if ty == USER_DEFINED
        ]
        if control:
            tok.add_special_tokens(control)
        if user:
            tok.add_tokens(user)
        bos = field_value(reader, "tokenizer.ggml.bos_token_id")
        eos = field_value(reader, "tokenizer.ggml.eos_token_id")
        eot = field_value(reader, "tokenizer.ggml.eot_token_id")
        eos_ids = tuple(int(t) for t in dict.fromkeys(x for x in (eos, eot) if x is not None))
        info = TokenizerInfo(
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            add_bos=bool(field_value(reader, "tokenizer.ggml.add_bos_token", add_bos_default)),
            chat_template=field_value(reader, "tokenizer.chat_template") or DEFAULT_CHAT_TEMPLATE,
        )
        return cls(tok, info, len(tokens), byte_level=kind == "gpt2")

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if add_special and self.info.add_bos and self.info.bos_token_id is not None:
            ids = [self.info.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def control_ids(self) -> set[int]:
        """The ids of control tokens (EOS, the chat template's markers): never text a client wrote."""
        return set(self._control.values())

    def token_text(self, token_id: int) -> str:
        return self.tok.id_to_token(token_id) or ""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for alone (OpenAI's logprobs `bytes`): a byte-level piece read back
        through GPT-2's byte alphabet, a sentencepiece `<0xNN>` as its byte and `▁` as a space; a control
        token as its text."""
        piece = self.token_text(token_id)
        if piece in self._control:
            return piece.encode()
        if self.byte_level:
            return bytes(_UNICODE_TO_BYTE.get(c, 0x3F) for c in piece)  # (0x3F "?": a char outside the alphabet)
        if _BYTE_PIECE.fullmatch(piece):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("▁", " ").encode()

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[Any] | None = None
    ) -> str:
        bos = self.token_text(self.info.bos_token_id) if self.info.bos_token_id is not None else ""
        eos = self.token_text(self.info.eos_token_ids[0]) if self.info.eos_token_ids else ""
        extra = {"tools": tools} if tools else {}
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos, **extra
        )

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[Any] | None = None
    ) -> list[int]:
        """Token ids of the rendered chat: control tokens where the template writes them, and the text of
        the messages (and of `tools`, for a template that writes them) as plain text, so a message cannot
        end its turn or open another role's."""
        # The template writes any BOS it wants itself, so none is added here.
        control = self._control_text
        if control is None:
            return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special=False)
        stand_in, spelled = self._stand_ins([messages, tools])

        def disarm(value: Any) -> Any:
            if isinstance(value, str):
                return control.sub(lambda m: stand_in[m[0]], value)
            if isinstance(value, dict):
                return {disarm(k): disarm(v) for k, v in value.items()}
            if isinstance(value, list):
                return [disarm(v) for v in value]
            return value

        text = self.render_chat(disarm(messages), add_generation_prompt, disarm(tools))
        back = str.maketrans(spelled)
        ids: list[int] = []
        start = 0
        for found in control.finditer(text):  # (only the template's are left)
            ids += self._plain_ids(text[start : found.start()].translate(back))
            ids.append(self._control[found[0]])
            start = found.end()
        return ids + self._plain_ids(text[start:].translate(back))

    def _plain_ids(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids if text else []

    def _stand_ins(self, given: Any) -> tuple[dict[str, str], dict[str, str]]:
        """A private-use character for each control token's text, none that the template or any string in
        `given` holds already (so one a client sent is never spelled back as a control token's text); and
        the reverse map."""
        taken = set(self._template_chars)
        stack = [given]
        while stack:
            value = stack.pop()
            if isinstance(value, str):
                taken.update(_STAND_INS.findall(value))
            elif isinstance(value, dict):
                stack.extend(value.keys())
                stack.extend(value.values())
            elif isinstance(value, list):
                stack.extend(value)
        free = (c for c in map(chr, range(_FIRST_STAND_IN, 0x110000)) if c not in taken)
        stand_in = dict(zip(self._control, free, strict=False))
        return stand_in, {c: t for t, c in stand_in.items()}
