"""A small etcd v3 client over etcd's JSON gateway (HTTP on the client port, `POST /v3/...`), with httpx.

Why not a gRPC client: `etcd3` (0.12, 2020) no longer imports with protobuf >= 4.21, and `aetcd` pins
protobuf >= 5.27 / grpcio >= 1.66 into the serving stack; the gateway is part of etcd itself (3.4+) and
needs nothing beyond httpx, which the router already uses. What the ledger needs is here: range, put,
delete, transactions compared on revisions or values (so etcd itself rejects a stale writer), leases.

The gateway's JSON is protobuf's: keys and values base64, 64-bit integers as strings, and fields at
their zero value left out (a failed transaction has no `succeeded`). Each call goes to the endpoint that
answered last; a member that cannot be reached, or that answers that it has no leader, is passed over
for the next until `timeout_s` is spent. One attempt waits at most `attempt_s`: a request in flight when
the leader dies waits out etcd's own request timeout (~6 s with default settings), so it is sent again
to the next member instead. A put sent twice writes the same value twice; a transaction whose first
attempt did commit finds its comparison false on the second (callers compare on revisions, then read).
"""

from __future__ import annotations

import base64
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

RETRY_S = 0.05  # the first wait after every endpoint failed; doubled up to 1 s


class EtcdError(RuntimeError):
    """etcd refused a request (a bad request, too many operations, a request too large)."""


class EtcdUnavailableError(EtcdError):
    """No member answered within the timeout (down, partitioned, or without a leader)."""


class Target(enum.StrEnum):
    VERSION = "VERSION"
    CREATE = "CREATE"
    MOD = "MOD"
    VALUE = "VALUE"
    LEASE = "LEASE"


class Result(enum.StrEnum):
    EQUAL = "EQUAL"
    GREATER = "GREATER"
    LESS = "LESS"
    NOT_EQUAL = "NOT_EQUAL"


