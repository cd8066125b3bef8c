"""Recording ledger operations and checking the history, in the spirit of etcd's robustness tests.

`RecordingLedger` wraps any ledger and appends every call with its outcome; `check_history` replays
the accepted operations and reports each broken invariant: two owners of a block at once, a write
accepted under a stale epoch, a sealed block changed, blocks reclaimed from an unfenced worker.

Across processes: with `STEADFAST_LEDGER_JOURNAL` set to a folder, every ledger a process opens records
its calls there (`open_ledger` wraps it), one JSON line when a call starts and one when it ends, with
the call's place in the store's order (`Ledger.commit_order`); `load_journal` merges the files of every
process into one history in that order. A call whose process was killed before it ended has no outcome:
it may have committed, so it counts as accepted (where its answer is not needed to replay it).
"""

from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from steadfast.kv.ledger.interface import Lease, LeaseState, Ledger, RequestCheckpoint

# Calls that carry (worker, epoch) as their first two arguments and write.
_EPOCH_WRITES = {
    "renew_lease",
    "release_lease",
    "grant",
    "adopt",
    "hand_over",
    "authorize_write",
    "seal",
    "unseal",
    "free",
    "checkpoint",
    "reserve_slots",
    "store_slots",
    "free_slots",
    "adopt_slots",
}


# Calls whose answer the checker needs to replay them: one whose process died before it ended is left out.
_NEEDS_RESULT = {"acquire_lease", "fence", "grant", "hand_over", "reclaim", "reserve_slots"}
# A call its process died in is left out of the history when its answer is needed to replay it, or when
# it changes no record (a late renewal is no write to check).
_LEFT_OUT_UNFINISHED = _NEEDS_RESULT | {"renew_lease"}
_READS = {"blocks", "leases", "lease", "request", "requests", "check_integrity", "commit_order", "tiers", "slots"}


@dataclass
class Op:
    seq: int
    name: str
    args: tuple[Any, ...]
    ok: bool
    result: Any = None
    error: str | None = None


class Journal:
    """One ledger object's calls, appended to `<folder>/<pid>-<n>.jsonl` as they start and end, each line
    written whole (unbuffered), so a process killed mid-call leaves every line before it. Its first line
    names the `store` (the ledger's URL): one folder can hold the journals of several nodes' ledgers."""

    _count = itertools.count()

    def __init__(self, folder: str, store: str = "") -> None:
        self.fd = os.open(
            Path(folder, f"{os.getpid()}-{next(self._count)}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600
        )
        self._calls = itertools.count()
        self._lock = threading.Lock()
        self.write({"store": store})

    def write(self, line: dict[str, Any]) -> None:
        data = msgspec.json.encode(line) + b"\n"
        with self._lock:
            os.write(self.fd, data)

    def call(self, name: str, args: tuple[Any, ...]) -> int:
        n = next(self._calls)
        self.write({"n": n, "name": name, "args": [_slim(a) for a in args]})
        return n

    def close(self) -> None:
        os.close(self.fd)


DIED = "died in the call"  # the error of a journaled call with no outcome line: counted as accepted


def _slim(arg: Any) -> Any:
    """A call's argument as the journal keeps it: a checkpoint by its request only."""
    if isinstance(arg, list | tuple) and arg and isinstance(arg[0], RequestCheckpoint):
        return [r.request_id for r in arg]
    return arg


@dataclass
class RecordingLedger:
    inner: Ledger
    history: list[Op] = field(default_factory=list)
    journal: Journal | None = None  # set: calls go there, not to `history`

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.inner, name)
        if not callable(target) or name in _READS:
            return target

        def call(*args: Any, **options: Any) -> Any:
            # Recorded by its positional arguments (the checker's); options (grant's `below`) pass through.
            op = Op(len(self.history), name, args, ok=False)
            n = self.journal.call(name, args) if self.journal is not None else None
            if self.journal is None:
                self.history.append(op)
            try:
                op.result = target(*args, **options)
            except Exception as exc:
                op.error = f"{type(exc).__name__}: {exc}"
                raise
            else:
                op.ok = True
            finally:
                if self.journal is not None:
                    ended = {"n": n, "ok": op.ok, "result": op.result, "error": op.error}
                    self.journal.write({**ended, "order": self.inner.commit_order()})
            return op.result

        call.__name__ = name
        return call


