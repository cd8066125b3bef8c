"""Optimistic transactions over etcd for the etcd ledger: read, decide in Python, commit only if nothing
read has changed since.

A `Tx` records each key it reads with the revision it was last modified at (0: absent) and buffers its
writes. `commit` is one etcd transaction: every tracked key compared on that revision, then every write;
so the decision and the writes it made land together, or (another writer got there first) not at all
and `atomically` runs the whole decision again on fresh reads. Every key written is tracked, so no
update is ever lost; a read that only guides a choice (which FREE blocks to take) may be untracked.

A commit whose answer was lost (a member died with the request in flight; the client sends it again)
finds its comparisons false the second time. The failure branch reads back every written key: if each
already holds what this transaction wrote, it did commit, and is not run again (a grant made twice would
leak blocks).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from steadfast.kv.etcd_client import (
    Compare,
    Delete,
    EtcdClient,
    EtcdError,
    EtcdUnavailableError,
    Get,
    Put,
    Result,
    Target,
    kvs_of,
)
from steadfast.kv.ledger import LedgerError, LedgerUnavailableError

T = TypeVar("T")

MAX_OPS = 128  # etcd's default --max-txn-ops: compares, and separately the operations of each branch


class Tx:
    """One attempt of an operation: its reads (key -> (mod revision, value or None)) and writes."""

    def __init__(self, client: EtcdClient) -> None:
        self.client = client
        self.reads: dict[bytes, tuple[int, bytes | None]] = {}
        self.tracked: set[bytes] = set()
        self.writes: dict[bytes, tuple[bytes | None, int]] = {}  # key -> (value, or None to delete; lease)

    def get_many(self, keys: Iterable[bytes], track: bool = True) -> list[bytes | None]:
        """The values of `keys` (None where absent), read in one request where any is not read yet."""
        keys = list(keys)
        fresh = list(dict.fromkeys(k for k in keys if k not in self.reads and k not in self.writes))
        for i in range(0, len(fresh), MAX_OPS):
            part = fresh[i : i + MAX_OPS]
            answer = self.client.txn([], [Get(k) for k in part])
            for key, response in zip(part, answer.responses, strict=True):
                kvs = kvs_of(response.get("response_range", {}))
                self.reads[key] = (kvs[0].mod_revision, kvs[0].value) if kvs else (0, None)
        if track:
            self.tracked.update(k for k in keys if k in self.reads)
        return [self.writes[k][0] if k in self.writes else self.reads[k][1] for k in keys]

    def get(self, key: bytes, track: bool = True) -> bytes | None:
        return self.get_many([key], track)[0]

    def scan(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """Every (key, value) under `prefix`, in key order, untracked (a later write of one tracks it)."""
        return self.scan_many([prefix])[0]

    def scan_many(self, prefixes: Sequence[bytes]) -> list[list[tuple[bytes, bytes]]]:
        """`scan` of each prefix, all read at one revision."""
        answer = self.client.txn([], [Get(p, prefix=True) for p in prefixes])
        out = []
        for response in answer.responses:
            found = []
            for kv in kvs_of(response.get("response_range", {})):
                self.reads.setdefault(kv.key, (kv.mod_revision, kv.value))
                value = self.writes[kv.key][0] if kv.key in self.writes else kv.value
                if value is not None:
                    found.append((kv.key, value))
            out.append(found)
        return out

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        self._write(key, value, lease)

    def delete(self, key: bytes) -> None:
        self._write(key, None, 0)

    def _write(self, key: bytes, value: bytes | None, lease: int) -> None:
        if key not in self.reads:
            self.get(key)  # a write is compared on what it replaces, absent included
        self.tracked.add(key)
        self.writes[key] = (value, lease)

    def commit(self) -> bool:
        """Apply the writes if no tracked key changed; whether they are applied now."""
        if not self.writes:
            return True
        compares = [Compare(k, Target.MOD, Result.EQUAL, self.reads[k][0]) for k in sorted(self.tracked)]
        ops = [Put(k, v, lease) if v is not None else Delete(k) for k, (v, lease) in self.writes.items()]
        if len(compares) > MAX_OPS or len(ops) > MAX_OPS:
            raise LedgerError(
                f"one ledger operation needs {len(compares)} comparisons and {len(ops)} writes; etcd's default "
                f"--max-txn-ops is {MAX_OPS}: give it fewer blocks at a time"
            )
        answer = self.client.txn(compares, ops, [Get(k) for k in self.writes])
        if answer.succeeded:
            return True
        for key, response in zip(self.writes, answer.responses, strict=True):
            kvs = kvs_of(response.get("response_range", {}))
            now = kvs[0].value if kvs else None
            if now != self.writes[key][0]:
                return False
        return True  # an earlier send of this very transaction committed


def atomically(client: EtcdClient, fn: Callable[[Tx], T], timeout_s: float, name: str = "") -> T:
    """Run `fn` on fresh reads and commit what it wrote, again while another writer got there first;
    etcd's own failures become `LedgerUnavailableError`."""
    deadline = time.monotonic() + timeout_s
    wait = 0.001
    while True:
        tx = Tx(client)
        try:
            result = fn(tx)
            if tx.commit():
                return result
        except EtcdUnavailableError as exc:
            raise LedgerUnavailableError(f"etcd ledger: {exc}") from exc
        except EtcdError as exc:
            raise LedgerError(f"etcd ledger refused {name or 'an operation'}: {exc}") from exc
        if time.monotonic() + wait > deadline:
            raise LedgerUnavailableError(
                f"etcd ledger: {name or 'an operation'} lost to other writers for {timeout_s}s"
            )
        time.sleep(wait * (1 + random.random()))  # apart, so that two contenders do not collide again
        wait = min(0.1, wait * 2)
