"""The soak's pure parts: its schedule replays from the seed, its catalogue is stable, and its checker
counts what a client lost, got twice or got changed, and puts each gap under the fault that caused it."""

from __future__ import annotations

import pytest

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
