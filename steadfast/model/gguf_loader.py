"""Loading a llama-architecture GGUF file's weights (its metadata is gguf_meta.py's).

Quantized tensors are dequantized once at load into plain torch tensors. GGUF stores the Q and K
projections permuted for llama.cpp's adjacent-pair RoPE; they are permuted back here so the model
can use the half-split RoPE of the original checkpoint (and match `transformers` bit for bit).
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from steadfast.model.gguf_file import GGUFFile, GGUFTensor
from steadfast.model.gguf_meta import LlamaConfig, ModelLoadError


def _dequantize(tensor: GGUFTensor) -> np.ndarray:
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


def load_weights(reader: GGUFFile, cfg: LlamaConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
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
