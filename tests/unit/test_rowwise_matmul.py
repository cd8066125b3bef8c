"""The fp32 row-wise matmul kernel: its results are torch's up to rounding, and a row's result is the
same bits whatever rows are computed with it and whatever the thread count — what makes speculative
verification, batching, takeovers and migrations unable to change a token by rounding in fp32. A weight
it does not handle stays on torch for every row count alike."""

from __future__ import annotations

import pytest
import torch

from steadfast.model import rowwise_matmul
from steadfast.model.layers import Linear

pytestmark = pytest.mark.unit

KERNEL = rowwise_matmul.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler or no AVX-512 here")


@needs_kernel
@pytest.mark.parametrize("k, n", [(576, 960), (1536, 576), (64, 16), (576, 49152)])
def test_results_are_torchs_up_to_rounding(k, n):
    g = torch.Generator().manual_seed(k + n)
    w = torch.randn(k, n, generator=g)
    for m in (1, 3, 8, 9, 40):
        x = torch.randn(m, k, generator=g)
        torch.testing.assert_close(KERNEL(x, w), x @ w, rtol=1e-4, atol=1e-3)


@needs_kernel
def test_a_rows_result_does_not_depend_on_its_companions_or_the_threads():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(576, 960, generator=g)
    x = torch.randn(21, 576, generator=g)
    whole = KERNEL(x, w)
    for lo, hi in [(0, 1), (4, 5), (0, 5), (3, 11), (8, 21), (1, 17)]:
        assert torch.equal(KERNEL(x[lo:hi], w), whole[lo:hi]), (lo, hi)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(KERNEL(x, w), whole)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_strided_and_batched_inputs():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 32, generator=g)
    x = torch.randn(4, 5, 128, generator=g)[..., ::2]  # rows not contiguous
    torch.testing.assert_close(KERNEL(x, w), x @ w, rtol=1e-4, atol=1e-4)
    assert KERNEL(torch.empty(0, 64), w).shape == (0, 32)


def test_a_weight_it_does_not_handle_stays_on_torch_for_every_row_count():
    assert not rowwise_matmul.RowwiseMatmul.handles(torch.zeros(64, 40))  # columns not a multiple of 16
    assert not rowwise_matmul.RowwiseMatmul.handles(torch.zeros(64, 32, dtype=torch.bfloat16))
    assert not rowwise_matmul.RowwiseMatmul.handles(torch.zeros(32, 64).t())  # not contiguous
    if KERNEL is not None:
        odd = Linear(torch.randn(64, 40), KERNEL)
        assert odd.rowwise is None
        x = torch.randn(3, 64)
        assert torch.equal(odd(x), x @ odd.weight_t)
        assert Linear(torch.randn(64, 48), KERNEL).rowwise is KERNEL