_COMPARE_FIELD = {
    Target.VERSION: "version",
    Target.CREATE: "create_revision",
    Target.MOD: "mod_revision",
    Target.LEASE: "lease",
}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _range_end(prefix: bytes) -> bytes:
    """The key after every key that starts with `prefix` (etcd's prefix convention)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"  # every key
    end[-1] += 1
    return bytes(end)


@dataclass(frozen=True)
class Compare:
    """A transaction's condition: `target` of `key` compared with `value` (an int, or bytes for VALUE).
    A key that does not exist has version, create and mod revisions 0."""

    key: bytes
    target: Target
    result: Result
    value: int | bytes

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": _b64(self.key), "target": self.target.value, "result": self.result.value}
        if self.target is Target.VALUE:
            assert isinstance(self.value, bytes)
            out["value"] = _b64(self.value)
        else:
            out[_COMPARE_FIELD[self.target]] = str(int(self.value))
        return out


@dataclass(frozen=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0

    def body(self) -> dict[str, Any]:
        put: dict[str, Any] = {"key": _b64(self.key), "value": _b64(self.value)}
        if self.lease:
            put["lease"] = str(self.lease)
        return {"request_put": put}


@dataclass(frozen=True)
class Delete:
    key: bytes
    prefix: bool = False

    def body(self) -> dict[str, Any]:
        return {"request_delete_range": _range_body(self.key, self.prefix)}


@dataclass(frozen=True)
class Get:
    key: bytes
    prefix: bool = False

    def body(self) -> dict[str, Any]:
        return {"request_range": _range_body(self.key, self.prefix)}


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int  # the store's revision after the transaction (unchanged where it failed)
    responses: list[dict[str, Any]]  # one per operation of the branch taken, as etcd answered


def _range_body(key: bytes, prefix: bool) -> dict[str, Any]:
    out = {"key": _b64(key)}
    if prefix:
        out["range_end"] = _b64(_range_end(key))
    return out


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        base64.b64decode(raw.get("key", "")),
        base64.b64decode(raw.get("value", "")),
        int(raw.get("create_revision", 0)),
        int(raw.get("mod_revision", 0)),
        int(raw.get("version", 0)),
        int(raw.get("lease", 0)),
    )


def kvs_of(response: dict[str, Any]) -> list[KeyValue]:
    """The key-values of a range answer (a `range` call's, or a transaction's `response_range`)."""
    return [_kv(raw) for raw in response.get("kvs", [])]


class EtcdClient:
    def __init__(
        self,
        endpoints: Sequence[str],
        timeout_s: float = 5.0,
        attempt_s: float = 1.0,
        user: str = "",
        password: str = "",
    ) -> None:
        """`user`, `password`: log in to a cluster with authentication on (etcd's simple tokens: the
        token goes with every request, and is asked for again when etcd says it is no longer valid)."""
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout_s = timeout_s
        self.user, self._password = user, password
        self._token = ""
        self._current = 0
        self._http = httpx.Client(timeout=httpx.Timeout(min(attempt_s, timeout_s)))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if not self.user:
            return self._send(path, body)
        if not self._token:
            self._login()
        try:
            return self._send(path, body)
        except EtcdError as exc:
            if "auth token" not in str(exc):  # (etcd: "invalid auth token", after its tokens' TTL)
                raise
        self._login()
        return self._send(path, body)

    def _login(self) -> None:
        self._token = ""
        try:
            answer = self._send("/v3/auth/authenticate", {"name": self.user, "password": self._password})
        except EtcdError as exc:
            raise EtcdError(f"etcd refused the login of user {self.user!r}: {exc}") from None
        self._token = str(answer.get("token", ""))

    def _send(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        headers = {"Authorization": self._token} if self._token else None
        wait = RETRY_S
        last = ""
        while True:
            for _ in range(len(self.endpoints)):
                endpoint = self.endpoints[self._current]
                try:
                    r = self._http.post(endpoint + path, json=body, headers=headers)
                except httpx.TransportError as exc:
                    last = f"{endpoint}: {exc!r}"
                    self._current = (self._current + 1) % len(self.endpoints)
                    continue
                answer = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
                if r.status_code == 200:
                    return answer
                message = str(answer.get("error") or answer.get("message") or r.text)
                if r.status_code < 500 or "too many operations" in message or "too large" in message:
                    raise EtcdError(f"etcd refused {path}: {message}")
                last = f"{endpoint}: {r.status_code} {message}"  # no leader, leader changed, timed out
                self._current = (self._current + 1) % len(self.endpoints)
            if time.monotonic() + wait > deadline:
                raise EtcdUnavailableError(f"no etcd member answered {path} in {self.timeout_s}s; last: {last}")
            time.sleep(wait)
            wait = min(1.0, 2 * wait)

    def get(self, key: bytes, prefix: bool = False) -> list[KeyValue]:
        return kvs_of(self._post("/v3/kv/range", _range_body(key, prefix)))

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Write `key`; the store's revision after it."""
        return int(self._post("/v3/kv/put", Put(key, value, lease).body()["request_put"])["header"]["revision"])

    def delete(self, key: bytes, prefix: bool = False) -> int:
        """Delete `key` (every key under it with `prefix`); how many were deleted."""
        return int(
            self._post("/v3/kv/deleterange", Delete(key, prefix).body()["request_delete_range"]).get("deleted", 0)
        )

    def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Put | Delete | Get],
        failure: Sequence[Put | Delete | Get] = (),
    ) -> TxnResult:
        """All of `success` if every comparison holds, else all of `failure`, atomically."""
        body = {
            "compare": [c.body() for c in compare],
            "success": [op.body() for op in success],
            "failure": [op.body() for op in failure],
        }
        answer = self._post("/v3/kv/txn", body)
        return TxnResult(
            bool(answer.get("succeeded", False)), int(answer["header"]["revision"]), answer.get("responses", [])
        )

    def lease_grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: its id and the TTL etcd granted (it raises TTLs below its minimum)."""
        answer = self._post("/v3/lease/grant", {"TTL": ttl_s})
        return int(answer["ID"]), int(answer["TTL"])

    def lease_keepalive(self, lease: int) -> int:
        """Renew `lease` on etcd's clock; its TTL from now, 0 where it has already expired."""
        answer = self._post("/v3/lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", answer).get("TTL", 0))

    def lease_revoke(self, lease: int) -> None:
        """End `lease` and delete every key attached to it (nothing where it has expired already)."""
        try:
            self._post("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as exc:
            if "requested lease not found" not in str(exc):
                raise

    def lease_ttl(self, lease: int) -> int:
        """Seconds `lease` has left (-1: expired or never granted)."""
        return int(self._post("/v3/lease/timetolive", {"ID": str(lease)}).get("TTL", -1))

    def status(self, endpoint: str) -> dict[str, Any]:
        """One member's status (its id under header.member_id, the leader's under leader)."""
        return self._http.post(endpoint.rstrip("/") + "/v3/maintenance/status", json={}).json()
