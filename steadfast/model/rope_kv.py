"""RoPE of a layer's Q and K heads in place in the fused QKV rows, and each token's roped K and its V
written to its slot of the paged arena, in one C call (`csrc/rope_kv.c`, AVX-512) instead of ~20 torch
ops per layer (a decode step of the default model spent ~1 ms on them). Same rounding points as the
model's torch path and no fused multiply-add, so both give the same bits, in bf16 and in fp32."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from steadfast.model.kernels import load_library

SOURCE = Path(__file__).with_name("csrc") / "rope_kv.c"


class RopeKV:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.rope_kv_store
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [
            ctypes.c_void_p,  # qkv [n, (heads + 2 kv_heads) * dim], updated in place (Q and K roped)
            ctypes.c_long,  # qkv row stride
            ctypes.c_void_p,  # cos table [positions, dim]
            ctypes.c_void_p,  # sin table [positions, dim]
            ctypes.c_long,  # positions in the tables
            ctypes.c_void_p,  # positions int64 [n]
            ctypes.c_void_p,  # slots int64 [n]
            ctypes.c_void_p,  # one layer's K/V [2, kv_heads, total_slots, dim]
            ctypes.c_long,  # total slots
            ctypes.c_long,  # n
            *[ctypes.c_int] * 3,  # heads, kv_heads, dim
            ctypes.c_int,  # bf16 (else fp32)
            ctypes.c_int,  # threads
        ]

    def __call__(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        slots: torch.Tensor,
        heads: int,
        kv_heads: int,
    ) -> None:
        """qkv: a layer's QKV rows, contiguous within a row; cos, sin: `[positions, dim]` tables in qkv's dtype;
        positions, slots: int64 `[n]`; kv_cache: one layer, `[2, kv_heads, blocks, block_size, dim]`."""
        n = qkv.shape[0]
        dim = cos.shape[1]
        total_slots = kv_cache.shape[2] * kv_cache.shape[3]
        if qkv.shape[1] != (heads + 2 * kv_heads) * dim or kv_cache.shape[1] != kv_heads or kv_cache.shape[4] != dim:
            raise ValueError(f"qkv {tuple(qkv.shape)} and K/V {tuple(kv_cache.shape)} do not match the heads")
        if qkv.stride(1) != 1 or not kv_cache.is_contiguous() or kv_cache.dtype != qkv.dtype:
            raise ValueError("qkv rows and the K/V layer must be contiguous, in one dtype")
        for t in (positions, slots):
            if t.dtype != torch.int64 or not t.is_contiguous() or t.shape != (n,):
                raise ValueError("positions and slots must be contiguous int64, one per row")
        if cos.dtype != qkv.dtype or sin.dtype != qkv.dtype or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("the cos and sin tables must be contiguous, in qkv's dtype")
        rc = self._fn(
            qkv.data_ptr(),
            qkv.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            cos.shape[0],
            positions.data_ptr(),
            slots.data_ptr(),
            kv_cache.data_ptr(),
            total_slots,
            n,
            heads,
            kv_heads,
            dim,
            int(qkv.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
        if rc == -2:
            raise IndexError("a position or K/V slot is out of range")
        if rc != 0:
            raise RuntimeError(f"rope and K/V store failed (code {rc})")


def supports(dtype: torch.dtype, device: str, dim: int) -> bool:
    """Whether the kernel handles this model: bf16 or fp32 on the CPU, heads of a multiple of 32."""
    return device == "cpu" and dtype in (torch.bfloat16, torch.float32) and dim % 32 == 0


def load() -> RopeKV | None:
    """The kernel, or None where it cannot run here (no compiler, no AVX-512)."""
    lib = load_library(SOURCE, "RoPE and K/V store", "rope_kv_supported")
    return RopeKV(lib) if lib is not None else None
