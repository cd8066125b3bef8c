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
import time
from collections.abc import Callable
from pathlib import Path

from steadfast.config import env
from steadfast.config.ledger_url import LedgerUrlError, etcd_address, sqlite_path
from steadfast.kv.ledger.etcd import EtcdLedger
from steadfast.kv.ledger.history import Journal, RecordingLedger
from steadfast.kv.ledger.interface import Ledger, UnopenableLedgerError
from steadfast.kv.ledger.sqlite import SqliteLedger


def open_ledger(url: str, *, clock: Callable[[], float] = time.monotonic, timeout_s: float = 10.0) -> Ledger:
    """Open the ledger `url` names. `clock`: what lease times are measured on; `timeout_s`: how long an
    operation waits for the store (busy, locked, no quorum) before it fails with `LedgerUnavailableError`;
    a URL naming no store raises `UnopenableLedgerError`, a `LedgerError` like every other failure here."""
    try:
        etcd = etcd_address(url)
        path = sqlite_path(url) if etcd is None else ""
    except LedgerUrlError as exc:
        raise UnopenableLedgerError(str(exc)) from None
    if etcd is not None:
        endpoints, prefix, user = etcd
        password = env.etcd_password() if user else ""
        ledger: Ledger = EtcdLedger(endpoints, prefix, clock=clock, timeout_s=timeout_s, user=user, password=password)
    else:
        ledger = SqliteLedger(path, clock=clock, timeout_s=timeout_s)
    if journal := env.ledger_journal():
        return RecordingLedger(ledger, journal=Journal(journal, url))  # type: ignore[return-value] - a Ledger by proxy
    return ledger


def sqlite_url(path: str | os.PathLike[str]) -> str:
    """The URL of the SQLite ledger file `path` (made absolute: a URL must mean the same in every
    process, whatever its working directory)."""
    return f"sqlite://{os.path.abspath(path)}"


def sibling_ledger_url(url: str, suffix: str) -> str:
    """Another node's ledger next to the one `url` names: for SQLite, a file beside it with `suffix`
    before its extension; for etcd, the same cluster under the prefix with `suffix` appended (an empty
    suffix: the same ledger)."""
    etcd = etcd_address(url)
    if etcd is not None:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://{rest.partition('/')[0]}{etcd[1]}{suffix}"  # (the user, if any, stays)
    path = Path(sqlite_path(url))
    return sqlite_url(path.with_name(f"{path.stem}{suffix}{path.suffix}"))
