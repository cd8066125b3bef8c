"""A decode step's layers in one C call (`csrc/decode_layers.c`), and the SwiGLU of bf16 rows.

At one to a few rows a step, a layer's dozen kernel calls from Python cost more than some of the kernels
(~40 µs a layer of dispatch, argument checks and output tensors: ~1.5 ms of an 8 ms step of the default
model). For a step whose rows all decode one token, with every projection on the GGUF's own weights, the
fused RMSNorm, the RoPE/K-V store and the paged attention kernels all in use, `DecodePlan.run` makes those
same kernel calls from C, in the Python loop's order and on the same kind of buffers, so its result is the
loop's bit for bit (`tests/unit/test_decode_layers.py`). The library links the kernels' own sources.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from steadfast.model.gguf_meta import LlamaConfig
from steadfast.model.kernels import load_library
from steadfast.model.quant_matmul import QuantWeight

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "decode_layers.c"
LINKED = tuple(CSRC / f"{name}.c" for name in ("quant_matmul", "rms_norm", "rope_kv", "paged_attention"))
BLOCK_SIZE = 16  # the paged attention kernel's


class _Model(ctypes.Structure):
    """`struct model` of the C source: the shape, and where the weights and RoPE tables lie."""

    _fields_ = [
        *[(name, ctypes.c_int) for name in ("layers", "hidden", "heads", "kv_heads", "dim", "inter")],
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *[(name, ctypes.c_void_p) for name in ("attn_norm", "ffn_norm", "weights", "types", "cos", "sin")],
        ("positions", ctypes.c_long),
    ]


@dataclass(frozen=True)
class LayerWeights:
    """One layer as the step computes it: its two norm weights and four quantized projections."""

    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    qkv: QuantWeight
    o: QuantWeight
    gate_up: QuantWeight
    down: QuantWeight


class DecodePlan:
    """One model's layers, ready for `run` (the tensors the C struct points into are kept here)."""

    def __init__(
        self, fn: ctypes._CFuncPtr, cfg: LlamaConfig, layers: list[LayerWeights], cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        self._fn = fn
        self.cfg = cfg
        self.inter = layers[0].down.in_features
        self._keep = (cos, sin, layers)
        by_kind = ([w.attn_norm for w in layers], [w.ffn_norm for w in layers])
        self._norms = [torch.tensor([n.data_ptr() for n in norms], dtype=torch.int64) for norms in by_kind]
        weights = [q for w in layers for q in (w.qkv, w.o, w.gate_up, w.down)]
        if any(q.panels is None for q in weights):
            raise ValueError("the decode step takes packed weights (QuantMatmul.pack)")
        self._weights = torch.tensor([q.panel_args[0] for q in weights], dtype=torch.int64)
        self._types = torch.tensor([int(q.qtype) for q in weights], dtype=torch.int32)
        self._model = _Model(
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.inter,
            cfg.rms_norm_eps,
            cfg.head_dim**-0.5,
            self._norms[0].data_ptr(),
            self._norms[1].data_ptr(),
            self._weights.data_ptr(),
            self._types.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            cos.shape[0],
        )
        self._scratch = torch.empty(0, dtype=torch.bfloat16)

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        kv: torch.Tensor,
    ) -> torch.Tensor:
        """Every layer for x `[m, hidden]` (bf16, the residual stream, updated in place), one decoded token
        a row: positions, slots int64 `[m]`; tables int32 `[m, max_blocks]`, lens int32 `[m]` (as
        `PagedDecodes`); kv the arena's `[layers, 2, kv_heads, blocks, 16, dim]`. Returns the last
        layer's down projection, not yet added to x (valid until the next call)."""
        cfg = self.cfg
        m = x.shape[0]
        if x.dtype != torch.bfloat16 or not x.is_contiguous() or x.shape[1] != cfg.hidden_size:
            raise ValueError(f"x must be contiguous bf16 [rows, {cfg.hidden_size}], not {x.dtype} {tuple(x.shape)}")
        for t, dtype in ((positions, torch.int64), (slots, torch.int64), (lens, torch.int32)):
            if t.dtype != dtype or not t.is_contiguous() or t.shape != (m,):
                raise ValueError("positions, slots and lens must be contiguous, one per row")
        if tables.dtype != torch.int32 or not tables.is_contiguous() or tables.shape[0] != m:
            raise ValueError("the block tables must be contiguous int32, one row per row")
        if kv.dtype != torch.bfloat16 or not kv.is_contiguous() or kv.dim() != 6 or kv.shape[0] != cfg.num_layers:
            raise ValueError(f"the K/V arena must be contiguous bf16 [layers, ...], not {kv.dtype} {tuple(kv.shape)}")
        if tuple(kv.shape[1:3]) != (2, cfg.num_kv_heads) or tuple(kv.shape[4:]) != (BLOCK_SIZE, cfg.head_dim):
            raise ValueError(f"K/V layers {tuple(kv.shape[1:])} do not match the model")
        q_n = cfg.num_heads * cfg.head_dim
        need = m * (cfg.hidden_size + q_n + 2 * cfg.num_kv_heads * cfg.head_dim + q_n + 3 * self.inter)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.bfloat16)
        delta = torch.empty_like(x)
        rc = self._fn(
            ctypes.byref(self._model),
            m,
            positions.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            lens.data_ptr(),
            tables.shape[1],
            kv.data_ptr(),
            kv.stride(0) * kv.element_size(),
            kv.shape[3],
            x.data_ptr(),
            delta.data_ptr(),
            self._scratch.data_ptr(),
            torch.get_num_threads(),
        )
        if rc == -3:
            raise IndexError("a position or K/V slot is out of range")
        if rc != 0:
            raise RuntimeError(f"decode layers failed (code {rc})")
        return delta


