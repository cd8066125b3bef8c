"""Ledger addresses: the one place that turns a ledger URL into a backend and opens it.

Processes pass ledgers to each other (pool reply, command lines, config) as URLs, never as backend
objects or bare file names, so that a node can move to another store without its callers changing:

- `sqlite:///abs/path.db` or `sqlite:rel/path.db`: the embedded backend; the rest of the URL is the
  file's path verbatim (no percent-decoding, no query part). A plain file path means the same.
- `etcd://[user@]host:port,host:port,.../prefix`: the replicated backend on an etcd cluster (its members'
  client addresses, plain HTTP; `etcd+https://` for TLS), the ledger's keys under `/prefix` (default
  `/steadfast`): one cluster holds the ledgers of many nodes, each under its own prefix. With a user, it
  logs in with the password in `STEADFAST_ETCD_PASSWORD` (never in the URL).

Nothing outside this module and the backend's own module names a backend class.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from steadfast import env
from steadfast.kv.etcd_ledger import EtcdLedger
from steadfast.kv.history import Journal, RecordingLedger
from steadfast.kv.ledger import Ledger, LedgerUrlError
from steadfast.kv.sqlite_ledger import SqliteLedger

# RFC 3986's scheme syntax; a string that does not start with one is a file path.
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(.*)\Z", re.DOTALL)
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})\Z")
ETCD_PREFIX = "/steadfast"
ETCD_PASSWORD = "STEADFAST_ETCD_PASSWORD"  # (env.etcd_password reads it)


def _scheme(url: str) -> tuple[str, str] | None:
    match = _SCHEME.match(url)
    return (match[1].lower(), match[2]) if match else None


def _etcd(url: str) -> tuple[list[str], str, str] | None:
    """The member endpoints, key prefix and user an etcd URL names; None for another scheme."""
    parts = _scheme(url)
    if parts is None or parts[0] not in ("etcd", "etcd+http", "etcd+https"):
        return None
    scheme, rest = parts
    if not rest.startswith("//"):
        raise LedgerUrlError(f"ledger {url!r}: write etcd://[user@]host:port[,host:port...][/prefix]")
    hosts, _, path = rest[2:].partition("/")
    user, at, hosts = hosts.rpartition("@")
    if at and (not user or ":" in user):
        # A password in a URL ends up in config files, logs and command lines: it comes from the environment.
        raise LedgerUrlError(
            f"ledger {url.split('@')[-1]!r}: name the user only (user@host); the password goes in {ETCD_PASSWORD}"
        )
    members = [h for h in hosts.split(",") if h]
    if not members:
        raise LedgerUrlError(f"ledger {url!r} names no etcd member")
    for member in members:
        if _HOST_PORT.match(member) is None:
            raise LedgerUrlError(f"ledger {url!r}: {member!r} is not host:port")
    if "?" in path or "#" in path or "//" in path:
        raise LedgerUrlError(f"ledger {url!r}: the prefix is a plain path (no query, no empty part)")
    http = "https" if scheme == "etcd+https" else "http"
    prefix = "/" + path.strip("/") if path.strip("/") else ETCD_PREFIX
    return [f"{http}://{m}" for m in members], prefix, user


def _sqlite_path(url: str) -> str:
    """The SQLite file a ledger URL names; LedgerUrlError for any other store or a malformed URL."""
    if not url:
        raise LedgerUrlError("empty ledger URL; expected sqlite:///path/to/ledger.db")
    parts = _scheme(url)
    if parts is None:
        return url  # a plain file path
    scheme, rest = parts
    if scheme != "sqlite":
        raise LedgerUrlError(
            f"ledger {url!r}: unknown scheme {scheme!r}; expected sqlite:///path, a file path or etcd://host:port,..."
        )
    if rest.startswith("//"):
        rest = rest[2:]
        if rest and not rest.startswith("/"):
            # sqlite://name/... would name a host, which a local file has not.
            raise LedgerUrlError(f"ledger {url!r}: write sqlite:///absolute/path or sqlite:relative/path")
    if not rest:
        raise LedgerUrlError(f"ledger {url!r} names no file")
    return rest


def check_ledger_url(url: str) -> None:
    """Raise `LedgerUrlError` unless `url` names a store this build can open (nothing is opened)."""
    if _etcd(url) is None:
        _sqlite_path(url)


def open_ledger(url: str, *, clock: Callable[[], float] = time.monotonic, timeout_s: float = 10.0) -> Ledger:
    """Open the ledger `url` names. `clock`: what lease times are measured on; `timeout_s`: how long an
    operation waits for the store (busy, locked, no quorum) before it fails with `LedgerUnavailableError`."""
    etcd = _etcd(url)
    if etcd is not None:
        endpoints, prefix, user = etcd
        password = env.etcd_password() if user else ""
        ledger: Ledger = EtcdLedger(endpoints, prefix, clock=clock, timeout_s=timeout_s, user=user, password=password)
    else:
        ledger = SqliteLedger(_sqlite_path(url), clock=clock, timeout_s=timeout_s)
    if journal := env.ledger_journal():
        return RecordingLedger(ledger, journal=Journal(journal))  # type: ignore[return-value] - a Ledger by proxy
    return ledger


def sqlite_url(path: str | os.PathLike[str]) -> str:
    """The URL of the SQLite ledger file `path` (made absolute: a URL must mean the same in every
    process, whatever its working directory)."""
    return f"sqlite://{os.path.abspath(path)}"


def sibling_ledger_url(url: str, suffix: str) -> str:
    """Another node's ledger next to the one `url` names: for SQLite, a file beside it with `suffix`
    before its extension; for etcd, the same cluster under the prefix with `suffix` appended (an empty
    suffix: the same ledger)."""
    etcd = _etcd(url)
    if etcd is not None:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://{rest.partition('/')[0]}{etcd[1]}{suffix}"  # (the user, if any, stays)
    path = Path(_sqlite_path(url))
    return sqlite_url(path.with_name(f"{path.stem}{suffix}{path.suffix}"))
