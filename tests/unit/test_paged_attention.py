"""The in-place decode attention kernel against attention computed in float64 from gathered K/V.

Shapes cover a context of one token, exact and partial blocks, contexts of different lengths in one
call, no GQA (group 1) and wide groups, head dims 64 and 128, fp32 and bf16. Slots a request does not
attend hold NaN, so reading one would show in the output.
"""

from __future__ import annotations

import pytest
import torch

from steadfast.model import paged_attention
from tests.conftest import kernel_or_skip

pytestmark = pytest.mark.unit

BLOCK = 16


@pytest.fixture(scope="module")
def kernel():
    return kernel_or_skip(paged_attention.load, "paged-attention")


def reference(q, kv, tables, lens):
    """Float64 attention over each request's first lens[r] tokens, K/V gathered by its block table."""
    _, kv_heads, _, _, dim = kv.shape
    heads = q.shape[1]
    out = []
    for r, n in enumerate(lens):
        blocks = torch.tensor(tables[r][: -(-n // BLOCK)])
        k = kv[0][:, blocks].reshape(kv_heads, -1, dim)[:, :n].double()
        v = kv[1][:, blocks].reshape(kv_heads, -1, dim)[:, :n].double()
        qr = q[r].double().view(kv_heads, heads // kv_heads, dim)
        probs = torch.softmax(qr @ k.transpose(-1, -2) * dim**-0.5, dim=-1)
        out.append((probs @ v).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "lens"),
    [
        (9, 3, 64, [1, 16, 17, 200, 31, 48]),  # SmolLM2-135M's heads
        (4, 4, 64, [5, 33]),  # no grouping
        (16, 1, 128, [64, 1, 100]),  # one K/V head for sixteen query heads
    ],
)
def test_matches_float64_attention(kernel, dtype, heads, kv_heads, dim, lens):
    gen = torch.Generator().manual_seed(len(lens) * heads + dim)
    num_blocks = 64
    kv = torch.full((2, kv_heads, num_blocks, BLOCK, dim), float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in lens:
        count = -(-n // BLOCK)
        tables.append(order[used : used + count])
        used += count
        for i, b in enumerate(tables[-1]):  # only attended slots get values; the rest stay NaN
            filled = min(BLOCK, n - i * BLOCK)
            kv[:, :, b, :filled] = torch.randn(2, kv_heads, filled, dim, generator=gen).to(dtype)
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [num_blocks - 1] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    # q as the model passes it: the first heads of each row of a wider [n, heads + kv_heads, dim] tensor.
    q = torch.randn(len(lens), heads + kv_heads, dim, generator=gen).to(dtype)[:, :heads]
    out = torch.empty(len(lens), heads * dim, dtype=dtype)
    kernel(q, kv, table_t, lens_t, out)
    want = reference(q, kv, tables, lens)
    assert not out.isnan().any()
    # fp32: summation order and a 1e-7 exp; bf16: the output's own rounding (8 bits of mantissa).
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


def test_refuses_a_shape_it_does_not_handle(kernel):
    kv = torch.zeros(2, 1, 4, BLOCK, 24)  # head dim not a multiple of 16
    q = torch.zeros(1, 2, 24)
    with pytest.raises(RuntimeError, match="failed"):
        kernel(q, kv, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.empty(1, 48))
    assert not paged_attention.supports(torch.float32, "cpu", 2, 1, 24, BLOCK)
    assert not paged_attention.supports(torch.float32, "cpu", 9, 3, 64, 32)
    assert paged_attention.supports(torch.bfloat16, "cpu", 9, 3, 64, BLOCK)
