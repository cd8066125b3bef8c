"""Linear layers over the GGUF's own quantized weights (`csrc/quant_matmul.c`, AVX-512): Q4_1 and Q8_0
blocks computed on as the file stores them, so a decode step reads ~5 bits a weight instead of bf16's 16
(the default SmolLM2 file: Q4_1 layers, a Q8_0 embedding that is also the LM head). fp32 inputs: products
with the dequantized fp32 weights, the blocks read in place. bf16 inputs, where the CPU has AVX512-VNNI
(`QuantMatmul.int8`): integer dot products with each 32-value block of x written as two int8 digits (~15
bits against the block's largest value; one digit, as llama.cpp's Q8_1, lost ~1 % of a projection and
flipped greedy tokens), on a copy of the blocks packed once (`QuantMatmul.pack`) in panels of 16 outputs
so that a vector lane is one output: no reduction across lanes, and 32 rows cost ~0.7x oneDNN's bf16
matmul on the dequantized weights (one row ~0.8x the unpacked blocks' kernel). Elsewhere bf16 inputs are
computed as fp32.

A `QuantWeight` is a list of row addresses into the mapped file: fused projections and llama.cpp's Q/K
row order (`gguf_loader.unpermute_qk`) are row lists. Whichever path, a row's result does not depend on
the other rows of its call, their number or the thread count. Other GGUF types are not handled here (the
model keeps dequantized weights for them).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import gguf
import numpy as np
import torch

from steadfast.model.gguf_file import GGUFTensor
from steadfast.model.gguf_loader import unpermute_qk
from steadfast.model.kernels import load_library

SOURCE = Path(__file__).with_name("csrc") / "quant_matmul.c"
TYPES = (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0)


@dataclass(frozen=True)
class QuantWeight:
    """`[out_features, in_features]` in blocks: `rows[n]` is the address of output row n's blocks."""

    qtype: gguf.GGMLQuantizationType
    in_features: int
    rows: torch.Tensor  # int64 [out_features] addresses
    keep: tuple[np.ndarray, ...]  # the mapped tensors the addresses point into (kept alive)
    panels: torch.Tensor | None = None  # uint8, the rows packed for bf16 inputs (`QuantMatmul.pack`)

    @property
    def out_features(self) -> int:
        return self.rows.shape[0]

    @cached_property
    def call_args(self) -> tuple[int, int]:
        """The row addresses' address and the type id, as the kernel takes them (looked up once)."""
        return self.rows.data_ptr(), int(self.qtype)

    @staticmethod
    def handles(tensor: GGUFTensor) -> bool:
        return tensor.tensor_type in TYPES and len(tensor.shape) == 2 and tensor.shape[0] % 32 == 0

    @classmethod
    def of(cls, tensor: GGUFTensor, permute_heads: int = 0) -> QuantWeight:
        """One GGUF tensor's rows, in llama.cpp's Q/K order undone when `permute_heads` (its head count)."""
        data = tensor.data
        if not data.flags["C_CONTIGUOUS"]:
            raise ValueError(f"{tensor.name}: rows not contiguous in the file")
        order = np.arange(data.shape[0])
        if permute_heads:
            order = unpermute_qk(order.reshape(-1, 1), permute_heads).reshape(-1)
        rows = data.ctypes.data + order.astype(np.int64) * data.strides[0]
        return cls(tensor.tensor_type, int(tensor.shape[0]), torch.from_numpy(rows), (data,))

    @classmethod
    def stack(cls, parts: list[QuantWeight]) -> QuantWeight:
        """The parts' rows one after another (a fused projection); all of one type and width."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.in_features != first.in_features for p in parts):
            raise ValueError("fused weights must share a type and an input width")
        keep = tuple(a for p in parts for a in p.keep)
        return cls(first.qtype, first.in_features, torch.cat([p.rows for p in parts]), keep)

    @cached_property
    def panel_args(self) -> tuple[int, int]:
        """The packed copy's address and the type id (`panels` set)."""
        assert self.panels is not None
        return self.panels.data_ptr(), int(self.qtype)


