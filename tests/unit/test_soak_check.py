"""The soak's pure parts: its schedule replays from the seed, its catalogue is stable, and its checker
counts what a client lost, got twice or got changed, and puts each gap under the fault that caused it."""

from __future__ import annotations

import httpx
import pytest

from steadfast.ops.harness import soak_faults
from steadfast.ops.harness.chaos import Stream
from steadfast.ops.harness.soak import Sent, catalogue
from steadfast.ops.harness.soak_check import diff, gaps_by_fault, longest_gaps, outcome, report
from steadfast.ops.harness.soak_faults import KINDS, Struck, schedule

pytestmark = pytest.mark.unit


def test_the_same_seed_gives_the_same_faults_and_requests():
    a, b = schedule(7, 300, 5, KINDS), schedule(7, 300, 5, KINDS)
    assert a == b and len(a) > 30 and {k for _, k in a} == set(KINDS)
    assert schedule(8, 300, 5, KINDS) != a
    assert all(0 < t < 300 for t, _ in a) and [t for t, _ in a] == sorted(t for t, _ in a)
    assert catalogue(3) == catalogue(3) != catalogue(4)
    kinds = {x.kind for x in catalogue(3)}
    assert kinds == {"greedy", "seeded", "long", "chat"}
    assert all((x.seed is None) == (x.temperature == 0) for x in catalogue(3))


def test_tokens_lost_repeated_and_changed_are_counted():
    want = [1, 2, 3, 4, 5, 6]
    assert diff(want, want) == {"lost": 0, "repeated": 0, "changed": 0}
    assert diff(want, [1, 2, 5, 6]) == {"lost": 2, "repeated": 0, "changed": 0}
    assert diff(want, [1, 2, 3, 3, 4, 5, 6]) == {"lost": 0, "repeated": 1, "changed": 0}
    assert diff(want, [1, 2, 9, 4, 5, 6]) == {"lost": 0, "repeated": 0, "changed": 1}


def _sent(tokens, arrivals=(), accepted=True, finish="length", error="") -> Sent:
    ask = catalogue(1)[0]
    s = Stream("", tokens=list(tokens), arrivals=list(arrivals), finish=finish, error=error, accepted=accepted)
    return Sent(ask, 0.0, s, done=True)


def test_each_request_is_exact_refused_or_failed():
    want = [5, 6, 7]
    assert outcome(_sent(want), want) == "exact"
    assert outcome(_sent([], accepted=False, finish=None, error="no end"), want) == "refused"
    assert outcome(_sent([5, 6]), want) == "failed"  # a token missing
    assert outcome(_sent(want, error="broken"), want) == "failed"
    r = report([_sent(want), _sent([5, 7])], {catalogue(1)[0].key: want}, [], [], [], [])
    assert (r["exact"], r["failed"], r["tokens"]["lost"], r["passed"]) == (1, 1, 1, False)
    # A request of two choices: both checked, choice after choice.
    two = _sent([5, 6])
    two.stream.choices, two.stream.others = 2, {1: [7]}
    assert outcome(two, want) == "exact"
    two.stream.others = {1: [8]}
    assert outcome(two, want) == "failed"


def test_logprobs_are_checked_where_asked_within_the_tolerance():
    want, lps = [5, 6, 7], [-0.5, -1.25, -2.0]
    ok = _sent(want)
    ok.stream.logprobs = [-0.5, -1.25, -2.0 + 1e-7]
    assert outcome(ok, want, lps, tolerance=1e-5) == "exact" and outcome(ok, want, lps) == "failed"
    assert outcome(ok, want) == "exact"  # (none expected: none checked)
    short = _sent(want)
    short.stream.logprobs = lps[:2]  # one token's logprobs never came
    key = catalogue(1)[0].key
    r = report([short], {key: want}, [], [], [], [], {key: lps})
    assert r["failed"] == 1 and r["failures"][0]["logprobs_differ_at"] == 2
    asks = catalogue(3)
    assert (
        {a.kind for a in asks if a.logprobs}
        == {a.kind for a in asks if a.adjusted}
        == {a.kind for a in asks if a.structured}
        == {"greedy", "seeded", "long", "chat"}
    )
    assert {a.key for a in asks if a.n == 2} == {1, 7, 13, 19}
    assert next(a for a in asks if a.n == 2).body("m")["n"] == 2
    structured = next(a for a in asks if a.structured).body("m")
    assert structured["response_format"]["json_schema"]["schema"]["required"] == ["topic", "facts", "year"]


def test_a_gap_is_the_fault_s_that_struck_before_it():
    kill = Struck("kill-worker", at=100.0)
    near = _sent([1, 2, 3], arrivals=[99.0, 100.5, 100.6])  # 1.5 s across the kill
    far = _sent([1, 2, 3], arrivals=[10.0, 10.2, 10.3])
    gaps = gaps_by_fault([near, far], [kill])
    assert gaps["kill-worker"] == [pytest.approx(1500.0)] and gaps["quiet"] == [pytest.approx(200.0)]


def test_the_longest_gaps_name_their_request_token_and_fault():
    kill = Struck("kill-worker", at=100.0, what="worker 2 killed")
    near = _sent([1, 2, 3], arrivals=[99.0, 100.5, 100.6])
    near.stream.request_id = "cmpl-near"
    far = _sent([1, 2, 3, 4], arrivals=[10.0, 10.2, 10.3, 11.0])
    top = longest_gaps([far, near], [kill], t0=90.0, count=2)
    assert [g["gap_ms"] for g in top] == [1500.0, 700.0]
    assert top[0] == {
        "gap_ms": 1500.0,
        "request": "cmpl-near",
        "kind": near.ask.kind,
        "after_token": 1,
        "at_s": 9.0,
        "fault": "kill-worker at 10.00s: worker 2 killed",
    }
    assert top[1]["fault"] == "none" and top[1]["after_token"] == 3


def test_a_rollout_cut_short_by_a_router_restart_is_said_so_unproven(monkeypatch):
    """Found by the third 60-minute soak: the restarted router knows no rollout (404) and the fault's
    harness failed on the error body (KeyError) instead of saying what happened."""
    answers = iter(
        [httpx.Response(202, json={}), httpx.Response(404, json={"error": {"message": "no rollout has run"}})]
    )
    monkeypatch.setattr(soak_faults.httpx, "request", lambda *a, **kw: next(answers))
    nemesis = soak_faults.Nemesis("http://127.0.0.1:1", list, None, None, 5.0, seed=1)
    s = Struck("rollout", 0.0)
    nemesis._rollout(s)
    assert s.what == "rollout cut short by a router restart (no rollout has run)" and s.proof is None