def journal_stores(folder: str | Path) -> list[str]:
    """The ledgers (their URLs) whose calls are journaled in `folder`: each has a history of its own."""
    stores = set()
    for path in Path(folder).glob("*.jsonl"):
        with open(path, "rb") as f:
            first = f.readline()
        if first.strip():
            stores.add(msgspec.json.decode(first).get("store", ""))
    return sorted(stores)


def load_journal(folder: str | Path, store: str | None = None) -> list[Op]:
    """Every process's recorded calls in `folder` (those on the ledger `store` only, when given), as one
    history in the store's order."""
    entries: list[tuple[int, str, int, Op]] = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        started: dict[int, dict[str, Any]] = {}
        ended: dict[int, dict[str, Any]] = {}
        on = ""
        for line in path.read_bytes().splitlines():
            if not line.strip():
                continue
            record = msgspec.json.decode(line)
            if "store" in record:
                on = record["store"]
                continue
            (ended if "ok" in record else started)[record["n"]] = record
        if store is not None and on != store:
            continue
        last = 0
        for n, call in sorted(started.items()):
            end = ended.get(n)
            if end is None and call["name"] in _LEFT_OUT_UNFINISHED:
                continue
            ok = end["ok"] if end is not None else True  # died in it: it may have committed
            result = end["result"] if end is not None else None
            if call["name"] == "acquire_lease" and ok:
                result = Lease(**{**result, "state": LeaseState(result["state"])})
            elif call["name"] == "reclaim" and ok:
                result = tuple(result)
            # One that never ended goes right after the same process's call before it.
            order = end["order"] if end is not None and end["order"] else last
            last = order
            op = Op(0, call["name"], tuple(call["args"]), ok, result, end["error"] if end else DIED)
            entries.append((order, path.name, n, op))
    history = [op for *_, op in sorted(entries, key=lambda e: e[:3])]
    for seq, op in enumerate(history):
        op.seq = seq
    return history


def _expanded(history: list[Op]) -> list[Op]:
    """`seal_and_unseal` checked as what it is: its unseals, then its seals."""
    out = []
    for op in history:
        if op.name == "seal_and_unseal":
            worker, epoch, seals, unseals = op.args
            out.append(Op(op.seq, "unseal", (worker, epoch, list(unseals)), op.ok))
            out.append(Op(op.seq, "seal", (worker, epoch, list(seals)), op.ok))
        else:
            out.append(op)
    return out


