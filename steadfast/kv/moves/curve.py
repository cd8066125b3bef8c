"""Who may talk to a KV receiver: ZeroMQ CURVE keys for the transfer wire between nodes.

One deployment has one server keypair (every receiver of the decode node) and one client keypair (every
sender of the prefill node). The launcher makes both once (`write_deployment_keys`) into two 0600 files of
its private run directory and hands each worker the path of its side's file, never a key on a command line
(command lines are readable by every user through /proc). A receiver serves CURVE and lets in only the
deployment's client public key (a ZAP handler on its own context: CURVE alone admits any client that made up
a keypair); a sender pins the server's public key, so it never streams KV to an impostor.

This module owns the keys and the socket options that use them. It must never log or put a secret key
anywhere but its file and the socket.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator


class CurveUnavailableError(RuntimeError):
    """This libzmq has no CURVE (no libsodium): the transfer wire cannot be authenticated."""


class TransferSide(enum.StrEnum):
    """What a worker does on the KV wire between nodes."""

    NONE = "none"  # one node: KV changes owner in place, no TCP socket at all
    SEND = "send"  # the prefill node's workers: connect out to the decode node's receivers
    RECEIVE = "receive"  # a worker started by hand as a decode worker: receives a prefill node's KV
    # Two-node deployments' workers that decode (the decode node's, a prefill node's mixed workers and
    # standbys): receive KV (a prefill's, a migration's) and send it (migrating a request away).
    BOTH = "both"


@dataclass(frozen=True)
class CurveKeys:
    """One side's keys (raw Z85 text, as ZeroMQ takes them)."""

    side: TransferSide
    public: bytes
    secret: bytes
    peers: tuple[bytes, ...]  # RECEIVE: the client public keys let in; SEND: the server's public key

    def to_json(self) -> str:
        peers = [p.decode() for p in self.peers]
        return json.dumps(
            {"side": self.side, "public": self.public.decode(), "secret": self.secret.decode(), "peers": peers}
        )

    @classmethod
    def load(cls, path: str | Path) -> CurveKeys:
        d = json.loads(Path(path).read_text())
        peers = tuple(p.encode() for p in d["peers"])
        keys = cls(TransferSide(d["side"]), d["public"].encode(), d["secret"].encode(), peers)
        if keys.side is TransferSide.NONE or not keys.peers:
            raise ValueError(f"{path}: not a sender's or a receiver's keys")
        return keys


def require_curve() -> None:
    if not zmq.has("curve"):
        raise CurveUnavailableError(
            f"libzmq {zmq.zmq_version()} has no CURVE: the KV wire between nodes cannot be authenticated"
            " (install a pyzmq wheel, which bundles libsodium, or set transfer.curve: false on a trusted network)"
        )


def write_deployment_keys(directory: Path) -> dict[TransferSide, Path]:
    """A new server and client keypair, written as the receivers' and the senders' key files (0600, created
    new: a file somebody placed there first is an error, not something to trust)."""
    require_curve()
    server, client = zmq.curve_keypair(), zmq.curve_keypair()
    files = {
        TransferSide.RECEIVE: CurveKeys(TransferSide.RECEIVE, *server, peers=(client[0],)),
        TransferSide.SEND: CurveKeys(TransferSide.SEND, *client, peers=(server[0],)),
    }
    paths = {}
    for side, keys in files.items():
        path = paths[side] = directory / f"transfer-{side}.keys"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(keys.to_json())
    return paths


class AllowedKeys:
    """The ZAP handler's question "may this client key in?", answered from the deployment's keys."""

    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self.keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def serve(ctx: zmq.Context, keys: CurveKeys) -> ThreadAuthenticator:
    """Start the ZAP handler of `ctx` letting in only `keys.peers`; start it before any socket binds, since
    a CURVE server whose context has no handler admits every client. The caller stops it."""
    require_curve()
    if keys.side is not TransferSide.RECEIVE:
        raise ValueError(f"a receiver needs the receiving side's keys, got the {keys.side} side's")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=AllowedKeys(keys.peers))
    return auth


def as_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    sock.curve_server = True
    sock.curve_publickey, sock.curve_secretkey = keys.public, keys.secret


def as_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Before `connect`: the socket authenticates with the client keypair and accepts only the server key."""
    if keys.side is not TransferSide.SEND:
        raise ValueError(f"a sender needs the sending side's keys, got the {keys.side} side's")
    sock.curve_serverkey = keys.peers[0]
    sock.curve_publickey, sock.curve_secretkey = keys.public, keys.secret
