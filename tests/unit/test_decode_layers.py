"""The decode step's layers in one C call (`model/decode_layers.py`) against the model's layer loop: the
same logits bit for bit, batch after batch; its SwiGLU against torch's `F.silu(g) * u`; bad input refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from steadfast.model import decode_layers
from steadfast.wire.worker import AddRequest, SamplingParams
from steadfast.worker.loaded import load_model
from tests.conftest import kernel_or_skip
from tests.engine_logits import run

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def kernel():
    return kernel_or_skip(decode_layers.load, "decode layers")


@pytest.fixture(scope="module")
def bf16_small(small_config):
    loaded = load_model(small_config.replace(model={"dtype": "bfloat16"}))
    if loaded.model.step is None:
        pytest.skip("the one-call decode step needs every kernel and the quantized weights, not all run here")
    return loaded


def test_swiglu_rounds_where_torch_does(kernel):
    torch.manual_seed(0)
    gu = (torch.randn(37, 2 * 1536) * torch.rand(37, 1) * 12).bfloat16()
    gu[0, :16] = 0.0
    gu[1, :8] = torch.tensor([80.0, -80.0, 100.0, -100.0, 1e-30, -1e-30, 0.5, -0.5]).bfloat16()
    gate, up = gu.chunk(2, dim=-1)
    want = (F.silu(gate) * up).float()
    got = kernel.silu_mul(gu).float()
    # Within one bf16 step where the fp32 silu sits on a rounding boundary (exp's last bit), else equal.
    ulp = torch.where(want == 0, torch.tensor(1e-38), want.abs() * 2.0**-7)
    assert ((got - want).abs() <= ulp).all()
    assert (got != want).float().mean().item() < 1e-3
    # A row's result does not depend on the rows computed with it (one row alone: no threads).
    assert torch.equal(kernel.silu_mul(gu[5:6]).view(torch.int16), kernel.silu_mul(gu)[5:6].view(torch.int16))
    with pytest.raises(ValueError):
        kernel.silu_mul(gu.float())


def test_one_call_step_is_the_layer_loop_bit_for_bit(kernel, bf16_small, make_engine, small_config):
    """Four requests of other lengths decoded together (batches of 4, then fewer as they finish), the
    step once through the C call, once through the loop: every logits row the same bits."""
    loaded = bf16_small
    cfg = small_config.replace(model={"dtype": "bfloat16"}, scheduler={"max_num_seqs": 4})
    plan, rows = loaded.model.step
    assert rows >= 4
    reqs = [
        AddRequest(f"r{i}", [100 + 37 * j % 4000 for j in range(9 + 23 * i)], SamplingParams(6 + 4 * i, 0.0))
        for i in range(4)
    ]
    calls = []
    real_run = plan.run
    plan.run = lambda *a: calls.append(a[0].shape[0]) or real_run(*a)
    try:
        tokens, logits = run(make_engine(cfg, loaded), reqs)
    finally:
        del plan.run
    # The one-call path ran at every batch size (and, `model.deterministic` being on in bf16, for the
    # prompts too: each prompt token is then a decode row attending up to its own position).
    assert {1, 2, 3, 4} <= set(calls), calls
    loaded.model.step = None
    try:
        want_tokens, want_logits = run(make_engine(cfg, loaded), reqs)
    finally:
        loaded.model.step = (plan, rows)
    assert tokens == want_tokens
    for rid, want in want_logits.items():
        for i, row in enumerate(want):
            assert torch.equal(row.view(torch.int32), logits[rid][i].view(torch.int32)), f"{rid} token {i}"


def test_bad_input_is_refused(kernel, bf16_small):
    plan, _ = bf16_small.model.step
    cfg = bf16_small.model_cfg
    x = torch.zeros(1, cfg.hidden_size, dtype=torch.bfloat16)
    kv = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, 4, 16, cfg.head_dim, dtype=torch.bfloat16)
    one = torch.zeros(1, dtype=torch.int64)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError):
        plan.run(x.float(), one, one, tables, lens, kv)
    with pytest.raises(ValueError):
        plan.run(x, one, one, tables, lens, kv[:, :, :, :, :8])
    with pytest.raises(ValueError):
        plan.run(x, one.int(), one, tables, lens, kv)
    with pytest.raises(IndexError):  # slot 64 of 4 blocks of 16: past the arena, nothing written
        plan.run(x, one, one + 64, tables, lens, kv)
    assert not kv.any()
    with pytest.raises(IndexError):
        plan.run(x, one + 10**7, one, tables, lens, kv)
