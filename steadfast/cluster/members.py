"""Who is in a deployment spread over hosts (`serve --role router|node --join etcd://...`): the records
its parts keep in etcd, under the join URL's prefix P.

    P/members/router         where the router takes workers' outputs (RouterRecord), under the router's lease
    P/members/nodes/{name}   a node: its ledger and live workers (NodeRecord), attached to the node's etcd
                             lease: when the node stops answering, etcd's clock removes it
    P/members/worker_ids     the next free worker id (ids are unique across the deployment)
    P/nodes/{name}/...       that node's ledger (`node_ledger_url`)

The router polls the nodes' records (cluster/membership.py); a node rewrites its record as its workers
start and die (`NodeMembership`). Values are msgspec JSON, readable with `etcdctl get`.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time

import msgspec

from steadfast.config import env
from steadfast.config.ledger_url import etcd_address
from steadfast.kv.ledger.open import sibling_ledger_url
from steadfast.util.etcd import Compare, EtcdClient, EtcdError, Put, Result, Target
from steadfast.wire.worker import WorkerRole

log = logging.getLogger("steadfast.cluster.members")

NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")
GONE_KEPT = 32  # deaths a node's record remembers (the router reads their exit codes)
MAX_RECORD_BYTES = 1 << 20  # a record larger than this is not one of ours: ignored
MAX_WORKERS = 1024  # workers a node's record may list (each is a socket in the router)
# A node leaving keeps its last record (its workers retired) this long before removing it, so that the
# router, polling every 0.25 s, reads how each worker ended rather than a node gone with its workers.
LEAVE_GRACE_S = 1.0
ROUTER_TTL_S = 10  # the router's record lives this long past its last renewal (every third of it)


class _Lapsed(Exception):
    """This node's lease is gone: its record with it."""


class MembershipError(RuntimeError):
    """The deployment's records say no: a node name taken, a join URL that is not etcd's."""


class RouterRecord(msgspec.Struct, forbid_unknown_fields=False):
    outputs: str  # tcp://host:port the workers connect their outputs to
    pid: int = 0


class WorkerEntry(msgspec.Struct):
    worker_id: int
    address: str  # tcp://host:port its input listens on
    role: WorkerRole
    pid: int = 0
    like: int = -1  # the worker it replaces (a rollout), else -1


class Gone(msgspec.Struct):
    worker_id: int
    pid: int
    exit_code: int  # 0: retired (no fencing); else died and fenced by its node


class NodeRecord(msgspec.Struct):
    name: str
    ledger_url: str
    workers: list[WorkerEntry] = []
    gone: list[Gone] = []
    # Which registration this is (the key's create revision, set when read, not written): a node that
    # lapsed and registered again is another generation, and its earlier workers are dead.
    generation: int = 0


def check_node_name(name: str) -> str:
    if NODE_NAME.match(name) is None:
        raise MembershipError(f"node name {name!r}: use letters, digits, '_', '.', '-' (up to 63, first alphanumeric)")
    return name


class Members:
    """The deployment's records in the etcd cluster a join URL names."""

    def __init__(self, join_url: str, timeout_s: float = 5.0) -> None:
        address = etcd_address(join_url)
        if address is None:
            raise MembershipError(f"--join {join_url!r}: parts join through etcd (etcd://host:port,.../prefix)")
        endpoints, self.prefix, user = address
        self.join_url = join_url
        self._client = (endpoints, timeout_s, user, env.etcd_password() if user else "")
        self.etcd = self.new_client()
        self._router_key = f"{self.prefix}/members/router".encode()
        self._nodes = f"{self.prefix}/members/nodes/".encode()
        self._ids = f"{self.prefix}/members/worker_ids".encode()

    def new_client(self) -> EtcdClient:
        """A client of its own (for a thread: an `EtcdClient` is used by one thread at a time)."""
        endpoints, timeout_s, user, password = self._client
        return EtcdClient(endpoints, timeout_s=timeout_s, user=user, password=password)

    def close(self) -> None:
        self.etcd.close()

    def node_key(self, name: str) -> bytes:
        return self._nodes + check_node_name(name).encode()

    def node_ledger_url(self, name: str) -> str:
        return sibling_ledger_url(self.join_url, f"/nodes/{check_node_name(name)}")

    def publish_router(self, record: RouterRecord, lease: int) -> None:
        """The router's address, attached to `lease`, which the router keeps alive (`router_alive`): a
        node that starts while no router runs waits for one rather than sending to a dead address."""
        self.etcd.put(self._router_key, msgspec.json.encode(record), lease)

    def router_alive(self, record: RouterRecord, lease: int) -> int:
        """Renew the router's lease; once it lapsed (the router stalled), publish again under a new one.
        Returns the lease in force."""
        if self.etcd.lease_keepalive(lease) > 0:
            return lease
        lease, _ = self.etcd.lease_grant(ROUTER_TTL_S)
        self.publish_router(record, lease)
        return lease

    def router(self) -> RouterRecord | None:
        kvs = self.etcd.get(self._router_key)
        if not kvs:
            return None
        return msgspec.json.decode(kvs[0].value, type=RouterRecord)

    def nodes(self) -> dict[str, NodeRecord]:
        """Every node whose record is there now (a malformed record is logged and skipped)."""
        out = {}
        for kv in self.etcd.get(self._nodes, prefix=True):
            name = kv.key[len(self._nodes) :].decode(errors="replace")
            try:
                check_node_name(name)
                if len(kv.value) > MAX_RECORD_BYTES:
                    raise msgspec.DecodeError(f"{len(kv.value)} bytes")
                record = msgspec.json.decode(kv.value, type=NodeRecord)
                if record.name != name or len(record.workers) > MAX_WORKERS:
                    raise msgspec.DecodeError(f"named {record.name!r}, {len(record.workers)} workers")
            except (msgspec.DecodeError, MembershipError) as exc:
                log.warning("ignored node %r's malformed record: %s", name, exc)
                continue
            record.generation = kv.create_revision
            out[name] = record
        return out

    def reserve_worker_ids(self, count: int) -> int:
        """The first of `count` worker ids no other part has or will have (a compare-and-swap on a counter)."""
        while True:
            kvs = self.etcd.get(self._ids)
            first = int(kvs[0].value) if kvs else 0
            revision = kvs[0].mod_revision if kvs else 0
            result = self.etcd.txn(
                [Compare(self._ids, Target.MOD, Result.EQUAL, revision)], [Put(self._ids, str(first + count).encode())]
            )
            if result.succeeded:
                return first


