"""Process plumbing shared by every Steadfast process: typed ZeroMQ queues and parent-death notice."""

from __future__ import annotations

import ctypes
import datetime
import json
import logging
import os
import signal
import sys

import msgspec
import zmq

from steadfast import env, protocol
from steadfast.cluster_keys import ClusterKeys, as_client, as_server

_PR_SET_PDEATHSIG = 1
# Largest router → worker message taken (a request's prompt ids are its bulk): a peer past it is cut off.
MAX_MESSAGE_BYTES = 64 * 2**20


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies, so no orphan keeps serving."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            logging.getLogger(__name__).warning("prctl unavailable: children may outlive the supervisor")
    if os.getppid() == 1:  # the parent is already gone
        os.kill(os.getpid(), signal.SIGTERM)


def about(request_id: str) -> dict[str, str]:
    """A log call's `extra` for a line about one request: JSON logs carry its id as a field, the same id
    in the router's, the workers' and the pools' lines."""
    return {"request_id": request_id}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), process (router, worker3, kvpool…), pid, level,
    logger, message, and `request_id` when the line is about one request; `exc` with a traceback."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "process": self.process,
            "pid": record.process,
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if rid := getattr(record, "request_id", None):
            line["request_id"] = rid
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def setup_logging(name: str) -> None:
    """Logging of one process named `name`: text lines, or JSON lines with STEADFAST_LOG_FORMAT=json (every
    process of a deployment inherits it from `steadfast serve --log-format json`)."""
    handler = logging.StreamHandler()
    if env.log_format() == "json":
        handler.setFormatter(JsonFormatter(name))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {name}[%(process)d] %(levelname)s %(name)s: %(message)s"))
    # force: a worker forked by the zygote replaces the zygote's handler (its name)
    logging.basicConfig(level=env.log_level(), handlers=[handler], force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (a line per request to etcd, otherwise)


class WorkerInbox:
    """The worker's end of router → worker messages (PULL, bound by the worker)."""

    def __init__(self, ctx: zmq.Context, address: str, keys: ClusterKeys | None = None) -> None:
        """`keys`: a node part's (the router connects over TCP; `ctx` guarded by `cluster_keys.guard`)."""
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if keys is not None:
            as_server(self.sock, keys)
        self.sock.bind(address)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms))

    def drain(self) -> list[protocol.ToWorker]:
        messages = []
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            try:
                messages.append(protocol.decode_to_worker(data))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                # Only this user can reach the socket (it lives in the launcher's private run
                # folder), but a bad message must still never take the worker's requests down.
                logging.getLogger(__name__).error("dropped a malformed message to the worker: %s", exc)


class WorkerOutbox:
    """The worker's end of worker → router messages (PUSH, connected to the router)."""

    def __init__(self, ctx: zmq.Context, address: str, keys: ClusterKeys | None = None) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 1000)
        if keys is not None:
            as_client(self.sock, keys)
        self.sock.connect(address)

    def send(self, message: msgspec.Struct) -> None:
        self.sock.send(protocol.encode(message))
