"""The degradation ladder in a real server (the small model): each level's effect when an operator sets
it, the way back to L0 under automatic control, a burst of low-priority streams that the ladder sheds
at admission while every high-priority request arriving during it is served in full, and KV pressure
that takes it to L3, where low-priority KV goes to the offload tier without changing a token."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import PROMPTS, wait_until
from tests.integration.server import ServerProcess, serving

pytestmark = pytest.mark.integration

CAP = 8  # degradation.max_tokens_cap
CONTEXT = 64  # degradation.max_context_tokens
RESERVE = 4  # degradation.high_reserve
CONFIG = f"""
model: {{dtype: float32, device: cpu}}
cache: {{kv_memory_mb: 64}}
server: {{standby_workers: 0}}
speculative: {{method: ngram}}
slo: {{ttft_ms: {{p50: 100, p99: 300}}}}
degradation: {{min_dwell_s: 1, escalate_after_s: 1, window_s: 3, interval_s: 0.2, max_tokens_cap: {CAP},
  max_context_tokens: {CONTEXT}, high_reserve: {RESERVE}, max_queued_low: 48}}
"""
REPEAT = "Repeat the following sentence exactly three times: The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def server(tmp_path_factory, small_model_path):
    with serving(tmp_path_factory.mktemp("degradation"), CONFIG, model=small_model_path) as s:
        yield s


def model(server: ServerProcess) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def level(server: ServerProcess) -> dict:
    return httpx.get(server.url + "/admin/degradation").json()


def set_level(server: ServerProcess, value: int | str) -> dict:
    r = httpx.post(server.url + "/admin/degradation", json={"level": value})
    assert r.status_code == 200, r.text
    return r.json()


def back_to_l0(server: ServerProcess, seconds: float) -> None:
    try:
        wait_until(lambda: level(server)["level"] == 0, seconds, "the ladder to come back to L0 by itself")
    except AssertionError:
        state = level(server)
        raise AssertionError(f"still at L{state['level']}: {state['reason']}; {state['signals']}") from None


def chat(server: ServerProcess, messages: list[dict], priority: str, max_tokens: int, **extra) -> httpx.Response:
    body = {
        "model": model(server),
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "priority": priority,
        **extra,
    }
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def worker(server: ServerProcess) -> dict:
    return httpx.get(server.url + "/admin/workers").json()[0]


def test_each_level_set_by_an_operator_does_what_it_says_and_auto_brings_it_back(server):
    state = level(server)
    assert state["level"] == 0 and state["mode"] == "auto" and set(state["priorities"]) == {"high", "normal", "low"}
    user = [{"role": "user", "content": REPEAT}]

    # L2: speculation off for normal and low (high keeps it: KV and queue are low), told to the worker.
    set_level(server, 2)
    wait_until(lambda: worker(server)["degradation_level"] == 2, 5, "the worker to hear L2")
    drafted = worker(server)["spec_drafted"]
    assert chat(server, user, "normal", 40).status_code == 200
    time.sleep(1.2)  # a status report later
    assert worker(server)["spec_drafted"] == drafted  # a repetitive normal request drafted nothing
    assert chat(server, user, "high", 40).status_code == 200
    wait_until(lambda: worker(server)["spec_drafted"] > drafted, 5, "the high request to speculate")

    # L4: normal and low are capped and truncated, and told so; high is not.
    set_level(server, 4)
    r = chat(server, user, "normal", 40)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == CAP
    assert f"max_tokens={CAP}" in r.headers["x-steadfast-degradation"]
    long_chat = [{"role": "system", "content": "You are terse."}]
    for p in PROMPTS:
        long_chat += [{"role": "user", "content": p}, {"role": "assistant", "content": "Yes."}]
    long_chat.append({"role": "user", "content": "Now say hi."})
    r = chat(server, long_chat, "low", 40)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] <= CONTEXT
    header = r.headers["x-steadfast-degradation"]
    assert "level=4" in header and "dropped_messages=" in header and "truncated_tokens=" in header
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json={"model": model(server), "messages": user, "max_tokens": 40, "stream": True, "priority": "normal"},
        timeout=60,
    ) as s:
        first = next(line for line in s.iter_lines() if line.startswith("data: "))
    assert json.loads(first[6:])["degradation"] == {"level": 4, "max_tokens": CAP}
    r = chat(server, user, "high", 40)
    assert r.json()["usage"]["completion_tokens"] == 40 and "max_tokens" not in r.headers["x-steadfast-degradation"]

    # L5: the breaker refuses normal and low with 503 + Retry-After in the OpenAI error shape; high gets in.
    set_level(server, 5)
    for priority in ("normal", "low"):
        r = chat(server, user, priority, 4)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "circuit_open" and "overloaded" in r.json()["error"]["message"]
    assert chat(server, user, "high", 4).status_code == 200
    metrics = httpx.get(server.url + "/metrics").text
    assert "steadfast_degradation_level 5.0" in metrics
    assert 'steadfast_degradation_refused_total{priority="low",status="503"}' in metrics

    # Bad input is a 400 naming the field.
    r = httpx.post(server.url + "/admin/degradation", json={"level": 9})
    assert r.status_code == 400 and "level" in r.json()["error"]["message"]

    # Back to automatic control (through the CLI): the level the calm signals ask for, L0, at once (the
    # operator's level was not theirs: a next request got 503 from an L5 nothing had caused).
    out = subprocess.run(
        [sys.executable, "-m", "steadfast.ops.cli", "degrade", "--url", server.url, "--level", "auto"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "(auto)" in out.stdout, out.stderr
    back_to_l0(server, 30)
    history = level(server)["history"]
    assert [c["new"] for c in history if c["manual"]] == [2, 4, 5]
    falls = [c for c in history if not c["manual"]]
    assert [(c["old"], c["new"]) for c in falls[-1:]] == [(5, 0)], history
    assert "automatic control resumed" in falls[-1]["reason"]
    assert all(c["reason"] and "kv_use" in c["signals"] for c in history)
    assert worker(server)["degradation_level"] == 0 or wait_until(
        lambda: worker(server)["degradation_level"] == 0, 5, "the worker to hear L0"
    )


def stream_body(server: ServerProcess, prompt: str, priority: str, tokens: int) -> dict:
    """A greedy streamed completion of `tokens` tokens (EOS ignored), with its token ids."""
    return {
        "model": model(server),
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "priority": priority,
    }


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, list[int], str | None]:
    """(status, token ids received, finish reason) of one streamed completion."""
    ids: list[int] = []
    finish = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, [], None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return 500, ids, "error"
            for choice in chunk["choices"]:
                ids += choice.get("token_ids") or []
                finish = choice.get("finish_reason") or finish
    return 200, ids, finish


def test_a_burst_of_low_streams_is_shed_and_every_high_request_served(server):
    """300 low-priority streams at once, five high-priority ones arriving during the burst: lows are
    refused at admission (429, or 503 once the breaker opens), every high one is admitted and streamed
    to its last token, every accepted stream ends with all its tokens, and the level goes back to L0."""
    assert level(server)["level"] == 0
    url = server.url

    def body(i: int, priority: str, tokens: int) -> dict:
        return stream_body(server, PROMPTS[i % len(PROMPTS)] * 4, priority, tokens)

    async def burst() -> tuple[list, list]:
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=180, limits=limits) as client:
            lows = [asyncio.create_task(_stream(client, url, body(i, "low", 24))) for i in range(300)]
            await asyncio.sleep(1.0)
            highs = []
            for i in range(5):
                highs.append(asyncio.create_task(_stream(client, url, body(i, "high", 24))))
                await asyncio.sleep(0.3)
            return await asyncio.gather(*lows), await asyncio.gather(*highs)

    lows, highs = asyncio.run(burst())
    lows = [(status, len(ids), finish) for status, ids, finish in lows]
    assert [(status, len(ids), finish) for status, ids, finish in highs] == [(200, 24, "length")] * 5
    accepted = [r for r in lows if r[0] == 200]
    refused = [r for r in lows if r[0] in (429, 503)]
    assert len(accepted) + len(refused) == len(lows), {r[0] for r in lows}
    assert refused, "no low-priority request was refused"
    assert accepted and all(r == (200, 24, "length") for r in accepted), [r for r in accepted if r[1] != 24]
    history = level(server)["history"]
    assert max(c["new"] for c in history) >= 1
    back_to_l0(server, 60)


TIER_CONFIG = """
model: {dtype: float32, device: cpu}
cache: {num_blocks: 48, offload_tier: host, offload_max_fraction: 0.5}
server: {standby_workers: 0, status_interval_s: 0.1}
degradation: {min_dwell_s: 1, escalate_after_s: 30, window_s: 3, interval_s: 0.2}
"""
LOW_TOKENS = 96


@pytest.fixture(scope="module")
def tier_server(tmp_path_factory, small_model_path):
    with serving(tmp_path_factory.mktemp("degradation-tier"), TIER_CONFIG, model=small_model_path) as s:
        yield s


def test_kv_pressure_takes_the_ladder_to_l3_and_offloaded_low_requests_keep_every_token(
    tier_server, small_config, small_model, make_engine
):
    """Four long low-priority streams want more KV than the worker has: KV use passes 90 %, the level
    goes to L3, the worker swaps low-priority requests out to the tier down to 80 % (what a high request
    arriving then finds free); every stream's tokens are those of an undisturbed run; back to L0 after."""
    server = tier_server
    prompts = [(PROMPTS[i] + " ") * 12 for i in range(4)]

    async def tokens_of(client: httpx.AsyncClient, b: dict) -> list[int]:
        status, ids, finish = await _stream(client, server.url, b)
        assert (status, finish) == (200, "length")
        return ids

    async def load() -> tuple[list[list[int]], list[int]]:
        async with httpx.AsyncClient(timeout=180) as client:
            lows = [asyncio.create_task(tokens_of(client, stream_body(server, p, "low", LOW_TOKENS))) for p in prompts]
            await asyncio.to_thread(
                wait_until, lambda: level(server)["level"] >= 3, 60, "KV pressure to take the ladder to L3"
            )
            high = await tokens_of(client, stream_body(server, PROMPTS[5], "high", 16))
            return list(await asyncio.gather(*lows)), high

    lows, high = asyncio.run(load())
    assert worker(server)["ladder_swaps"] > 0  # the ladder's own swap-outs, not preemptions for room
    history = level(server)["history"]
    assert any(c["new"] == 3 and "KV use" in c["reason"] for c in history), history

    from steadfast.wire.worker import AddRequest, SamplingParams

    engine = make_engine(small_config, small_model)
    tok = small_model.tokenizer
    reqs = [
        AddRequest(f"r{i}", tok.encode(p), SamplingParams(LOW_TOKENS, 0.0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    reqs.append(AddRequest("high", tok.encode(PROMPTS[5]), SamplingParams(16, 0.0, ignore_eos=True)))
    want = {rid: [t for o in outs for t in o.token_ids] for rid, outs in engine.generate(reqs).items()}
    assert lows == [want[f"r{i}"] for i in range(4)]
    assert high == want["high"]
    back_to_l0(server, 30)
