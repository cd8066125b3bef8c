"""Who may talk on the router <-> worker queues when they cross hosts (`serve --role router|node`):
ZeroMQ CURVE, one keypair for the router and one for every node.

`steadfast cluster-keys DIR` makes both into `router.keys` and `node.keys` (0600, created new); the
operator copies `router.keys` to the router's host and `node.keys` to each node's. Each file holds its side's
keypair and the other side's public key. Both ends of every queue authenticate: a worker's input and the
router's output are CURVE servers letting in only the other side's public key (a ZAP handler on the
process's context: CURVE alone admits any client that made up a keypair), and each sender pins the
receiver's public key. Only paths go on command lines; this module never logs a secret key.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from steadfast.kv.moves.curve import AllowedKeys, require_curve


class ClusterSide(enum.StrEnum):
    ROUTER = "router"
    NODE = "node"


@dataclass(frozen=True)
class ClusterKeys:
    """One side's keypair and the other side's public key (Z85 text, as ZeroMQ takes them)."""

    side: ClusterSide
    public: bytes
    secret: bytes = field(repr=False)  # (never in a log line or a traceback)
    peer: bytes = b""

    def to_json(self) -> str:
        keys = {"public": self.public, "secret": self.secret, "peer": self.peer}
        return json.dumps({"side": str(self.side), **{name: key.decode() for name, key in keys.items()}})

    @classmethod
    def load(cls, path: str | Path, side: ClusterSide) -> ClusterKeys:
        """The keys of `side` from `path`; ValueError when the file is another side's or malformed."""
        try:
            d = json.loads(Path(path).read_text())
            keys = cls(ClusterSide(d["side"]), d["public"].encode(), d["secret"].encode(), d["peer"].encode())
        except (OSError, KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"{path}: not a cluster key file ({exc})") from None
        if keys.side is not side:
            raise ValueError(f"{path} holds the {keys.side}'s keys; the {side} needs {side}.keys")
        if not all(len(k) == 40 for k in (keys.public, keys.secret, keys.peer)):
            raise ValueError(f"{path}: a key is not 40 Z85 characters")
        return keys


def write_cluster_keys(directory: str | Path) -> dict[ClusterSide, Path]:
    """A new router and node keypair, written as `router.keys` and `node.keys` in `directory` (0600,
    created new: an existing file is an error, never overwritten or trusted)."""
    require_curve()
    router, node = zmq.curve_keypair(), zmq.curve_keypair()
    files = {
        ClusterSide.ROUTER: ClusterKeys(ClusterSide.ROUTER, *router, peer=node[0]),
        ClusterSide.NODE: ClusterKeys(ClusterSide.NODE, *node, peer=router[0]),
    }
    Path(directory).mkdir(mode=0o700, parents=True, exist_ok=True)
    paths = {}
    for side, keys in files.items():
        path = paths[side] = Path(directory) / f"{side}.keys"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(keys.to_json())
    return paths


def guard(ctx: zmq.Context, keys: ClusterKeys) -> ThreadAuthenticator:
    """Start `ctx`'s ZAP handler, letting in only the other side's key; before any socket binds (a CURVE
    server on a context without a handler admits every client). An asyncio context is guarded through a
    plain shadow of it (the handler runs on a thread). The caller stops it."""
    require_curve()
    plain = zmq.Context.shadow(ctx.underlying) if type(ctx) is not zmq.Context else ctx
    auth = ThreadAuthenticator(plain)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=AllowedKeys((keys.peer,)))
    return auth


def as_server(sock: zmq.Socket, keys: ClusterKeys) -> None:
    """Before `bind`: encrypt with this side's keypair; who connects is the ZAP handler's question."""
    sock.curve_server = True
    sock.curve_publickey, sock.curve_secretkey = keys.public, keys.secret


def as_client(sock: zmq.Socket, keys: ClusterKeys) -> None:
    """Before `connect`: authenticate with this side's keypair, accept only the other side as server."""
    sock.curve_serverkey = keys.peer
    sock.curve_publickey, sock.curve_secretkey = keys.public, keys.secret
