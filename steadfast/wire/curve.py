"""Who may talk on a wire that crosses hosts: ZeroMQ CURVE keys, one key-file type for every wire.

Two wires use it. The router <-> worker queues of a deployment over hosts (`steadfast cluster-keys DIR`
writes `router.keys` and `node.keys`; the operator copies each to its side's hosts), and the KV wire
between nodes (the launcher writes `transfer-receive.keys` and `transfer-send.keys` into its private run
folder). Each file holds its side's keypair and the public keys of the other side. A CURVE server lets
in only those keys (a ZAP handler on its context: CURVE alone admits any client that made up a keypair);
a client pins the server's key, so it never talks to an impostor.

Files are 0600 and created new: one somebody placed first is an error, never overwritten or trusted. Only
paths go on command lines (readable by every user through /proc); a secret key is never logged.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator


class CurveUnavailableError(RuntimeError):
    """This libzmq has no CURVE (no libsodium): a wire between hosts cannot be authenticated."""


class ClusterSide(enum.StrEnum):
    """The two ends of the router <-> worker queues over hosts."""

    ROUTER = "router"
    NODE = "node"


class TransferSide(enum.StrEnum):
    """What a worker does on the KV wire between nodes."""

    NONE = "none"  # one node: KV changes owner in place, no TCP socket at all
    SEND = "send"  # the prefill node's workers: connect out to the decode node's receivers
    RECEIVE = "receive"  # a worker started by hand as a decode worker: receives a prefill node's KV
    # Two-node deployments' workers that decode (the decode node's, a prefill node's mixed workers and
    # standbys): receive KV (a prefill's, a migration's) and send it (migrating a request away).
    BOTH = "both"


@dataclass(frozen=True)
class KeyFile:
    """One side's keypair and the other side's public keys (Z85 text, as ZeroMQ takes them): as a server,
    the clients it lets in; as a client, the server it accepts (the first)."""

    side: str
    public: bytes
    secret: bytes = field(repr=False)  # (never in a log line or a traceback)
    peers: tuple[bytes, ...] = ()

    def to_json(self) -> str:
        return json.dumps(
            {
                "side": str(self.side),
                "public": self.public.decode(),
                "secret": self.secret.decode(),
                "peers": [p.decode() for p in self.peers],
            }
        )

    @classmethod
    def load(cls, path: str | Path, side: str | None = None) -> KeyFile:
        """The keys in `path`; ValueError when malformed, or another side's than `side` (when given)."""
        try:
            d = json.loads(Path(path).read_text())
            peers = d["peers"] if "peers" in d else [d["peer"]]  # (cluster key files before 2026-12-05)
            keys = cls(d["side"], d["public"].encode(), d["secret"].encode(), tuple(p.encode() for p in peers))
        except (OSError, KeyError, ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}: not a key file ({exc})") from None
        if side is not None and keys.side != side:
            raise ValueError(f"{path} holds the {keys.side}'s keys; the {side} needs {side}.keys")
        if not keys.peers or not all(len(k) == 40 for k in (keys.public, keys.secret, *keys.peers)):
            raise ValueError(f"{path}: a key is missing or not 40 Z85 characters")
        return keys

    def expect(self, side: str) -> KeyFile:
        """Itself, when it is `side`'s; else ValueError (a receiver handed the sender's keys, say)."""
        if self.side != side:
            raise ValueError(f"the {side} side's keys are needed, got the {self.side} side's")
        return self


def require_curve() -> None:
    if not zmq.has("curve"):
        raise CurveUnavailableError(
            f"libzmq {zmq.zmq_version()} has no CURVE: a wire between hosts cannot be authenticated"
            " (install a pyzmq wheel, which bundles libsodium, or turn CURVE off on a trusted network)"
        )


def write_pair(directory: str | Path, sides: tuple[str, str], file_name: str) -> dict[str, Path]:
    """A new keypair for each of two sides, each file pinning the other's public key, written as
    `file_name.format(side=...)` in `directory` (made 0700 when missing; files 0600, created new)."""
    require_curve()
    a, b = zmq.curve_keypair(), zmq.curve_keypair()
    files = {sides[0]: KeyFile(sides[0], *a, peers=(b[0],)), sides[1]: KeyFile(sides[1], *b, peers=(a[0],))}
    Path(directory).mkdir(mode=0o700, parents=True, exist_ok=True)
    paths = {}
    for side, keys in files.items():
        path = paths[side] = Path(directory) / file_name.format(side=side)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(keys.to_json())
    return paths


def write_cluster_keys(directory: str | Path) -> dict[str, Path]:
    """The router's and the nodes' key files of a deployment over hosts: `router.keys`, `node.keys`."""
    return write_pair(directory, (ClusterSide.ROUTER, ClusterSide.NODE), "{side}.keys")


def write_deployment_keys(directory: Path) -> dict[str, Path]:
    """The KV wire's key files: every receiver's (`transfer-receive.keys`), every sender's (`-send`)."""
    return write_pair(directory, (TransferSide.RECEIVE, TransferSide.SEND), "transfer-{side}.keys")


class AllowedKeys:
    """The ZAP handler's question "may this client key in?", answered from a key file's peers."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def guard(ctx: zmq.Context, allowed: Sequence[bytes]) -> ThreadAuthenticator:
    """Start `ctx`'s ZAP handler, letting in only `allowed` client keys; before any socket binds (a CURVE
    server on a context without a handler admits every client). An asyncio context is guarded through a
    plain shadow of it (the handler runs on a thread). The caller stops it."""
    require_curve()
    plain = zmq.Context.shadow(ctx.underlying) if type(ctx) is not zmq.Context else ctx
    auth = ThreadAuthenticator(plain)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=AllowedKeys(allowed))
    return auth


def as_server(sock: zmq.Socket, keys: KeyFile) -> None:
    """Before `bind`: encrypt with this side's keypair; who connects is the ZAP handler's question."""
    sock.curve_server = True
    sock.curve_publickey, sock.curve_secretkey = keys.public, keys.secret


def as_client(sock: zmq.Socket, keys: KeyFile) -> None:
    """Before `connect`: authenticate with this side's keypair, accept only the pinned server."""
    sock.curve_serverkey = keys.peers[0]
    sock.curve_publickey, sock.curve_secretkey = keys.public, keys.secret
