"""The quantized-weight kernel (`model/quant_matmul.py`) on the default model's own GGUF blocks: in fp32
the dequantized weights' products to rounding, in bf16 within bf16's rounding (the integer path's two
int8 digits of x, on the packed panels, too), a row's result the same bits alone or among others, fused
projections and llama.cpp's Q/K row order as row lists."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf import quants

from steadfast.model import quant_matmul
from steadfast.model.gguf_file import GGUFFile
from steadfast.model.gguf_loader import _dequantize, unpermute_qk
from steadfast.model.gguf_meta import read_config
from steadfast.model.layers import native_layout
from steadfast.model.quant_matmul import QuantWeight
from tests.conftest import kernel_or_skip

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def kernel():
    return kernel_or_skip(quant_matmul.load, "quantized matmul")


@pytest.fixture(scope="module")
def gguf(model_path):
    return GGUFFile(model_path)


def dense(gguf: GGUFFile, name: str, heads: int = 0) -> torch.Tensor:
    array = _dequantize(next(t for t in gguf.tensors if t.name == name))
    return torch.from_numpy(np.array(unpermute_qk(array, heads) if heads else array, dtype=np.float32))


@pytest.mark.parametrize(
    "name, heads",
    [("blk.3.attn_q.weight", 9), ("blk.3.attn_k.weight", 3), ("blk.3.ffn_down.weight", 0), ("token_embd.weight", 0)],
)
def test_products_match_the_dequantized_weights(kernel, gguf, name, heads):
    tensor = next(t for t in gguf.tensors if t.name == name)
    w, ref_w = QuantWeight.of(tensor, heads), dense(gguf, name, heads)
    x = torch.randn(11, ref_w.shape[1], generator=torch.Generator().manual_seed(0))
    want = x.double() @ ref_w.double().t()
    got = kernel(x, w)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got.double() - want).abs().max().item() < 1e-5 * want.abs().max().item()
    xb = x.bfloat16()
    want_b = xb.double() @ ref_w.double().t()  # bf16 inputs, exact weights: only the output's rounding
    got_b = kernel(xb, w)
    assert got_b.dtype == torch.bfloat16
    assert ((got_b.double() - want_b).abs() <= want_b.abs() * 2**-8 + 1e-4 * want_b.abs().max()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_rows_computed_with_it(kernel, gguf, dtype):
    w = QuantWeight.of(next(t for t in gguf.tensors if t.name == "blk.0.ffn_up.weight"))
    x = torch.randn(17, w.in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    alone = [kernel(x[i : i + 1], w) for i in range(17)]
    for count in (2, 5, 8, 9, 17):
        together = kernel(x[:count], w)
        for i in range(count):
            assert torch.equal(together[i], alone[i][0]), (count, i)


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0])
@pytest.mark.parametrize("blocks", [1, 2, 3, 4, 5, 7])
def test_every_count_of_blocks_a_row(kernel, qtype, blocks):
    """The kernel reads blocks in groups (4 of Q4_1, 2 of Q8_0); a row's last group may be short."""
    k, n = 32 * blocks, 9
    dense_w = np.random.default_rng(blocks).standard_normal((n, k)).astype(np.float32)
    packed = np.ascontiguousarray(quants.quantize(dense_w, qtype))
    w = QuantWeight(qtype, k, torch.from_numpy(packed.ctypes.data + np.arange(n) * packed.strides[0]), (packed,))
    ref_w = torch.from_numpy(quants.dequantize(packed, qtype)).double()
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(blocks))
    want = x.double() @ ref_w.t()
    assert (kernel(x, w).double() - want).abs().max().item() < 1e-5 * want.abs().max().item()
    xb = x.bfloat16()
    want_b = xb.double() @ ref_w.t()
    got_b = kernel(xb, w).double()
    assert ((got_b - want_b).abs() <= want_b.abs() * 2**-8 + 1e-4 * want_b.abs().max()).all()


def test_fused_projections_are_the_parts_rows_in_order(kernel, gguf, model_path):
    cfg = read_config(gguf)
    layout = native_layout(gguf.tensors, cfg)
    assert set(layout) == {"lm_head.t"} | {
        f"{i}.{p}.t" for i in range(cfg.num_layers) for p in ("qkv", "o", "gate_up", "down")
    }
    p = "blk.2."
    qkv = torch.cat(
        [dense(gguf, p + "attn_q.weight", cfg.num_heads), dense(gguf, p + "attn_k.weight", cfg.num_kv_heads)]
        + [dense(gguf, p + "attn_v.weight")]
    )
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    got = kernel(x, layout["2.qkv.t"])
    assert (got.double() - x.double() @ qkv.double().t()).abs().max().item() < 1e-4


def test_what_the_kernel_does_not_handle_is_refused(kernel, gguf):
    assert not QuantWeight.handles(next(t for t in gguf.tensors if t.name == "output_norm.weight"))  # F32
    w = QuantWeight.of(next(t for t in gguf.tensors if t.name == "blk.0.ffn_up.weight"))
    with pytest.raises(ValueError, match="columns"):
        kernel(torch.zeros(1, w.in_features + 32), w)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        kernel(torch.zeros(1, w.in_features, dtype=torch.float16), w)
    q8 = QuantWeight.of(next(t for t in gguf.tensors if t.name == "token_embd.weight"))
    with pytest.raises(ValueError, match="share a type"):
        QuantWeight.stack([w, q8])


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0])
def test_packed_once_is_what_a_call_packs_and_odd_blocks_of_x_are_exact(kernel, qtype):
    """The model packs its weights once (`pack`); a bf16 call on an unpacked weight packs it for that call:
    the same bits. Blocks of x that are all zero, or one large value among tiny ones, stay within rounding
    (the digits' scale is the block's largest value)."""
    if not kernel.int8:
        pytest.skip("no AVX512-VNNI: bf16 inputs are computed as fp32, nothing is packed")
    k, n = 32 * 6, 37  # three panels of 16 outputs, the last holding 5
    dense_w = np.random.default_rng(7).standard_normal((n, k)).astype(np.float32)
    blocks = np.ascontiguousarray(quants.quantize(dense_w, qtype))
    w = QuantWeight(qtype, k, torch.from_numpy(blocks.ctypes.data + np.arange(n) * blocks.strides[0]), (blocks,))
    packed = kernel.pack(w)
    assert packed.panels is not None and kernel.pack(packed) is packed
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    x[1, :32] = 0
    x[2, 32:64] = 1e-6
    x[2, 40] = 300.0
    x = x.bfloat16()
    assert torch.equal(kernel(x, w), kernel(x, packed))
    logits = kernel(x, packed, fp32_out=True)  # the LM head's: the same sums, not rounded to bf16
    assert logits.dtype == torch.float32 and torch.equal(logits.bfloat16(), kernel(x, packed))
    want = x.double() @ torch.from_numpy(quants.dequantize(blocks, qtype)).double().t()
    got = kernel(x, packed).double()
    assert ((got - want).abs() <= want.abs() * 2**-8 + 1e-4 * want.abs().max()).all()