class DecodeLayers:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._silu = lib.silu_mul_bf16
        self._silu.restype = ctypes.c_int
        # gate|up, its row stride, rows, inter, out, threads
        self._silu.argtypes = [ctypes.c_void_p, *[ctypes.c_long] * 3, ctypes.c_void_p, ctypes.c_int]
        self._layers = lib.decode_layers
        self._layers.restype = ctypes.c_int
        self._layers.argtypes = [
            ctypes.POINTER(_Model),
            ctypes.c_long,  # m
            *[ctypes.c_void_p] * 4,  # positions, slots, tables, lens
            ctypes.c_int,  # max_blocks
            ctypes.c_void_p,  # K/V of layer 0
            ctypes.c_long,  # bytes from one layer's K/V to the next
            ctypes.c_int,  # blocks
            *[ctypes.c_void_p] * 3,  # x, delta, scratch
            ctypes.c_int,  # threads
        ]

    @staticmethod
    def handles(cfg: LlamaConfig, inter: int) -> bool:
        """Whether the kernels take this model's shapes (bf16 rows of whole 16- and 32-value pieces)."""
        return cfg.hidden_size % 32 == 0 and inter % 32 == 0 and cfg.head_dim % 32 == 0 and cfg.head_dim <= 256

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """`F.silu(g) * u` of bf16 rows `gu` = `[rows, 2 * inter]` (g | u), rounded where torch rounds."""
        if gu.dtype != torch.bfloat16 or gu.dim() != 2 or gu.stride(1) != 1 or gu.shape[1] % 32:
            raise ValueError(f"gate|up rows must be bf16 [rows, 2 * inter], not {gu.dtype} {tuple(gu.shape)}")
        rows, inter = gu.shape[0], gu.shape[1] // 2
        out = torch.empty((rows, inter), dtype=gu.dtype)
        rc = self._silu(gu.data_ptr(), gu.stride(0), rows, inter, out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"silu failed (code {rc})")
        return out

    def plan(self, cfg: LlamaConfig, layers: list[LayerWeights], cos: torch.Tensor, sin: torch.Tensor) -> DecodePlan:
        """The step for a model with these layers (norm weights and RoPE tables bf16, contiguous)."""
        for t in (cos, sin, *[n for w in layers for n in (w.attn_norm, w.ffn_norm)]):
            if t.dtype != torch.bfloat16 or not t.is_contiguous():
                raise ValueError("norm weights and RoPE tables must be contiguous bf16")
        if len(layers) != cfg.num_layers or not self.handles(cfg, layers[0].down.in_features):
            raise ValueError("the layers do not match the model, or the kernels do not take its shapes")
        return DecodePlan(self._layers, cfg, layers, cos, sin)


def load() -> DecodeLayers | None:
    """The library, or None where it cannot run here (no compiler, no AVX-512)."""
    lib = load_library(SOURCE, "decode layers", "decode_layers_supported", LINKED)
    return DecodeLayers(lib) if lib is not None else None
