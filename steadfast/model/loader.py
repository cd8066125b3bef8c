"""A GGUF file to a model ready to compute: weights laid out (or mapped from the node's weight store),
the native kernels this machine and dtype can use chosen, the batch-invariant mode checked. Runs in the
zygote once (workers forked from it share the result) or in a worker of its own."""

from __future__ import annotations

import logging
import sys
from typing import NamedTuple

import torch

from steadfast.config import Config, ConfigError
from steadfast.kv.arena.arena import TORCH_DTYPES
from steadfast.kv.arena.files import ArenaSpaceError
from steadfast.model import decode_layers, paged_attention, quant_matmul, rms_norm, rope_kv, rowwise_matmul
from steadfast.model.gguf_loader import load_weights
from steadfast.model.gguf_meta import LlamaConfig, max_model_len, open_gguf, read_config
from steadfast.model.layers import NativeWeights, compute_layout, native_layout
from steadfast.model.llama import LlamaModel
from steadfast.model.store import open_layout
from steadfast.model.tokenizer import GGUFTokenizer

log = logging.getLogger(__name__)


class ModelParts(NamedTuple):
    model_cfg: LlamaConfig
    model: LlamaModel
    tokenizer: GGUFTokenizer
    max_model_len: int


def build_model(cfg: Config, weights_dir: str = "") -> ModelParts:
    """`weights_dir`: the folder of the node's weight store, where the compute layout is mapped from
    (made there first if no worker has); empty, or `model.shared_weights` off: this worker's own copy."""
    reader = open_gguf(cfg.model.resolved_path)
    model_cfg = read_config(reader)
    limit = max_model_len(cfg, model_cfg)
    dtype = TORCH_DTYPES[cfg.model.resolved_dtype]

    def build() -> dict[str, torch.Tensor]:
        return compute_layout(load_weights(reader, model_cfg, dtype), model_cfg)

    layout = None
    if weights_dir and cfg.model.shared_weights:
        try:
            layout = open_layout(weights_dir, cfg.model.resolved_path, cfg.model.resolved_dtype, build)
        except (OSError, ArenaSpaceError) as exc:  # no room in the folder, say: this worker still serves
            log.warning("weight store not usable, loading a copy of the model of this worker's own: %s", exc)
    if layout is None:
        layout = build()
    device = cfg.model.resolved_device
    if device != "cpu":
        layout = {name: w.to(device) for name, w in layout.items()}
    paged = None
    if cfg.model.decode_attention == "auto" and paged_attention.supports(
        dtype,
        device,
        model_cfg.num_heads,
        model_cfg.num_kv_heads,
        model_cfg.head_dim,
        cfg.cache.block_size,
    ):
        paged = paged_attention.load()
    log.info("decode attention: %s", "in-place kernel" if paged is not None else "torch gather")
    rowwise = None
    if cfg.model.fp32_matmul == "auto" and dtype == torch.float32 and device == "cpu":
        rowwise = rowwise_matmul.load()
        log.info("fp32 matmuls: %s", "row-wise kernel" if rowwise is not None else "torch")
    native = None
    # "auto" asks for the batch-invariant mode in bf16 only: fp32 keeps its path exact against transformers.
    want_invariant = cfg.model.deterministic == "on" or (cfg.model.deterministic == "auto" and dtype == torch.bfloat16)
    wanted = cfg.model.weights == "native" or (cfg.model.weights == "auto" and dtype == torch.bfloat16)
    if wanted and device == "cpu" and dtype in (torch.float32, torch.bfloat16):
        matmul = quant_matmul.load()
        weights = native_layout(reader.tensors, model_cfg) if matmul is not None else {}
        if matmul is not None and dtype == torch.bfloat16 and not matmul.int8 and cfg.model.weights == "auto":
            weights = {}  # bf16 computed as fp32 by the kernel: slower than oneDNN's bf16 matmuls
        if matmul is not None and weights and dtype == torch.bfloat16:
            # Packed here, in the zygote where workers are forked from it: they share the copy.
            weights = {name: matmul.pack(w) for name, w in weights.items()}
        if matmul is not None and weights:
            # In fp32 every call: the kernel's rows are batch-invariant and its weights exact (BLAS's
            # would be the same values, summed in another order).
            rows = sys.maxsize if dtype == torch.float32 or want_invariant else cfg.model.native_max_rows
            native = NativeWeights(weights, matmul, rows)
        log.info("native quantized weights: %d of the linear weights", len(weights))
    norm = rms_norm.load() if dtype == torch.bfloat16 and device == "cpu" else None
    rope = rope_kv.load() if rope_kv.supports(dtype, device, model_cfg.head_dim) else None
    decode = decode_layers.load() if dtype == torch.bfloat16 and device == "cpu" else None
    model = LlamaModel(
        model_cfg,
        layout,
        dtype,
        limit,
        paged=paged,
        rowwise=rowwise,
        native=native,
        norm=norm,
        rope_kv=rope,
        decode=decode,
    )
    log.info("decode steps: %s", "one call for the layers" if model.step is not None else "layer by layer")
    gaps: list[str] = []
    if want_invariant:
        gaps = model.invariance_gaps()
        if cfg.cache.block_size != paged_attention.BLOCK_SIZE:
            gaps.append(f"the in-place attention kernel takes blocks of {paged_attention.BLOCK_SIZE} tokens")
        if gaps and cfg.model.deterministic == "on":
            raise ConfigError("model.deterministic cannot hold on this machine and model: " + "; ".join(gaps))
        model.deterministic = not gaps
    if model.deterministic:
        log.info("deterministic: every row attended in place and computed by row-wise kernels")
    elif want_invariant:
        log.info("deterministic: off (model.deterministic auto), it cannot hold here: %s", "; ".join(gaps))
    return ModelParts(model_cfg, model, GGUFTokenizer.from_gguf(reader), limit)
