"""The soak's checker: every request accounted for (exact, refused at admission, failed), every token
lost, repeated or changed counted, the clients' gaps by the fault that was striking when they happened,
every fault's proof, the ledger's recorded history and each node's ledger against its arena.

Pure over what the run recorded, except `node_problems` (it attaches to the pools to read them).
"""

from __future__ import annotations

import difflib
import heapq
import os
from collections import defaultdict
from typing import Any

from steadfast.kv.arena.arena import map_arena
from steadfast.kv.integrity import check_node
from steadfast.kv.ledger.open import open_ledger
from steadfast.kv.pool.client import PoolClient
from steadfast.ops.harness.loadgen import percentile
from steadfast.ops.harness.soak import Sent
from steadfast.ops.harness.soak_faults import Struck

FAULT_WINDOW_S = 15.0  # a gap that overlaps this long after a strike is that fault's


# Problems and failed requests a report lists, each kind (an hour's soak failed 46 requests once: a list of
# 20 hid half of them; the terminal shows the first 20).
LISTED = 500


def diff(want: list[int], got: list[int]) -> dict[str, int]:
    """Tokens lost (expected, never received), repeated (received beyond what was expected) and changed."""
    out = {"lost": 0, "repeated": 0, "changed": 0}
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, want, got, autojunk=False).get_opcodes():
        if op == "delete":
            out["lost"] += i2 - i1
        elif op == "insert":
            out["repeated"] += j2 - j1
        elif op == "replace":
            out["changed"] += min(i2 - i1, j2 - j1)
            out["lost"] += max(0, (i2 - i1) - (j2 - j1))
            out["repeated"] += max(0, (j2 - j1) - (i2 - i1))
    return out


def logprobs_differ(want: list[float] | None, got: list[float], tolerance: float) -> int | None:
    """Where a stream's logprobs first differ from the expected (None: alike, or none expected)."""
    if want is None:
        return None
    at = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if abs(a - b) > tolerance), None)
    return at if at is not None or len(want) == len(got) else min(len(want), len(got))


def outcome(sent: Sent, want: list[int], want_logprobs: list[float] | None = None, tolerance: float = 0.0) -> str:
    s = sent.stream
    if not s.accepted:
        return "refused"  # never taken by the service: waited out until the client's deadline
    if s.error or s.finish != "length" or s.all_tokens != want:
        return "failed"
    if logprobs_differ(want_logprobs, s.logprobs, tolerance) is not None:
        return "failed"
    return "exact"


def _cause(order: list[Struck], a: float, b: float) -> Struck | None:
    """The fault a gap from `a` to `b` is put down to: the last of `order` (by time) to strike before it
    ended and at most `FAULT_WINDOW_S` before it began."""
    return next((f for f in reversed(order) if a - FAULT_WINDOW_S < f.at < b), None)


def gaps_by_fault(sent: list[Sent], struck: list[Struck]) -> dict[str, list[float]]:
    """Per fault kind, each stream's longest gap between two tokens put down to a fault of that kind: the
    last one to strike before the gap ended and at most `FAULT_WINDOW_S` before it began (`quiet`: the
    longest gap of each stream no fault touched), in ms."""
    order = sorted(struck, key=lambda f: f.at)
    by_kind: dict[str, list[float]] = defaultdict(list)
    for x in sent:
        arrivals = x.stream.arrivals
        pairs = list(zip(arrivals, arrivals[1:], strict=False))
        if not pairs:
            continue
        longest: dict[str, float] = {}
        for a, b in pairs:
            cause = _cause(order, a, b)
            if cause is not None:
                longest[cause.kind] = max(longest.get(cause.kind, 0.0), b - a)
        for kind, gap in longest.items():
            by_kind[kind].append(1000 * gap)
        if not longest:
            by_kind["quiet"].append(1000 * max(b - a for a, b in pairs))
    return dict(by_kind)