def check_history(history: list[Op]) -> list[str]:
    """Every invariant the accepted operations of `history` break, in order; empty when none."""
    problems: list[str] = []
    epoch: dict[str, int] = {}  # worker -> its current epoch
    active: dict[str, bool] = {}
    owner: dict[int, tuple[str, int]] = {}  # block -> (worker, epoch) while granted
    # Blocks whose owner came from a call its process died in: counted as committed (it may have been),
    # so a reclaim that does not give them back shows it was not.
    maybe: set[int] = set()
    sealed: set[int] = set()
    writing: dict[tuple[str, int], str] = {}  # offload-tier slot -> the worker writing into it
    for op in _expanded(history):
        if not op.ok:
            continue
        a = op.args
        if op.name == "acquire_lease":
            lease: Lease = op.result
            if lease.epoch <= max(epoch.values(), default=0):
                problems.append(f"#{op.seq}: epoch {lease.epoch} granted is not above every earlier epoch")
            epoch[a[0]], active[a[0]] = lease.epoch, True
        elif op.name == "fence":
            if op.result <= max(epoch.values(), default=0):
                problems.append(f"#{op.seq}: fencing epoch {op.result} is not above every earlier epoch")
            epoch[a[0]], active[a[0]] = op.result, False
        elif op.name in _EPOCH_WRITES:
            worker, used = a[0], a[1]
            if epoch.get(worker) != used or not active.get(worker, False):
                problems.append(f"#{op.seq}: {op.name} by {worker} accepted with stale epoch {used}")
            if op.name == "release_lease":
                active[worker] = False
            elif op.name == "grant":
                for b in op.result:
                    if b in owner:
                        problems.append(f"#{op.seq}: block {b} granted to {worker} while owned by {owner[b][0]}")
                    else:
                        sealed.discard(b)  # an ownerless sealed block nobody adopted, reused
                    owner[b] = (worker, used)
            elif op.name == "adopt":
                for b, _ in a[2]:
                    if b in owner and owner[b] != (worker, used):
                        problems.append(f"#{op.seq}: block {b} adopted by {worker} while owned by {owner[b][0]}")
                    if b not in sealed:
                        problems.append(f"#{op.seq}: block {b} adopted by {worker} but not sealed")
                    owner[b] = (worker, used)
                    if op.error == DIED:
                        maybe.add(b)
                    else:
                        maybe.discard(b)
            elif op.name == "hand_over":
                to = a[3]
                for seal in a[4] if len(a) > 4 else ():
                    if owner.get(seal[0]) != (worker, used) or seal[0] in sealed:
                        problems.append(f"#{op.seq}: block {seal[0]} sealed by {worker}/{used} in a handoff")
                    sealed.add(seal[0])
                if not active.get(to, False) or epoch.get(to) != op.result:
                    problems.append(f"#{op.seq}: blocks handed to {to} under epoch {op.result}, not its live one")
                for b in a[2]:
                    if owner.get(b) != (worker, used):
                        problems.append(f"#{op.seq}: block {b} handed over by {worker}/{used}, not its owner")
                    owner[b] = (to, op.result)
            elif op.name in ("authorize_write", "seal"):
                ids = [a[2]] if op.name == "authorize_write" else [seal[0] for seal in a[2]]
                for b in ids:
                    if b in sealed:
                        problems.append(f"#{op.seq}: sealed block {b} changed by {op.name}")
                    if owner.get(b) != (worker, used):
                        problems.append(f"#{op.seq}: {op.name} on block {b} not owned by {worker}/{used}")
                if op.name == "seal":
                    sealed.update(ids)
            elif op.name == "unseal":
                for b in a[2]:
                    if owner.get(b) != (worker, used) or b not in sealed:
                        problems.append(f"#{op.seq}: unseal of block {b} that {worker}/{used} had not sealed")
                    sealed.discard(b)
            elif op.name == "free":
                for b in a[2]:
                    owner.pop(b, None)
                    sealed.discard(b)
            elif op.name == "reserve_slots":
                for slot in op.result:
                    if (a[2], slot) in writing:
                        problems.append(
                            f"#{op.seq}: {a[2]} slot {slot} reserved by {worker} while "
                            f"{writing[(a[2], slot)]} writes it"
                        )
                    writing[(a[2], slot)] = worker
            elif op.name == "store_slots":
                for slot, *_ in a[3]:
                    if writing.pop((a[2], slot), None) != worker:
                        problems.append(f"#{op.seq}: {a[2]} slot {slot} stored by {worker}, who did not reserve it")
            elif op.name == "free_slots":
                for slot in a[3]:
                    writing.pop((a[2], slot), None)
        elif op.name == "arena_replaced":  # a new arena: every block free, every live lease fenced
            owner.clear()
            sealed.clear()
            maybe.clear()
            active = dict.fromkeys(active, False)
        elif op.name == "reclaim":
            if active.get(a[0], False):
                problems.append(f"#{op.seq}: blocks of {a[0]} reclaimed while its lease is active")
            kept, quarantined = op.result
            for b in (*kept, *quarantined):
                owner.pop(b, None)
                maybe.discard(b)
            # Nothing is the worker's after it. A block the model still gives it came from an adoption
            # it died in that never committed (the soak's seed 7); any other is a block the store lost.
            for b in [b for b, (w, _) in owner.items() if w == a[0]]:
                if b not in maybe:
                    problems.append(f"#{op.seq}: block {b} of {a[0]} not given back by its reclaim")
                del owner[b]
                maybe.discard(b)
            for key in [k for k, w in writing.items() if w == a[0]]:
                del writing[key]  # a dead writer's slots are freed by the reclaim
    return problems
