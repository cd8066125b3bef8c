"""`model.deterministic` in bf16: one prompt's logits, computed alone, batched with 1, 7 and 31 others of
other lengths, chunked into prefill pieces of 1, 7 and 64 tokens (1: token by token, as decodes are),
are the same bits in every case; the same comparison without the mode differs (so it tests something);
a setup the mode cannot cover is refused at load."""

from __future__ import annotations

import pytest
import torch

from steadfast.config import Config, ConfigError
from steadfast.wire.worker import AddRequest, SamplingParams
from steadfast.worker.loaded import load_model
from tests.engine_logits import run

pytestmark = pytest.mark.unit

PROMPT = [(17 * j + 101) % 4000 + 30 for j in range(75)]  # 75 tokens: 4 blocks and a partial one
TOKENS = 8


def others(count: int) -> list[AddRequest]:
    return [
        AddRequest(f"o{i}", [(29 * j + 7 * i) % 3000 + 40 for j in range(5 + 11 * i % 90)], SamplingParams(12, 0.0))
        for i in range(count)
    ]


def logits(make_engine, cfg: Config, loaded, with_others: int = 0) -> list[torch.Tensor]:  # noqa: ANN001
    target = AddRequest("p", PROMPT, SamplingParams(TOKENS, 0.0, ignore_eos=True))
    _, rows = run(
        make_engine(cfg, loaded),
        [*others(with_others)[: with_others // 2], target, *others(with_others)[with_others // 2 :]],
    )
    assert len(rows["p"]) == TOKENS
    return rows["p"]


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def bf16_config(small_config: Config) -> Config:
    return small_config.replace(model={"dtype": "bfloat16"}, scheduler={"max_num_seqs": 32})


def test_a_prompts_logits_do_not_depend_on_batch_or_chunking(make_engine, bf16_config):
    cfg = bf16_config.replace(model={"deterministic": True})
    try:
        loaded = load_model(cfg)
    except ConfigError as exc:
        pytest.skip(f"the mode's kernels do not run here: {exc}")
    alone = logits(make_engine, cfg, loaded)
    for count in (1, 7, 31):
        assert same_bits(alone, logits(make_engine, cfg, loaded, count)), f"batched with {count} others"
    for chunk in (1, 7, 64):
        chunked = cfg.replace(scheduler={"max_prefill_chunk": chunk})
        assert same_bits(alone, logits(make_engine, chunked, loaded)), f"prefilled {chunk} tokens a step"

    # Without the mode, prefilling token by token takes the decode path's kernels: other bits.
    off = bf16_config.replace(model={"deterministic": False})
    plain = load_model(off)
    assert not plain.model.deterministic
    assert not same_bits(
        logits(make_engine, off, plain), logits(make_engine, off.replace(scheduler={"max_prefill_chunk": 1}), plain)
    )


def test_auto_is_on_in_bf16_where_it_holds_and_off_in_fp32(small_config):
    auto = small_config.replace(model={"dtype": "bfloat16"})
    assert auto.model.deterministic == "auto"
    try:
        holds = load_model(auto.replace(model={"deterministic": True})).model.deterministic
    except ConfigError:
        holds = False
    assert load_model(auto).model.deterministic == holds  # on exactly where "on" would load (never refused)
    assert not load_model(auto.replace(model={"weights": "dequantized"})).model.deterministic  # a gap: off
    assert not load_model(small_config.replace(model={"dtype": "float32"})).model.deterministic
    with pytest.raises(ConfigError, match="deterministic must be"):
        small_config.replace(model={"deterministic": "sometimes"})


def test_what_the_mode_cannot_cover_is_refused(bf16_config):
    with pytest.raises(ConfigError, match="deterministic"):
        load_model(bf16_config.replace(model={"deterministic": True, "weights": "dequantized"}))
