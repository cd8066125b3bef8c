"""The residual add and RMSNorm of bf16 rows in one call (`csrc/rms_norm.c`, AVX-512): per layer twice,
instead of seven torch ops each (a decode step of the default model spends ~1.5 ms in them). Rounds at
the same points as the model's torch path (the sum to bf16, the normalised row to bf16, the scaled one
to bf16); each row alone, so a row's result does not depend on the rows computed with it."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from steadfast.model.kernels import load_library

SOURCE = Path(__file__).with_name("csrc") / "rms_norm.c"


class AddRMSNorm:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.add_rms_norm_bf16
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [
            ctypes.c_void_p,  # x, updated in place when delta is given
            ctypes.c_long,  # x row stride
            ctypes.c_void_p,  # delta or NULL
            ctypes.c_long,  # delta row stride
            ctypes.c_void_p,  # weight [dim]
            ctypes.c_void_p,  # out [rows, dim]
            ctypes.c_long,  # rows
            ctypes.c_long,  # dim
            ctypes.c_float,  # eps
            ctypes.c_int,  # threads
        ]

    @staticmethod
    def handles(x: torch.Tensor) -> bool:
        return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2 and x.shape[1] % 16 == 0

    def __call__(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`x += delta` (when given) in place, then the normalised, scaled rows of x as a new tensor."""
        if x.stride(1) != 1 or weight.dtype != x.dtype or not weight.is_contiguous():
            raise ValueError("x rows must be contiguous and the weight in x's dtype")
        if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype or delta.stride(1) != 1):
            raise ValueError(f"delta {tuple(delta.shape)} {delta.dtype} does not match x {tuple(x.shape)}")
        rows, dim = x.shape
        out = torch.empty((rows, dim), dtype=x.dtype)
        d_ptr, d_stride = (delta.data_ptr(), delta.stride(0)) if delta is not None else (None, 0)
        args = (x.data_ptr(), x.stride(0), d_ptr, d_stride, weight.data_ptr(), out.data_ptr(), rows, dim)
        rc = self._fn(*args, eps, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"rms norm failed (code {rc})")
        return out


def load() -> AddRMSNorm | None:
    """The kernel, or None where it cannot run here (no compiler, no AVX-512)."""
    lib = load_library(SOURCE, "bf16 rms norm", "rms_norm_supported")
    return AddRMSNorm(lib) if lib is not None else None