class QuantMatmul:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.int8 = bool(lib.quant_matmul_int8())  # bf16 inputs take the integer path (packed weights)
        self._fn = lib.quant_matmul
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [
            ctypes.c_void_p,  # x
            ctypes.c_long,  # x row stride, elements
            ctypes.c_void_p,  # row addresses
            ctypes.c_int,  # GGML type
            ctypes.c_void_p,  # y [m, N], written
            ctypes.c_long,  # m
            ctypes.c_long,  # K
            ctypes.c_long,  # N
            ctypes.c_int,  # bf16 (else fp32)
            ctypes.c_int,  # threads
        ]
        self._packed = lib.quant_matmul_packed
        self._packed.restype = ctypes.c_int
        self._packed.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        self._packed.argtypes += [ctypes.c_long] * 3 + [ctypes.c_int] * 2  # m, K, N, fp32 out, threads
        self._pack = lib.quant_pack
        self._pack.restype = ctypes.c_int
        # row addresses, type, K, N, out, threads
        self._pack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
        self._pack.argtypes += [ctypes.c_int]
        self._pack_bytes = lib.quant_pack_bytes
        self._pack_bytes.restype = ctypes.c_long
        self._pack_bytes.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_long]

    def pack(self, w: QuantWeight) -> QuantWeight:
        """`w` with its packed copy for bf16 inputs (`w` itself where they do not take the integer path)."""
        if not self.int8 or w.panels is not None:
            return w
        n, qtype = w.out_features, int(w.qtype)
        panels = torch.empty(self._pack_bytes(qtype, w.in_features, n), dtype=torch.uint8)
        rc = self._pack(w.rows.data_ptr(), qtype, w.in_features, n, panels.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"packing a quantized weight failed (code {rc})")
        return replace(w, panels=panels)

    def __call__(self, x: torch.Tensor, w: QuantWeight, fp32_out: bool = False) -> torch.Tensor:
        """`x @ w.T` for x `[..., K]` fp32 or bf16 on the CPU, in x's dtype, or fp32 with `fp32_out` (the
        LM head: bf16 logits of 16-32 are steps of 0.125 apart, which ties a prompt's best tokens where
        they differ by less). A bf16 call on a weight not yet packed packs it for this call only (the
        model packs its weights once, at load)."""
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"quantized matmul takes fp32 or bf16, not {x.dtype}")
        # A layer's [m, K] rows as they come cost no reshape (per call, ~100 calls a decode step).
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        m, k = rows.shape
        if k != w.in_features:
            raise ValueError(f"x has {k} columns, the weight {w.in_features}")
        n = w.rows.shape[0]
        packed = x.dtype == torch.bfloat16 and self.int8
        y = torch.empty((m, n), dtype=torch.float32 if packed and fp32_out else x.dtype)
        if m:
            threads = torch.get_num_threads()
            if packed:
                w = self.pack(w)  # held: its panels must outlive the call
                address, qtype = w.panel_args
                args = (rows.data_ptr(), rows.stride(0), address, qtype, y.data_ptr(), m, k, n, int(fp32_out))
                rc = self._packed(*args, threads)
            else:
                address, qtype = w.call_args
                bf16 = int(x.dtype == torch.bfloat16)
                args = (rows.data_ptr(), rows.stride(0), address, qtype, y.data_ptr(), m, k, n, bf16)
                rc = self._fn(*args, threads)
            if rc != 0:
                raise RuntimeError(f"quantized matmul failed (code {rc})")
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)


def load() -> QuantMatmul | None:
    """The kernel, or None where it cannot run here (no compiler, no AVX-512)."""
    lib = load_library(SOURCE, "quantized matmul", "quant_matmul_supported")
    return QuantMatmul(lib) if lib is not None else None