def longest_gaps(sent: list[Sent], struck: list[Struck], t0: float, count: int = 5) -> list[dict[str, Any]]:
    """The `count` longest gaps of the run, each with its request, where it began (seconds from `t0`),
    after which token, and the fault it is put down to (as `gaps_by_fault` does): where to look first."""
    order = sorted(struck, key=lambda f: f.at)
    gaps = (
        (b - a, i + 1, a, b, x)
        for x in sent
        for i, (a, b) in enumerate(zip(x.stream.arrivals, x.stream.arrivals[1:], strict=False))
    )
    top = []
    for gap, token, a, b, x in heapq.nlargest(count, gaps, key=lambda g: g[0]):
        cause = _cause(order, a, b)  # (only for these: a long soak has ~10^5 gaps)
        top.append(
            {
                "gap_ms": round(1000 * gap, 1),
                "request": x.stream.request_id,
                "kind": x.ask.kind,
                "after_token": token,
                "at_s": round(a - t0, 2),
                "fault": f"{cause.kind} at {cause.at - t0:.2f}s: {cause.what}" if cause is not None else "none",
            }
        )
    return top


def node_problems(pool_addresses: list[str]) -> list[str]:
    """`check_node` on every node: its ledger against itself and its arena's bytes."""
    problems = []
    for address in pool_addresses:
        reply = PoolClient(address, "soak-inspector").attach(os.getpid())
        problems += [f"{address}: {p}" for p in check_node(open_ledger(reply.ledger_url), map_arena(reply))]
    return problems


def report(
    sent: list[Sent],
    expected: dict[int, list[int]],
    struck: list[Struck],
    history_problems: list[str],
    node: list[str],
    leaks: list[str],
    logprobs: dict[int, list[float]] | None = None,
    tolerance: float = 0.0,
) -> dict[str, Any]:
    """`logprobs`: each token's expected logprob by ask key, for the asks that want them; `tolerance`: the
    difference allowed (0 where outputs are bit-identical whatever the batch: bf16 `model.deterministic`)."""
    outcomes = {"exact": 0, "refused": 0, "failed": 0}
    tokens = {"lost": 0, "repeated": 0, "changed": 0}
    failures = []
    for x in sent:
        want = expected[x.ask.key]
        want_logprobs = (logprobs or {}).get(x.ask.key)
        o = outcome(x, want, want_logprobs, tolerance)
        outcomes[o] += 1
        if o == "failed":
            got = x.stream.all_tokens
            d = diff(want, got)
            for k in tokens:
                tokens[k] += d[k]
            at = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
            failures.append(
                {
                    "ask": x.ask.key,
                    "kind": x.ask.kind,
                    "request": x.stream.request_id,
                    "error": x.stream.error,
                    "finish": x.stream.finish,
                    "tokens": f"{len(got)} of {len(want)}, first difference at {at}",
                    "logprobs_differ_at": logprobs_differ(want_logprobs, x.stream.logprobs, tolerance),
                    "reconnects": x.stream.reconnects,
                    "refusals": x.stream.refusals,
                    "sent_at_monotonic": round(x.at, 2),
                }
                | d
            )
    kinds: dict[str, dict[str, int]] = defaultdict(lambda: {"struck": 0, "proven": 0})
    for f in struck:
        kinds[f.kind]["struck"] += 1
        kinds[f.kind]["proven"] += f.proven
    gaps = {
        kind: {
            "streams": len(v),
            "p50_ms": round(percentile(v, 50), 1),
            "p99_ms": round(percentile(v, 99), 1),
            "max_ms": round(max(v), 1),
        }
        for kind, v in sorted(gaps_by_fault(sent, struck).items())
    }
    proven = sum(f.proven for f in struck)
    return {
        "requests": len(sent),
        **outcomes,
        "refusals_waited_out": sum(x.stream.refusals for x in sent),
        "reconnects": sum(x.stream.reconnects for x in sent),
        "tokens": tokens,
        "faults": len(struck),
        "faults_proven": proven,
        "fault_kinds": dict(sorted(kinds.items())),
        "gaps": gaps,
        "history_problems": history_problems[:LISTED],
        "node_problems": node[:LISTED],
        "leaks": leaks[:LISTED],
        "failures": failures[:LISTED],
        "passed": outcomes["failed"] == 0
        and not any(tokens.values())
        and not history_problems
        and not node
        and not leaks,
    }
