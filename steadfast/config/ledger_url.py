"""Ledger URLs read, without opening anything: which store a URL names and where (see `ledger_url` for
the forms). Kept apart from the backends so that checking a config's URL imports no store's client."""

from __future__ import annotations

import ipaddress
import re


class LedgerUrlError(ValueError):
    """A ledger URL that names no store this build can open: malformed, or of an unknown scheme."""


# RFC 3986's scheme syntax; a string that does not start with one is a file path.
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(.*)\Z", re.DOTALL)
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})\Z")
ETCD_PREFIX = "/steadfast"
ETCD_PASSWORD = "STEADFAST_ETCD_PASSWORD"  # (env.etcd_password reads it)


def _scheme(url: str) -> tuple[str, str] | None:
    match = _SCHEME.match(url)
    return (match[1].lower(), match[2]) if match else None


def etcd_address(url: str) -> tuple[list[str], str, str] | None:
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


def is_loopback_host(host: str) -> bool:
    """Whether `host` (a name, or an address, IPv6 in brackets or not) is this machine's loopback:
    `localhost` or an address in 127.0.0.0/8 or ::1. Names are not resolved: any other one is not."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def plaintext_remote_members(url: str) -> list[str]:
    """The members (host:port) of an etcd ledger URL reached over plain HTTP on another host: what the
    ledger holds (every prompt, every token generated) crosses the network readable to them. Empty for
    `etcd+https://`, for loopback members and for other stores."""
    address = etcd_address(url)
    if address is None:
        return []
    members = [e.removeprefix("http://") for e in address[0] if e.startswith("http://")]
    return [m for m in members if not is_loopback_host(m.rpartition(":")[0])]


def sqlite_path(url: str) -> str:
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
    if etcd_address(url) is None:
        sqlite_path(url)
