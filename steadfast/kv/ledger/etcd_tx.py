"""Optimistic transactions over etcd for the etcd ledger: read, decide in Python, commit only if nothing
read has changed since.

A `Tx` records each key it reads with the revision it was last modified at (0: absent) and buffers its
writes. `commit` is one etcd transaction: every tracked key compared on that revision, then every write;
so the decision and the writes it made land together, or (another writer got there first) not at all
and `atomically` runs the whole decision again on fresh reads. Every key written is tracked, so no
update is ever lost; a read that only guides a choice (which FREE blocks to take) may be untracked.

A ledger object keeps a `ReadCache` of what it last read or wrote: a tracked read is served from it, so
the common write (a worker sealing its own blocks) is one round trip, not a read and then a commit.
That is safe because the commit compares every such value on its revision: a stale one fails the
commit, the failure answers the current values, and the decision is made again on them; a decision
that raised an error on cached values is made again on fresh reads before the error is believed, and
a decision that writes nothing still has its cached values confirmed by a comparison-only transaction.

A commit whose answer was lost (a member died with the request in flight; the client sends it again)
finds its comparisons false the second time. The failure branch reads back every written key: if each
already holds what this transaction wrote, it did commit, and is not run again (a grant made twice would
leak blocks).
"""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from steadfast.kv.ledger.interface import LedgerError, LedgerUnavailableError
from steadfast.util.etcd import (
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

T = TypeVar("T")

MAX_OPS = 128  # etcd's default --max-txn-ops: compares, and separately the operations of each branch


class ReadCache:
    """Keys this ledger object last read or wrote: key -> (mod revision, value or None where absent),
    the most recent `size` holding at most `max_bytes` of values; shared by its threads."""

    def __init__(self, size: int = 2048, max_bytes: int = 16 * 2**20) -> None:
        self.size = size
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, tuple[int, bytes | None]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: bytes) -> tuple[int, bytes | None] | None:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def put(self, key: bytes, revision: int, value: bytes | None) -> None:
        # No check that it is newer than what is there: an absent key has no revision to order by,
        # and a stale entry only costs a failed comparison, which refreshes it.
        with self._lock:
            self._pop(key)
            self._entries[key] = (revision, value)
            self._bytes += len(value or b"")
            while len(self._entries) > self.size or self._bytes > self.max_bytes:
                self._pop(next(iter(self._entries)))

    def drop(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._pop(key)

    def _pop(self, key: bytes) -> None:
        _, value = self._entries.pop(key, (0, None))
        self._bytes -= len(value or b"")


class Tx:
    """One attempt of an operation: its reads (key -> (mod revision, value or None)) and writes."""

    def __init__(self, client: EtcdClient, cache: ReadCache | None = None) -> None:
        self.client = client
        self.cache = cache
        self.reads: dict[bytes, tuple[int, bytes | None]] = {}
        self.tracked: set[bytes] = set()
        self.cached: set[bytes] = set()  # tracked reads served from the cache, not yet confirmed
        self.writes: dict[bytes, tuple[bytes | None, int]] = {}  # key -> (value, or None to delete; lease)
        self.prefix_deletes: list[bytes] = []
        # Where this attempt stands in etcd's order: 2 x the revision it committed at, or 2 x the revision
        # it read at + 1 (a read sees the state after that revision's writes).
        self.order = 0

    def _seen(self, revision: int) -> None:
        self.order = max(self.order, 2 * revision + 1)

    def _read(self, key: bytes, revision: int, value: bytes | None) -> None:
        self.reads[key] = (revision, value)
        if self.cache is not None:
            self.cache.put(key, revision, value)

    def get_many(self, keys: Iterable[bytes], track: bool = True) -> list[bytes | None]:
        """The values of `keys` (None where absent), read in one request where any is not read yet
        (a tracked read may come from the cache: the commit confirms it)."""
        keys = list(keys)
        fresh = []
        for k in dict.fromkeys(keys):
            if k in self.reads or k in self.writes:
                continue
            hit = self.cache.get(k) if track and self.cache is not None else None
            if hit is not None:
                self.reads[k] = hit
                self.cached.add(k)
            else:
                fresh.append(k)
        for i in range(0, len(fresh), MAX_OPS):
            part = fresh[i : i + MAX_OPS]
            answer = self.client.txn([], [Get(k) for k in part])
            self._seen(answer.revision)
            for key, response in zip(part, answer.responses, strict=True):
                kvs = kvs_of(response.get("response_range", {}))
                self._read(key, *((kvs[0].mod_revision, kvs[0].value) if kvs else (0, None)))
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
        self._seen(answer.revision)
        out = []
        for response in answer.responses:
            found = []
            for kv in kvs_of(response.get("response_range", {})):
                if kv.key not in self.reads:
                    self._read(kv.key, kv.mod_revision, kv.value)
                value = self.writes[kv.key][0] if kv.key in self.writes else kv.value
                if value is not None:
                    found.append((kv.key, value))
            out.append(found)
        return out

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        self._write(key, value, lease)

    def delete(self, key: bytes) -> None:
        self._write(key, None, 0)

    def delete_prefix(self, prefix: bytes) -> None:
        """Delete every key under `prefix`, uncompared: only for keys deleted together with one this
        transaction writes (a request's body parts with its row), which carries the comparison."""
        self.prefix_deletes.append(prefix)

    def _write(self, key: bytes, value: bytes | None, lease: int) -> None:
        if key not in self.reads:
            self.get(key)  # a write is compared on what it replaces, absent included
        self.tracked.add(key)
        self.writes[key] = (value, lease)

    def commit(self) -> bool:
        """Apply the writes if no tracked key changed; whether they are applied now. A cached value
        found stale is refreshed (from the failed transaction's answer) for the next attempt."""
        unconfirmed = sorted(self.cached & self.tracked)
        if not self.writes and not self.prefix_deletes and not unconfirmed:
            return True
        compared = sorted(self.tracked) if self.writes else unconfirmed
        compares = [Compare(k, Target.MOD, Result.EQUAL, self.reads[k][0]) for k in compared]
        ops = [Put(k, v, lease) if v is not None else Delete(k) for k, (v, lease) in self.writes.items()]
        ops += [Delete(p, prefix=True) for p in self.prefix_deletes]
        if len(compares) > MAX_OPS or len(ops) > MAX_OPS:
            raise LedgerError(
                f"one ledger operation needs {len(compares)} comparisons and {len(ops)} writes; etcd's default "
                f"--max-txn-ops is {MAX_OPS}: give it fewer blocks at a time"
            )
        reread = list(dict.fromkeys([*self.writes, *unconfirmed]))
        answer = self.client.txn(compares, ops, [Get(k) for k in reread])
        if answer.succeeded:
            for key, (value, _) in self.writes.items():
                self._read(key, answer.revision, value)
            self.order = 2 * answer.revision if self.writes else 2 * answer.revision + 1
            return True
        now: dict[bytes, tuple[int, bytes | None]] = {}
        for key, response in zip(reread, answer.responses, strict=True):
            kvs = kvs_of(response.get("response_range", {}))
            now[key] = (kvs[0].mod_revision, kvs[0].value) if kvs else (0, None)
            if self.cache is not None:
                self.cache.put(key, *now[key])
        # An earlier send of this very transaction committed (its answer lost): every key it writes
        # holds what it wrote. Nothing else can leave them so, since each value names its writer.
        if bool(self.writes) and all(now[k][1] == v for k, (v, _) in self.writes.items()):
            self.order = 2 * max(now[k][0] for k in self.writes)  # (the revision it did commit at)
            return True
        return False


def atomically(
    client: EtcdClient,
    fn: Callable[[Tx], T],
    timeout_s: float,
    name: str = "",
    cache: ReadCache | None = None,
    order: threading.local | None = None,
) -> T:
    """Run `fn` on fresh (or cached) reads and commit what it wrote, again while another writer got
    there first; etcd's own failures become `LedgerUnavailableError`. `order.value`: where the last
    attempt stands in etcd's order (`Tx.order`)."""
    deadline = time.monotonic() + timeout_s
    wait = 0.001
    use_cache = cache
    attempts = 0
    while True:
        tx = Tx(client, use_cache)
        try:
            try:
                result = fn(tx)
                if tx.commit():
                    return result
            finally:
                if order is not None:
                    order.value = tx.order
        except EtcdUnavailableError as exc:
            raise LedgerUnavailableError(f"etcd ledger: {exc}") from exc
        except EtcdError as exc:
            raise LedgerError(f"etcd ledger refused {name or 'an operation'}: {exc}") from exc
        except LedgerError:
            if not tx.cached or cache is None:
                raise
            # Decided on cached values nobody confirmed: decide again on what etcd holds now.
            cache.drop(tx.cached)
            use_cache = None
            continue
        attempts += 1
        if attempts == 1 and tx.cached:
            continue  # most likely a stale cached value, refreshed by the failed commit: again at once
        if time.monotonic() + wait > deadline:
            what = name or "an operation"
            raise LedgerUnavailableError(f"etcd ledger: {what} lost to other writers for {timeout_s}s")
        time.sleep(wait * (1 + random.random()))  # apart, so that two contenders do not collide again
        wait = min(0.1, wait * 2)
