"""The model's weights as it computes with them: a linear layer (torch's matmul, the row-wise fp32
kernel, or the GGUF's own quantized blocks through the native kernel), the LM head, and the layouts
weights are put in (fused QKV and gate-up rows for compute, quantized rows for the native kernel)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from steadfast.model.gguf_file import GGUFTensor
from steadfast.model.gguf_meta import LlamaConfig
from steadfast.model.quant_matmul import QuantMatmul, QuantWeight
from steadfast.model.rowwise_matmul import RowwiseMatmul


@dataclass(frozen=True)
class NativeWeights:
    """The GGUF's own quantized weights by compute-layout name (`native_layout`), computed with for calls
    of at most `max_rows` rows (a decode step reads 4.5 bits a weight instead of 16)."""

    weights: dict[str, QuantWeight]
    matmul: QuantMatmul
    max_rows: int


class Linear:
    """`x @ weight_t`, from the transposed weight `[in_features, out_features]` as the compute layout
    holds it (`compute_layout`; mapped read-only from the node's weight store, or a private copy). In
    bf16 on CPU the weight is pre-packed once for oneDNN, which then skips the per-call weight reorder:
    1.5x (batch 64) to 2.6x (batch 1) faster, bit-identical results; that packed copy is the worker's own
    (oneDNN's opaque layout cannot live in a shared file). In fp32 on an AVX-512 CPU our row-wise kernel
    (`rowwise_matmul.py`): a row's result does not depend on the rows computed with it, and a batch of
    decodes or a verification costs about what one row does (`model.fp32_matmul: torch`: BLAS). With
    `native` (the GGUF's quantized weight, its kernel and a row limit) calls of up to that many rows use
    the quantized weight (`quant_matmul.py`)."""

    def __init__(
        self,
        weight_t: torch.Tensor,
        rowwise: RowwiseMatmul | None = None,
        native: tuple[QuantWeight, QuantMatmul, int] | None = None,
    ) -> None:
        self.native = native
        # fp32 on CPU: our row-wise kernel where it handles the weight (for every row count alike).
        self.rowwise = rowwise if rowwise is not None and rowwise.handles(weight_t) else None
        self.packed: torch.Tensor | None = None
        # Where the native kernel takes every call (`model.deterministic`) oneDNN never sees this weight:
        # no packed copy (~270 MB for the default model), and the mapped weight's pages stay untouched.
        every_call_native = native is not None and native[2] == sys.maxsize
        cpu_bf16 = weight_t.dtype == torch.bfloat16 and weight_t.device.type == "cpu"
        if cpu_bf16 and not every_call_native and torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight_t.t().contiguous(), None)
            except (RuntimeError, AttributeError):  # a build without the op: fall back to the plain matmul
                self.packed = None
        self.weight_t = None if self.packed is not None else weight_t

    def native_for(self, x: torch.Tensor) -> bool:
        return self.native is not None and x.shape[0] <= self.native[2]

    def __call__(self, x: torch.Tensor, fp32_out: bool = False) -> torch.Tensor:
        """`x @ weight_t`; `fp32_out`: not rounded to x's dtype where the kernel can (the native one)."""
        if self.native_for(x):
            assert self.native is not None
            return self.native[1](x, self.native[0], fp32_out)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        assert self.weight_t is not None
        if self.rowwise is not None:
            return self.rowwise(x, self.weight_t)
        return x @ self.weight_t


class LMHead:
    """The LM head, `x @ lm_head.t`. In fp32 on CPU, with the head tied to the embeddings, rows after
    the first can also be computed as `embed @ x.T` from the embedding's own `[vocab, hidden]` layout at
    no memory cost: on some CPUs (an AVX2 EPYC) BLAS's GEMM over the transposed head is 2-4x slower for
    2-16 rows (batched decodes, speculative verification) than the GEMV for one row, and the other
    orientation is not. Which one serves several rows is measured once, at load. On the native weights
    the logits come out in fp32, not rounded to bf16 (whose steps of 0.125 at 16-32 tie near choices)."""

    PROBE_ROWS = 4

    def __init__(
        self,
        weight_t: torch.Tensor,
        embed: torch.Tensor,
        rowwise: RowwiseMatmul | None = None,
        native: tuple[QuantWeight, QuantMatmul, int] | None = None,
    ) -> None:
        self.linear = Linear(weight_t, rowwise, native)
        self.rows_first: torch.Tensor | None = None
        if self.linear.rowwise is not None:
            return  # every row count on the one kernel: no other orientation to weigh
        if weight_t.dtype == torch.float32 and weight_t.device.type == "cpu" and torch.equal(embed, weight_t.t()):
            if self._seconds(lambda x: (embed @ x.t()).t(), weight_t) < self._seconds(self.linear, weight_t):
                self.rows_first = embed

    @classmethod
    def _seconds(cls, fn: Callable[[torch.Tensor], torch.Tensor], weight_t: torch.Tensor) -> float:
        x = torch.zeros(cls.PROBE_ROWS, weight_t.shape[0], dtype=weight_t.dtype)
        fn(x)
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            fn(x)
            best = min(best, time.perf_counter() - t0)
        return best

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows_first is not None and x.shape[0] > 1 and not self.linear.native_for(x):
            return (self.rows_first @ x.t()).t()
        return self.linear(x, fp32_out=True)


def compute_layout(weights: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """The tensors the model computes with, from a GGUF's weights by name: fused projections (one matmul
    for Q|K|V and one for gate|up keeps the op count low), every linear weight transposed and contiguous
    (`Linear`), the LM head its own tensor even when tied to the embeddings. What the weight store keeps."""
    out = {
        "embed": weights["token_embd.weight"],
        "final_norm": weights["output_norm.weight"],
        "lm_head.t": weights.get("output.weight", weights["token_embd.weight"]).t().contiguous(),
    }
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        qkv = torch.cat([weights[p + "attn_q.weight"], weights[p + "attn_k.weight"], weights[p + "attn_v.weight"]])
        gate_up = torch.cat([weights[p + "ffn_gate.weight"], weights[p + "ffn_up.weight"]])
        out |= {
            f"{i}.attn_norm": weights[p + "attn_norm.weight"],
            f"{i}.qkv.t": qkv.t().contiguous(),
            f"{i}.o.t": weights[p + "attn_output.weight"].t().contiguous(),
            f"{i}.ffn_norm": weights[p + "ffn_norm.weight"],
            f"{i}.gate_up.t": gate_up.t().contiguous(),
            f"{i}.down.t": weights[p + "ffn_down.weight"].t().contiguous(),
        }
    return out


def native_layout(tensors: list[GGUFTensor], cfg: LlamaConfig) -> dict[str, QuantWeight]:
    """`compute_layout`'s linear weights (by its names) that can stay in the GGUF's blocks: each fused
    projection whose parts all are of one type the kernel handles; the others are left out."""
    by_name = {t.name: t for t in tensors}
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}

    def rows(*names: str) -> QuantWeight | None:
        parts = [by_name.get(n) for n in names]
        if any(p is None or not QuantWeight.handles(p) for p in parts):
            return None
        weights = [QuantWeight.of(p, heads.get(n.split(".")[-2], 0)) for n, p in zip(names, parts, strict=True)]
        try:
            return QuantWeight.stack(weights)
        except ValueError:  # parts of different types: dequantized
            return None

    wanted = {"lm_head.t": ("output.weight",) if "output.weight" in by_name else ("token_embd.weight",)}
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        wanted |= {
            f"{i}.qkv.t": (p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"),
            f"{i}.o.t": (p + "attn_output.weight",),
            f"{i}.gate_up.t": (p + "ffn_gate.weight", p + "ffn_up.weight"),
            f"{i}.down.t": (p + "ffn_down.weight",),
        }
    found = {name: rows(*parts) for name, parts in wanted.items()}
    return {name: w for name, w in found.items() if w is not None}
