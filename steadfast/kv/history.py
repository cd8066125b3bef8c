"""Recording ledger operations and checking the history, in the spirit of etcd's robustness tests.

`RecordingLedger` wraps any ledger and appends every call with its outcome; `check_history` replays
the accepted operations and reports each broken invariant: two owners of a block at once, a write
accepted under a stale epoch, a sealed block changed, blocks reclaimed from an unfenced worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from steadfast.kv.ledger import Lease, Ledger

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


@dataclass
class Op:
    seq: int
    name: str
    args: tuple[Any, ...]
    ok: bool
    result: Any = None
    error: str | None = None


@dataclass
class RecordingLedger:
    inner: Ledger
    history: list[Op] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.inner, name)
        if not callable(target) or name in {"blocks", "leases", "lease", "request", "requests", "check_integrity"}:
            return target

        def call(*args: Any) -> Any:
            op = Op(len(self.history), name, args, ok=False)
            self.history.append(op)
            try:
                op.result = target(*args)
            except Exception as exc:
                op.error = f"{type(exc).__name__}: {exc}"
                raise
            op.ok = True
            return op.result

        call.__name__ = name
        return call


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
        elif op.name == "reclaim":
            if active.get(a[0], False):
                problems.append(f"#{op.seq}: blocks of {a[0]} reclaimed while its lease is active")
            kept, quarantined = op.result
            for b in (*kept, *quarantined):
                owner.pop(b, None)
            for key in [k for k, w in writing.items() if w == a[0]]:
                del writing[key]  # a dead writer's slots are freed by the reclaim
    return problems