class NodeMembership:
    """A node's record, attached to an etcd lease this node keeps alive (`join`), rewritten as its
    workers come and go. When the node cannot renew in time (stopped, cut off, its host gone), etcd ends
    the lease and the record with it: the router fences the node's workers and moves their requests. If
    the node comes back it registers again under a new lease with the workers it has then (the router
    never takes back a worker it declared dead).

    After `join`, only the keeper thread talks to etcd: `joined` and `died` change the record and wake it,
    so the supervisor that calls them never waits for etcd (which may be unreachable for seconds)."""

    def __init__(self, members: Members, name: str, ttl_s: int) -> None:
        self.members = members
        self.etcd = members.new_client()  # the keeper's: the supervisor's thread uses `members.etcd`
        self.name = check_node_name(name)
        self.key = members.node_key(name)
        self.ttl_s = max(2, ttl_s)
        self.record = NodeRecord(name, members.node_ledger_url(name))
        self.lease = 0
        self.lapses = 0  # times this node's record was found gone (it was taken for dead)
        self._dirty = False  # the record changed since etcd last took it
        self._lock = threading.Lock()  # the record and _dirty
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def join(self) -> None:
        """Register; MembershipError if a live node of this name is still registered after one TTL (an
        earlier run of this node, killed, leaves its record until its lease ends)."""
        deadline = time.monotonic() + self.ttl_s + 1
        while True:
            try:
                self._register()
                break
            except MembershipError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        self._thread = threading.Thread(target=self._keep, name="node-membership", daemon=True)
        self._thread.start()

    def _register(self) -> None:
        """A new lease and the record under it; on any failure no lease is left (`lease` 0: the keeper
        registers again), so the node is never alive in etcd without its record."""
        self.lease = 0
        lease, _ = self.etcd.lease_grant(self.ttl_s)
        with self._lock:
            data, self._dirty = msgspec.json.encode(self.record), False
        try:
            created = self.etcd.txn([Compare(self.key, Target.CREATE, Result.EQUAL, 0)], [Put(self.key, data, lease)])
        except EtcdError:
            with contextlib.suppress(EtcdError):
                self.etcd.lease_revoke(lease)
            raise
        if not created.succeeded:
            self.etcd.lease_revoke(lease)
            raise MembershipError(f"a node named {self.name!r} is registered and alive already")
        self.lease = lease

    def joined(self, entry: WorkerEntry) -> None:
        with self._lock:
            self.record.workers.append(entry)
            self._dirty = True
        self._wake.set()

    def died(self, gone: Gone) -> None:
        with self._lock:
            self.record.workers = [w for w in self.record.workers if w.worker_id != gone.worker_id]
            self.record.gone = [*self.record.gone, gone][-GONE_KEPT:]
            self._dirty = True
        self._wake.set()

    def _write(self) -> None:
        """The record as it is now, if it changed, into etcd (under this node's lease only)."""
        with self._lock:
            if not self._dirty:
                return
            data, self._dirty = msgspec.json.encode(self.record), False
        try:
            written = self.etcd.txn(
                [Compare(self.key, Target.LEASE, Result.EQUAL, self.lease)], [Put(self.key, data, self.lease)]
            ).succeeded
        except EtcdError:
            written = False
            raise
        finally:
            if not written:
                with self._lock:
                    self._dirty = True  # written again, by this round's registration or the next round
        if not written:
            raise _Lapsed

    def _keep(self) -> None:
        renew_at = time.monotonic() + self.ttl_s / 3
        while not self._stop.is_set():
            self._wake.wait(max(0.0, renew_at - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if self.lease == 0:  # a registration that failed: again
                    self._register()
                    continue
                if time.monotonic() >= renew_at:
                    renew_at = time.monotonic() + self.ttl_s / 3
                    if self.etcd.lease_keepalive(self.lease) <= 0:
                        raise _Lapsed
                self._write()
            except _Lapsed:
                self.lapses += 1
                log.error(
                    "node %s's membership lapsed (it did not renew within %d s): its workers were fenced;"
                    " registering again",
                    self.name,
                    self.ttl_s,
                )
                self.lease = 0
                self._wake.set()
            except (EtcdError, MembershipError) as exc:
                log.warning("node %s's membership not renewed or written: %s", self.name, exc)
                renew_at = min(renew_at, time.monotonic() + 0.5)  # try again soon

    def leave(self) -> None:
        """Stop renewing, write how the last workers ended, and remove the record (a stop in order)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            if self.lease:
                self._write()
                if self.record.gone:
                    time.sleep(LEAVE_GRACE_S)
                self.etcd.lease_revoke(self.lease)
        except (EtcdError, _Lapsed) as exc:
            log.warning("node %s's record not removed (it ends with its lease): %r", self.name, exc)
        finally:
            self.etcd.close()
