"""Penalties, logit_bias and min_tokens (issue 50 §1) in fp32 greedy against `transformers` with the same
adjustments as its logits processors, the requests batched together; logprobs against its raw logits;
and both unchanged by speculation."""

from __future__ import annotations

import msgspec
import pytest
import torch

from steadfast.wire.worker import AddRequest, SamplingParams
from tests.conftest import PROMPTS

pytestmark = pytest.mark.integration

NEW_TOKENS = 16
FP32_NOISE = 1e-4  # logprobs of one token computed by two fp32 paths (kernels, batch shapes) differ below this
ADJUSTED = SamplingParams(
    max_tokens=NEW_TOKENS,
    temperature=0.0,
    repetition_penalty=1.3,
    presence_penalty=0.4,
    frequency_penalty=0.6,
    min_tokens=10,
    logit_bias=((28, 2.5), (30, -4.0)),  # (any two ids: one made likelier, one less)
)


def presence_frequency(prompt_len: int, presence: float, frequency: float):
    """OpenAI's penalties over the generated tokens only, written apart from the server's."""

    def apply(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for row, ids in enumerate(input_ids[:, prompt_len:].tolist()):
            for token in set(ids):
                scores[row, token] -= frequency * ids.count(token) + presence
        return scores

    return apply


def hf_adjusted(hf_model, ids: list[int], params: SamplingParams, eos: list[int]) -> list[int]:
    import transformers as tf

    processors = tf.LogitsProcessorList(
        [
            tf.MinNewTokensLengthLogitsProcessor(len(ids), params.min_tokens, eos),
            tf.SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias}),
            tf.RepetitionPenaltyLogitsProcessor(params.repetition_penalty),
            presence_frequency(len(ids), params.presence_penalty, params.frequency_penalty),
        ]
    )
    x = torch.tensor([ids])
    gen = hf_model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=params.max_tokens,
        do_sample=False,
        logits_processor=processors,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return gen[0, len(ids) :].tolist()


def engine_outputs(engine, prompts: list[list[int]], params: SamplingParams) -> list[list]:
    results = engine.generate([AddRequest(str(i), ids, params) for i, ids in enumerate(prompts)])
    return [results[str(i)] for i in range(len(prompts))]


def engine_run(engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [[t for o in outs for t in o.token_ids] for outs in engine_outputs(engine, prompts, params)]


def test_penalties_bias_and_min_tokens_match_transformers(fp32_config, fp32_model, make_engine, hf_model):
    tok = fp32_model.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:2]]
    eos = list(tok.info.eos_token_ids)
    expected = [hf_adjusted(hf_model, ids, ADJUSTED, eos) for ids in prompts]
    plain = engine_run(make_engine(fp32_config, fp32_model), prompts, SamplingParams(NEW_TOKENS, 0.0))
    got = engine_run(make_engine(fp32_config, fp32_model), prompts, ADJUSTED)
    assert got == expected
    assert got != plain  # (the adjustments changed the output)
    assert all(len(g) >= ADJUSTED.min_tokens for g in got)


def test_logprobs_are_the_models_raw_log_softmax(fp32_config, fp32_model, make_engine, hf_model):
    """Each token's logprob and its top 5 equal transformers' raw logits' log-softmax, the prompts batched
    together; the logprobs sum to the sequence's log-likelihood. fp32 kernels other than transformers'
    round differently: up to 2.6e-5 apart here (measured), so 1e-4."""
    tok = fp32_model.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:2]]
    params = SamplingParams(NEW_TOKENS, 0.0, ignore_eos=True, logprobs=5)
    for ids, outs in zip(prompts, engine_outputs(make_engine(fp32_config, fp32_model), prompts, params), strict=True):
        got = [o.logprobs[0] for o in outs]
        tokens = [t for o in outs for t in o.token_ids]
        x = torch.tensor([ids])
        gen = hf_model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        assert gen.sequences[0, len(ids) :].tolist() == tokens
        for step, (lp, t) in enumerate(zip(got, tokens, strict=True)):
            ref = torch.log_softmax(gen.logits[step][0].float(), dim=-1)
            top = ref.topk(5)
            assert abs(lp.logprob - float(ref[t])) < FP32_NOISE, step
            assert lp.top_ids == top.indices.tolist() and lp.top_ids[0] == t
            assert max(abs(a - b) for a, b in zip(lp.top_logprobs, top.values.tolist(), strict=True)) < FP32_NOISE
        full = torch.tensor([ids + tokens])
        with torch.no_grad():
            logits = hf_model(full).logits[0, len(ids) - 1 : -1].float()
        likelihood = float(torch.log_softmax(logits, -1).gather(1, torch.tensor([tokens]).T).sum())
        assert abs(sum(lp.logprob for lp in got) - likelihood) < 1e-3


