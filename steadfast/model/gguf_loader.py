"""Reading a llama-architecture GGUF file: hyper-parameters, tokenizer metadata and weights.

Quantized tensors are dequantized once at load into plain torch tensors. GGUF stores the Q and K
projections permuted for llama.cpp's adjacent-pair RoPE; they are permuted back here so the model
can use the half-split RoPE of the original checkpoint (and match `transformers` bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

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


def open_gguf(path: str) -> gguf.GGUFReader:
    if not Path(path).is_file():
        raise ModelLoadError(f"model file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises several types for a file that is not GGUF
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


def field_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def read_config(reader: gguf.GGUFReader) -> LlamaConfig:
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


def _dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    # numpy shape is GGUF's ne reversed: [out_features, in_features] for a linear weight.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        array = np.asarray(tensor.data, dtype=np.float32)
    else:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return array.reshape(shape)


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (adjacent RoPE pairs → halves of each head)."""
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def load_weights(reader: gguf.GGUFReader, cfg: LlamaConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor by its GGUF name, dequantized, Q/K un-permuted, in `dtype`."""
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        array = _dequantize(tensor)
        name = tensor.name
        if name.endswith("attn_q.weight"):
            array = unpermute_qk(array, cfg.num_heads)
        elif name.endswith("attn_k.weight"):
            array = unpermute_qk(array, cfg.num_kv_heads)
        weights[name] = torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).to(dtype)
    if "token_embd.weight" not in weights:
        raise ModelLoadError("GGUF has no token_embd.weight")
    for i in range(cfg.num_layers):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            if f"blk.{i}.{part}.weight" not in weights:
                raise ModelLoadError(f"GGUF lacks blk.{i}.{part}.weight")
    return weights
