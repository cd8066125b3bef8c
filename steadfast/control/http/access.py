"""Who is calling, and what they may ask for: client keys and the priority each may claim, the Host
names the router answers to, and whether an admin write comes from a page of another site.

Pure rules over the config and one call's headers; control/http/guard.py applies them to every call.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from steadfast.config.access import AccessConfig, ApiKey
from steadfast.config.ledger_url import is_loopback_host
from steadfast.wire.worker import Priority

# Names a browser resolves to this machine without DNS (RFC 6761 `.localhost` included).
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
# The legacy single key (server.api_key): the deployment's one shared secret, so it may ask for anything.
DEFAULT_KEY_NAME = "default"
# Content types a browser may send cross-site without asking first (a "simple" request).
SIMPLE_TYPES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data", "text/plain", ""})


@dataclass(frozen=True)
class Identity:
    """A caller as the router knows it: the key's name ("" without keys), the highest priority its
    requests get, and how many of its /v1 calls may run at once (0: no limit of its own)."""

    name: str
    max_priority: Priority
    max_concurrent: int = 0

    def priority(self, asked: str) -> str:
        """The priority a request asking for `asked` is served at: its own, or its key's highest."""
        wanted = Priority[asked.upper()]
        return max(wanted, self.max_priority).name.lower()  # (a larger value is a lower priority)


def host_name(header: str) -> str:
    """The name in a Host header, without port or IPv6 brackets, lower case."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    name, _, port = header.rpartition(":")
    return name if name and port.isdigit() else header


def _ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def own_names() -> frozenset[str]:
    """This machine's own names (hostname and FQDN): a client on the LAN may call the router by them."""
    names = {socket.gethostname().lower()}
    try:
        names.add(socket.getfqdn().lower())
    except OSError:
        pass
    return frozenset(n for n in names if n)


class Access:
    """The rules for one router, built once from its config."""

    def __init__(
        self,
        cfg: AccessConfig,
        api_key: str = "",
        admin_api_key: str = "",
        listen_hosts: tuple[str, ...] = ("127.0.0.1",),
        machine_names: frozenset[str] = frozenset(),
    ) -> None:
        self.cfg = cfg
        self.admin_api_key = admin_api_key
        keys = list(cfg.keys)
        if api_key:
            keys.append(ApiKey(DEFAULT_KEY_NAME, api_key, "high"))
        self.keys = tuple(keys)
        honoured = cfg.client_priority == "on" or (
            cfg.client_priority == "auto" and all(is_loopback_host(h) for h in listen_hosts)
        )
        self.anonymous = Identity("", Priority.HIGH if honoured else Priority.NORMAL)
        self.any_host = "*" in cfg.allowed_hosts
        self.hosts = LOOPBACK_NAMES | machine_names | {h.lower() for h in cfg.allowed_hosts if h != "*"}
        self.proxied = bool(cfg.trusted_proxies)

    @property
    def keyed(self) -> bool:
        return bool(self.keys)

    def identify(self, token: str) -> Identity | None:
        """The caller a bearer token names; the anonymous caller without keys; None for a wrong or
        missing key. Every key is compared, in constant time each, so timing tells nothing of which."""
        if not self.keys:
            return self.anonymous
        found = None
        for key in self.keys:
            if hmac.compare_digest(token.encode(), key.key.encode()) and found is None:
                found = key
        if found is None:
            return None
        return Identity(found.name, Priority[found.max_priority.upper()], found.max_concurrent)

    def host_allowed(self, header: str | None, admin: bool) -> bool:
        """Whether a call naming `header` in Host is for this router. A name that is neither an IP
        literal, a loopback name, this machine's nor an allowed one is what a DNS-rebinding page sends
        (its own domain, resolved to this address). /admin never takes the wildcard."""
        if header is None:
            return False  # HTTP/1.1 requires Host; a call without one came from no browser nor client library
        name = host_name(header)
        if _ip_literal(name) or name in self.hosts or name.endswith(".localhost"):
            return True
        return self.any_host and not admin

    def admin_by_address(self) -> bool:
        """Whether a loopback peer may be admin without the admin key: not when a proxy is in front
        (every client then arrives from the proxy's address, which may be loopback)."""
        return not self.admin_api_key and not self.proxied

    @staticmethod
    def cross_site_write(method: str, host: str | None, origin: str | None, content_type: str) -> str:
        """Why an admin call that changes state looks sent by a page of another site ("" if it does
        not): an Origin that is not this router's, or a body type a page may send without asking the
        router first (a "simple" request, which the browser sends before any CORS check)."""
        if method in ("GET", "HEAD", "OPTIONS"):
            return ""
        if origin is not None:
            netloc = urlsplit(origin).netloc.lower() if origin != "null" else "null"
            if netloc != (host or "").strip().lower():
                return f"an admin write from origin {origin!r}, not this router's"
        if content_type.split(";")[0].strip().lower() in SIMPLE_TYPES:
            return "an admin write needs Content-Type: application/json (a page of another site cannot send it unasked)"
        return ""
