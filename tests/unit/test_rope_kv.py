"""The RoPE + K/V store kernel (`model/rope_kv.py`) against the model's torch path (`LlamaModel._rope`
and two index copies): the same bits in bf16 and in fp32, for a decode row and for prefill chunks, and
nothing written for a position or slot out of range."""

from __future__ import annotations

import pytest
import torch

from steadfast.model import rope_kv
from steadfast.model.llama import LlamaModel
from tests.conftest import kernel_or_skip

pytestmark = pytest.mark.unit

HEADS, KV_HEADS, DIM, BLOCKS, BLOCK = 9, 3, 64, 12, 16


@pytest.fixture(scope="module")
def kernel():
    return kernel_or_skip(rope_kv.load, "rope + K/V store")


def tables(dtype: torch.dtype, positions: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))
    emb = torch.outer(torch.arange(positions, dtype=torch.float32), inv).repeat(1, 2)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits (torch.equal takes -0.0 for 0.0)."""
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def torch_path(qkv, cos, sin, positions, kv, slots) -> None:
    """What `LlamaModel.forward` does without the kernel, in place on copies."""
    n, q_size, kv_size = qkv.shape[0], HEADS * DIM, KV_HEADS * DIM
    qk = LlamaModel._rope(
        qkv[:, : q_size + kv_size].view(n, HEADS + KV_HEADS, DIM),
        cos[positions].unsqueeze(1),
        sin[positions].unsqueeze(1),
    )
    qkv[:, : q_size + kv_size] = qk.reshape(n, -1)
    k, v = qk[:, HEADS:], qkv[:, q_size + kv_size :].view(n, KV_HEADS, DIM)
    kv[0].view(KV_HEADS, -1, DIM).index_copy_(1, slots, k.transpose(0, 1))
    kv[1].view(KV_HEADS, -1, DIM).index_copy_(1, slots, v.transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 7, 40])
def test_rope_and_store_match_the_torch_path_bit_for_bit(kernel, dtype, n):
    g = torch.Generator().manual_seed(n)
    cos, sin = tables(dtype)
    qkv = (torch.randn(n, (HEADS + 2 * KV_HEADS) * DIM, generator=g) * 4).to(dtype)
    qkv[0, :5] = 0.0  # zeros keep their sign as torch's negation leaves it
    positions = torch.randperm(300, generator=g)[:n]
    slots = torch.randperm(BLOCKS * BLOCK, generator=g)[:n]
    kv = torch.randn(2, KV_HEADS, BLOCKS, BLOCK, DIM, generator=g).to(dtype)
    want_qkv, want_kv = qkv.clone(), kv.clone()
    torch_path(want_qkv, cos, sin, positions, want_kv, slots)
    kernel(qkv, cos, sin, positions, kv, slots, HEADS, KV_HEADS)
    assert torch.equal(bits(qkv), bits(want_qkv)) and torch.equal(bits(kv), bits(want_kv))


def test_strided_rows_and_bad_indices(kernel):
    cos, sin = tables(torch.bfloat16, positions=50)
    wide = torch.randn(3, (HEADS + 2 * KV_HEADS) * DIM + 64).bfloat16()
    qkv = wide[:, : (HEADS + 2 * KV_HEADS) * DIM]  # rows of a longer stride, as a slice of a buffer
    kv = torch.zeros(2, KV_HEADS, BLOCKS, BLOCK, DIM, dtype=torch.bfloat16)
    want_qkv, want_kv = qkv.clone(), kv.clone()
    positions, slots = torch.tensor([0, 7, 49]), torch.tensor([5, 100, 191])
    torch_path(want_qkv, cos, sin, positions, want_kv, slots)
    kernel(qkv, cos, sin, positions, kv, slots, HEADS, KV_HEADS)
    assert torch.equal(bits(qkv), bits(want_qkv)) and torch.equal(bits(kv), bits(want_kv))
    before = kv.clone()
    with pytest.raises(IndexError):
        kernel(qkv[:1].clone(), cos, sin, torch.tensor([50]), kv, torch.tensor([0]), HEADS, KV_HEADS)
    with pytest.raises(IndexError):
        kernel(qkv[:1].clone(), cos, sin, torch.tensor([3]), kv, torch.tensor([BLOCKS * BLOCK]), HEADS, KV_HEADS)
    assert torch.equal(kv, before)
    with pytest.raises(ValueError, match="int64"):
        kernel(qkv.clone(), cos, sin, positions.int(), kv, slots, HEADS, KV_HEADS)
    with pytest.raises(ValueError, match="do not match"):
        kernel(qkv.clone(), cos, sin, positions, kv, slots, HEADS + 1, KV_HEADS)
