"""Config section `access`: who may ask for what, and the limits on an HTTP connection before a route
sees it (control/http/access.py decides; control/http/guard.py enforces)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from steadfast.config.base import ConfigError

PRIORITY_NAMES = ("low", "normal", "high")  # lowest first: a key may ask for its own and those below
CLIENT_PRIORITY = ("auto", "on", "off")
MAX_KEYS = 256
MIN_KEY_CHARS = 16  # 96 bits at base64, the least a guesser should face


@dataclass(frozen=True)
class ApiKey:
    """One client's key: its name (logs, metrics), the highest priority its requests may ask for, and
    how many of its /v1 calls may run at once (0: no limit of its own)."""

    name: str = ""
    key: str = field(default="", repr=False)  # (kept out of logs)
    max_priority: str = "normal"
    max_concurrent: int = 0

    def check(self, where: str) -> None:
        if not self.name or len(self.name) > 64 or not self.name.isprintable():
            raise ConfigError(f"{where}.name must be 1..64 printable characters")
        if len(self.key) < MIN_KEY_CHARS or len(self.key) > 512 or not self.key.isascii() or " " in self.key:
            raise ConfigError(f"{where}.key must be {MIN_KEY_CHARS}..512 ASCII characters without spaces")
        if self.max_priority not in PRIORITY_NAMES:
            raise ConfigError(f"{where}.max_priority must be one of {', '.join(PRIORITY_NAMES)}")
        if self.max_concurrent < 0:
            raise ConfigError(f"{where}.max_concurrent must be >= 0")


@dataclass(frozen=True)
class AccessConfig:
    # Client keys (also STEADFAST_API_KEYS, a JSON list of the same mappings; never the command line):
    # each `{name, key, max_priority, max_concurrent}`. With keys (or server.api_key, a key named
    # "default" that may ask for any priority), every /v1 call needs one of them, and a request asking
    # for a priority above its key's is served at its key's highest.
    keys: tuple[ApiKey, ...] = ()
    # Without keys: whether a request's `priority` is honoured. auto: only when every address the router
    # listens on is loopback (anyone who can reach it is on this host); off: every request is normal.
    client_priority: str = "auto"
    # Host names a client may call the router by, besides IP literals, loopback names and this
    # machine's own names; "*" allows any (a DNS-rebinding page then reaches the API, never /admin).
    allowed_hosts: tuple[str, ...] = ()
    # Proxies whose X-Forwarded-For is believed (addresses or networks). Empty: the peer's address is
    # the client's. With a proxy configured, /admin needs server.admin_api_key (a loopback peer may be it).
    trusted_proxies: tuple[str, ...] = ()
    # HTTP calls one client address may have open at once (429 beyond); /health and /admin not counted.
    max_connections_per_client: int = 512
    # Seconds a client may take to send a request's headers, then its body (408 for a body).
    header_timeout: float = field(default=10.0, metadata={"duration": True})
    body_timeout: float = field(default=30.0, metadata={"duration": True})
    # Bytes of request line and headers together (431 beyond).
    max_header_bytes: int = 65536

    def __post_init__(self) -> None:
        if len(self.keys) > MAX_KEYS:
            raise ConfigError(f"access.keys holds at most {MAX_KEYS} keys")
        for i, key in enumerate(self.keys):
            key.check(f"access.keys[{i}]")
        names = [k.name for k in self.keys]
        if len(set(names)) != len(names) or len({k.key for k in self.keys}) != len(self.keys):
            raise ConfigError("access.keys: each key needs a name and a key of its own")
        if self.client_priority not in CLIENT_PRIORITY:
            raise ConfigError(f"access.client_priority must be one of {', '.join(CLIENT_PRIORITY)}")
        for proxy in self.trusted_proxies:
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                raise ConfigError(f"access.trusted_proxies: {proxy!r} is not an address or network") from None
        if self.max_connections_per_client < 1:
            raise ConfigError("access.max_connections_per_client must be >= 1")
        if self.header_timeout <= 0 or self.body_timeout <= 0:
            raise ConfigError("access.header_timeout and access.body_timeout must be positive")
        if not 1024 <= self.max_header_bytes <= 2**20:
            raise ConfigError("access.max_header_bytes must be in 1024..1048576")