def test_prompt_logprobs_are_the_models_over_the_prompt(fp32_config, fp32_model, make_engine, hf_model):
    """`echo` with `logprobs` (prompt_logprobs): each prompt token after the first, scored by the row before
    it, equals transformers' log-softmax there, top 3 too; computed in chunks of 7 beside another request,
    and with the prompt already in the prefix cache (whose KV carries no logits: it is computed again)."""
    tok = fp32_model.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:2]]
    engine = make_engine(
        fp32_config.replace(scheduler={"max_num_batched_tokens": 24, "max_prefill_chunk": 7}), fp32_model
    )
    engine_run(engine, prompts, SamplingParams(2, 0.0))  # (both prompts now cached)
    scored = engine_outputs(engine, prompts, SamplingParams(2, 0.0, prompt_logprobs=3))
    for ids, outs in zip(prompts, scored, strict=True):
        got = outs[0].prompt_logprobs
        assert got is not None and len(got) == len(ids) - 1 and outs[1].prompt_logprobs is None
        assert outs[0].num_cached_tokens == 0
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
        for pos, lp in enumerate(got):
            assert abs(lp.logprob - float(ref[pos, ids[pos + 1]])) < FP32_NOISE, pos
            assert lp.top_ids == ref[pos].topk(3).indices.tolist(), pos
        likelihood = float(ref.gather(1, torch.tensor([ids[1:]]).T).sum())
        assert abs(sum(lp.logprob for lp in got) - likelihood) < 1e-3


def test_processed_logprobs_are_those_of_the_distribution_drawn_from(fp32_config, fp32_model, make_engine):
    """`logprobs_mode: processed_logprobs`: each token's logprobs are those of the distribution it was
    drawn from (here the raw one at temperature 0.7 cut to its top 5: its five alternatives hold all the
    mass), computed from the raw run's own figures; the tokens are the same either way."""
    tok = fp32_model.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:2]]
    raw = SamplingParams(12, 0.7, top_k=5, seed=3, ignore_eos=True, logprobs=5)
    engine = make_engine(fp32_config, fp32_model)
    plain = engine_outputs(engine, prompts, raw)
    shaped = engine_outputs(engine, prompts, msgspec.structs.replace(raw, processed_logprobs=True))
    for a, b in zip(plain, shaped, strict=True):
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        for x, y in zip(a, b, strict=True):
            r, p = x.logprobs[0], y.logprobs[0]
            assert r.top_ids == p.top_ids
            scaled = torch.tensor(r.top_logprobs) / 0.7
            want = scaled - torch.logsumexp(scaled, 0)
            assert max(abs(u - float(v)) for u, v in zip(p.top_logprobs, want, strict=True)) < FP32_NOISE
            assert abs(float(torch.tensor(p.top_logprobs).exp().sum()) - 1.0) < 1e-4
            assert p.logprob == p.top_logprobs[p.top_ids.index(x.token_ids[0])]


def test_speculation_changes_no_adjusted_token_nor_logprob(fp32_config, fp32_model, make_engine):
    """A verifying row's penalties count the drafts before it as output, and its logprobs are its own
    position's: on and off agree (tokens exactly; logprobs within fp32's noise, the verify rows being
    computed by other kernels)."""
    tok = fp32_model.tokenizer
    text = "Repeat the following sentence exactly three times: The quick brown fox jumps over the lazy dog."
    prompts = [tok.encode_chat([{"role": "user", "content": text}])] * 2
    params = SamplingParams(40, 0.0, ignore_eos=True, frequency_penalty=0.1, repetition_penalty=1.05, logprobs=2)
    off = engine_outputs(make_engine(fp32_config, fp32_model), prompts, params)
    spec = make_engine(fp32_config.replace(speculative={"method": "ngram", "num_draft_tokens": 4}), fp32_model)
    on = engine_outputs(spec, prompts, params)
    assert spec.spec.verify_steps >= 1, vars(spec.spec)  # (it really verified drafts)
    for a, b in zip(on, off, strict=True):
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        assert [o.logprobs[0].top_ids for o in a] == [o.logprobs[0].top_ids for o in b]
        assert max(abs(x.logprobs[0].logprob - y.logprobs[0].logprob) for x, y in zip(a, b, strict=True)) < FP32_NOISE
