"""The fused residual add + RMSNorm kernel for bf16 rows (`model/rms_norm.py`) against the model's torch
path: the add bit for bit, the normalised rows within one bf16 rounding step, each row alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from steadfast.model import rms_norm
from tests.conftest import kernel_or_skip

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def kernel():
    return kernel_or_skip(rms_norm.load, "rms norm")


def torch_path(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    added = x + delta
    return added, weight * F.rms_norm(added.float(), (x.shape[1],), eps=1e-5).to(torch.bfloat16)


def test_add_and_norm_match_the_torch_path(kernel):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 576, generator=g) * 3).bfloat16()
    delta = torch.randn(37, 576, generator=g).bfloat16()
    weight = torch.randn(576, generator=g).bfloat16()
    want_x, want = torch_path(x, delta, weight)
    got = kernel(x, delta, weight, 1e-5)
    assert torch.equal(x, want_x)  # the residual stream, updated in place: the same bits
    # Within one rounding step of bf16 (the sum of squares in another order; 2^-7 relative, or tiny values).
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-6).all()
    plain = kernel(x.clone(), None, weight, 1e-5)  # no delta: a norm alone
    assert (
        (plain.float() - torch_path(x, torch.zeros_like(x), weight)[1].float()).abs()
        <= want.float().abs() * 2**-7 + 1e-6
    ).all()


def test_a_rows_result_does_not_depend_on_the_others(kernel):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 64, generator=g).bfloat16()
    delta = torch.randn(20, 64, generator=g).bfloat16()
    weight = torch.randn(64, generator=g).bfloat16()
    together = kernel(x.clone(), delta, weight, 1e-6)
    for i in range(20):
        assert torch.equal(kernel(x[i : i + 1].clone(), delta[i : i + 1], weight, 1e-6)[0], together[i])


def test_shapes_it_does_not_handle_are_refused(kernel):
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    assert not kernel.handles(torch.zeros(2, 40, dtype=torch.bfloat16)) and not kernel.handles(x.float())
    with pytest.raises(ValueError, match="does not match"):
        kernel(x, torch.zeros(3, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16), 1e-6)
