"""Ledger addresses: the one place that turns a ledger URL into a backend and opens it.

Processes pass ledgers to each other (pool reply, command lines, config) as URLs, never as backend
objects or bare file names, so that a node can move to another store without its callers changing:

- `sqlite:///abs/path.db` or `sqlite:rel/path.db`: the embedded backend; the rest of the URL is the
  file's path verbatim (no percent-decoding, no query part). A plain file path means the same.
- `etcd://host:port,...`: the replicated backend, not available yet (`BackendNotAvailableError`).

Nothing outside this module and the backend's own module names a backend class.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from steadfast.kv.ledger import BackendNotAvailableError, Ledger, LedgerUrlError
from steadfast.kv.sqlite_ledger import SqliteLedger

# RFC 3986's scheme syntax; a string that does not start with one is a file path.
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(.*)\Z", re.DOTALL)


def _sqlite_path(url: str) -> str:
    """The SQLite file a ledger URL names; LedgerUrlError for any other store or a malformed URL."""
    if not url:
        raise LedgerUrlError("empty ledger URL; expected sqlite:///path/to/ledger.db")
    match = _SCHEME.match(url)
    if match is None:
        return url  # a plain file path
    scheme, rest = match[1].lower(), match[2]
    if scheme == "etcd" or scheme.startswith("etcd+"):
        raise BackendNotAvailableError(f"ledger {url!r}: the etcd backend is not available yet; use sqlite:///path")
    if scheme != "sqlite":
        raise LedgerUrlError(f"ledger {url!r}: unknown scheme {scheme!r}; expected sqlite:///path or a file path")
    if rest.startswith("//"):
        rest = rest[2:]
        if rest and not rest.startswith("/"):
            # sqlite://name/... would name a host, which a local file has not.
            raise LedgerUrlError(f"ledger {url!r}: write sqlite:///absolute/path or sqlite:relative/path")
    if not rest:
        raise LedgerUrlError(f"ledger {url!r} names no file")
    return rest


def open_ledger(url: str, *, clock: Callable[[], float] = time.monotonic, timeout_s: float = 10.0) -> Ledger:
    """Open the ledger `url` names. `clock`: what lease times are measured on; `timeout_s`: how long an
    operation waits for the store (busy, locked) before it fails with `LedgerUnavailableError`."""
    return SqliteLedger(_sqlite_path(url), clock=clock, timeout_s=timeout_s)


def sqlite_url(path: str | os.PathLike[str]) -> str:
    """The URL of the SQLite ledger file `path` (made absolute: a URL must mean the same in every
    process, whatever its working directory)."""
    return f"sqlite://{os.path.abspath(path)}"


def sibling_ledger_url(url: str, suffix: str) -> str:
    """Another node's ledger next to the one `url` names: for SQLite, a file beside it with `suffix`
    before its extension (an empty suffix: the same file)."""
    path = Path(_sqlite_path(url))
    return sqlite_url(path.with_name(f"{path.stem}{suffix}{path.suffix}"))
