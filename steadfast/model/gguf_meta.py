"""A llama-architecture GGUF file's metadata: hyper-parameters and the checks that it can be served.

Torch-free on purpose: the router and the supervisor read a model's shape (context length, layers,
KV heads) without importing torch; only the worker loads weights (gguf_loader.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from steadfast.model.gguf_file import GGUFFile, GGUFFormatError

if TYPE_CHECKING:
    from steadfast.config import Config

SUPPORTED_ARCHITECTURES = ("llama",)


class ModelLoadError(ValueError):
    """The file is not a GGUF this engine can serve."""


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


def open_gguf(path: str) -> GGUFFile:
    if not Path(path).is_file():
        raise ModelLoadError(f"model file not found: {path}")
    try:
        return GGUFFile(path)
    except (GGUFFormatError, OSError, ValueError) as exc:  # ValueError: numpy cannot map an empty file
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


def field_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.get(key, default)


def read_config(reader: GGUFFile) -> LlamaConfig:
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch!r}; supported: {SUPPORTED_ARCHITECTURES}")

    def need(key: str) -> Any:
        value = field_value(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    scaling = field_value(reader, f"{arch}.rope.scaling.type")
    if (scaling not in (None, "none")) or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        # Serving such a model with plain RoPE would give plausible but wrong text past the trained length.
        raise ModelLoadError(f"RoPE scaling ({scaling or 'rope_freqs'}) is not supported yet")
    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(field_value(reader, f"{arch}.attention.head_count_kv", heads))
    vocab = field_value(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(field_value(reader, "tokenizer.ggml.tokens"))
    head_dim = int(field_value(reader, f"{arch}.attention.key_length", hidden // heads))
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(field_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        context_length=int(field_value(reader, f"{arch}.context_length", 2048)),
    )


def max_model_len(cfg: Config, model_cfg: LlamaConfig) -> int:
    """The longest sequence served: the configured limit, never past the model's trained context."""
    return min(cfg.model.max_model_len or model_cfg.context_length, model_cfg.context_length)
