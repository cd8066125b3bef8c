"""Decode attention that reads K/V in place from the paged arena (CPU, AVX-512): builds, caches and
calls the C kernel in `csrc/paged_attention.c`.

The kernel is compiled on first use with the system C compiler for the CPU it runs on, into a cache
keyed by the source, the compiler and the CPU's flags, and shares torch's OpenMP runtime (both link
`libgomp.so.1`; torch's copy is the one loaded). Where there is no compiler, no AVX-512 or a shape it
does not handle, `load` returns None and the model keeps its torch path: this module never decides what
the answer is, only how fast it comes.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from steadfast.model.kernels import load_library

BLOCK_SIZE = 16  # tokens per KV block the kernel is built for (BLOCK in csrc/paged_attention.c)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"


class PagedAttention:
    """`out[r] = softmax(q[r] · K_r / sqrt(dim)) · V_r` for one query token per request, K_r and V_r
    read through request r's block table from one layer of the arena."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.paged_decode_attention
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [
            ctypes.c_void_p,  # q
            ctypes.c_long,  # q row stride, elements
            ctypes.c_void_p,  # one layer's [2, kv_heads, blocks, block_size, dim]
            ctypes.c_void_p,  # out [n, heads * dim]
            ctypes.c_void_p,  # block tables int32 [n, max_blocks]
            ctypes.c_void_p,  # context lengths int32 [n]
            *[ctypes.c_int] * 7,  # n, max_blocks, heads, kv_heads, num_blocks, block_size, dim
            ctypes.c_float,  # scale
            ctypes.c_int,  # bf16 (else fp32)
            ctypes.c_int,  # threads
        ]

    def __call__(
        self, q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, out: torch.Tensor
    ) -> None:
        """q: [n, heads, dim] (rows may be strided, heads and dims contiguous); kv_cache: one layer,
        contiguous; tables: int32 [n, max_blocks]; lens: int32 [n]; out: [n, heads * dim], written."""
        n, heads, dim = q.shape
        _, kv_heads, num_blocks, block_size, _ = kv_cache.shape
        assert q.stride(2) == 1 and q.stride(1) == dim and kv_cache.is_contiguous() and out.is_contiguous()
        assert tables.dtype == torch.int32 and lens.dtype == torch.int32 and tables.is_contiguous()
        rc = self._fn(
            q.data_ptr(),
            q.stride(0),
            kv_cache.data_ptr(),
            out.data_ptr(),
            tables.data_ptr(),
            lens.data_ptr(),
            n,
            tables.shape[1],
            heads,
            kv_heads,
            num_blocks,
            block_size,
            dim,
            dim**-0.5,
            int(q.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"paged decode attention failed (code {rc})")


def supports(dtype: torch.dtype, device: str, heads: int, kv_heads: int, dim: int, block_size: int) -> bool:
    """Whether the kernel handles this model and cache shape (it is built for 16-token blocks)."""
    return (
        device == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and block_size == BLOCK_SIZE
        and dim % 16 == 0
        and dim <= 256
        and heads % kv_heads == 0
        and heads // kv_heads <= 16
    )


def load() -> PagedAttention | None:
    """The kernel, or None where it cannot run here (no compiler, no AVX-512)."""
    lib = load_library(SOURCE, "decode attention", "paged_attention_supported")
    return PagedAttention(lib) if lib is not None else None
