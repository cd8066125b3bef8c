"""`x @ w_t` in fp32 with our own kernel (`csrc/rowwise_matmul.c`, AVX-512): every output sums its
products in one fixed order whatever the number of rows, their companions or the thread count.

Two things follow. A row's result is the same bits in a decode, a speculative verification of several
positions, a prefill chunk or a batch of any size, so speculation, batch changes, takeovers and
migrations cannot change a token in fp32 by rounding. And a few rows cost about what one costs: the
kernel reads each weight once per group of up to 8 rows, where BLAS's GEMM for 2-8 rows cost 2-4x its
one-row GEMV here (weights hot in cache; in-model figures in BENCHMARKS.md). Where there is no compiler,
no AVX-512, or a weight it does not handle (columns not a multiple of 16), the model keeps torch's
matmul for that weight, for every row count alike.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from steadfast.model.kernels import load_library

SOURCE = Path(__file__).with_name("csrc") / "rowwise_matmul.c"


class RowwiseMatmul:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.rowwise_matmul_f32
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [
            ctypes.c_void_p,  # x
            ctypes.c_long,  # x row stride, elements
            ctypes.c_void_p,  # w_t [K, N], contiguous
            ctypes.c_void_p,  # y [m, N], written
            ctypes.c_long,  # m
            ctypes.c_long,  # K
            ctypes.c_long,  # N
            ctypes.c_int,  # threads
        ]

    @staticmethod
    def handles(w_t: torch.Tensor) -> bool:
        return (
            w_t.dtype == torch.float32
            and w_t.device.type == "cpu"
            and w_t.dim() == 2
            and w_t.is_contiguous()
            and w_t.shape[1] % 16 == 0
        )

    def __call__(self, x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
        """`x @ w_t` for x `[..., K]` fp32 and a weight `handles` accepts."""
        lead = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1 or rows.dtype != torch.float32:
            rows = rows.contiguous().float()
        m, k = rows.shape
        n = w_t.shape[1]
        if k != w_t.shape[0]:
            raise ValueError(f"x has {k} columns, the weight {w_t.shape[0]} rows")
        y = torch.empty((m, n), dtype=torch.float32)
        if m:
            threads = torch.get_num_threads()
            rc = self._fn(rows.data_ptr(), rows.stride(0), w_t.data_ptr(), y.data_ptr(), m, k, n, threads)
            if rc != 0:
                raise RuntimeError(f"rowwise matmul failed (code {rc})")
        return y.reshape(*lead, n)


def load() -> RowwiseMatmul | None:
    """The kernel, or None where it cannot run here (no compiler, no AVX-512)."""
    lib = load_library(SOURCE, "fp32 matmul", "rowwise_matmul_supported")
    return RowwiseMatmul(lib) if lib is not None else None
