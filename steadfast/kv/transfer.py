"""KV transfer between nodes: a prefill worker streams a request's K/V, layer by layer while its prompt
is still being computed, into blocks the decode worker's node granted for it.

Wire (ZeroMQ DEALER → ROUTER over TCP; msgspec structs, never pickle): `KVChunk`s, each one layer's K and
V for a span of token positions with an xxh3-64 checksum; then a `KVCommit` listing every span sent.
The receiver answers `KVAck`: complete (with the block ids that now hold the KV), or the chunks still
missing or corrupt, which the sender resends. Each attempt waits `timeout_s`; attempts back off
exponentially; after `retries` the next path (an alternate address of the same receiver) is tried; when
every path failed the caller falls back to recomputing the prompt on the decode side.

The transport is the only part that knows about ZeroMQ (`ZmqPath`); another (NIXL, RDMA) replaces it.
`TransportFaults` is the switch fault tests use to delay, drop, corrupt or stall chunks on one path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch
import xxhash
import zmq

from steadfast.kv.arena import KVArena

log = logging.getLogger(__name__)


class KVChunk(msgspec.Struct, tag="chunk", array_like=True):
    request_id: str
    attempt: int  # a new attempt (another path) starts clean: older chunks are ignored
    layer: int
    start: int  # first token position
    count: int
    num_tokens: int  # tokens of KV the whole transfer carries
    checksum: int  # xxh3-64 of data
    data: bytes  # [2 (K, V), kv_heads, count, head_dim] in the arena dtype


class KVCommit(msgspec.Struct, tag="commit", array_like=True):
    request_id: str
    attempt: int
    num_tokens: int
    num_layers: int
    spans: list[tuple[int, int]]  # (start, count) of every span, each sent for every layer


class KVAbort(msgspec.Struct, tag="abort", array_like=True):
    """The sender gives the transfer up: the receiver frees what it granted for it."""

    request_id: str


class KVAck(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    attempt: int
    ok: bool
    block_ids: list[int] = []
    missing: list[tuple[int, int]] = []  # (layer, start) to send again
    error: str = ""


CLAIM_TIMEOUT_S = 30.0  # a completed transfer nobody claimed this long is given back to the pool

_to_receiver = msgspec.msgpack.Decoder(KVChunk | KVCommit | KVAbort)
_ack = msgspec.msgpack.Decoder(KVAck)
_encoder = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class TransportFaults:
    """Faults injected on the sending side of one path (tests, chaos drills). `every`: which chunks
    (1 = all, 3 = every third). A stalled chunk holds the path for `stall_s` first."""

    delay_s: float = 0.0
    drop_every: int = 0
    corrupt_every: int = 0
    stall_every: int = 0
    stall_s: float = 0.0
    path: str = "primary"  # the path they apply to; "*" for every path

    @classmethod
    def from_env(cls) -> TransportFaults | None:
        """`STEADFAST_TRANSFER_FAULTS='drop_every=2,path=primary'`, or the same text in the file named
        by `STEADFAST_TRANSFER_FAULTS_FILE` (read again for every transfer: a drill can change it
        while the server runs); None when neither is set."""
        spec = os.environ.get("STEADFAST_TRANSFER_FAULTS", "")
        where = os.environ.get("STEADFAST_TRANSFER_FAULTS_FILE", "")
        if where:
            try:
                with open(where) as f:
                    spec = f.read().strip()
            except FileNotFoundError:
                spec = ""
        if not spec:
            return None
        values: dict[str, object] = {}
        for item in spec.split(","):
            key, _, value = item.partition("=")
            kind = cls.__dataclass_fields__[key.strip()].type
            values[key.strip()] = value.strip() if kind == "str" else (float if "float" in kind else int)(value)
        return cls(**values)  # type: ignore[arg-type]


def layer_span(arena: KVArena, layer: int, slots: torch.Tensor) -> bytes:
    """One layer's K and V at arena `slots` (block * block_size + offset), packed contiguous."""
    kv = arena.tensor[layer]  # [2, kv_heads, blocks, block_size, dim]
    two, heads, blocks, bs, dim = kv.shape
    data = kv.reshape(two, heads, blocks * bs, dim).index_select(2, slots.to(kv.device)).cpu()
    return data.view(torch.uint8).numpy().tobytes()


def write_span(arena: KVArena, layer: int, slots: torch.Tensor, data: bytes) -> None:
    kv = arena.tensor[layer]
    two, heads, blocks, bs, dim = kv.shape
    src = torch.frombuffer(bytearray(data), dtype=kv.dtype).view(two, heads, len(slots), dim)
    kv.view(two, heads, blocks * bs, dim).index_copy_(2, slots.to(kv.device), src.to(kv.device))


def slots_for(block_ids: list[int], block_size: int, start: int, count: int) -> torch.Tensor:
    return torch.tensor(
        [block_ids[p // block_size] * block_size + p % block_size for p in range(start, start + count)],
        dtype=torch.long,
    )


class PathDownError(ConnectionError):
    """A transport path cannot take data now (no peer connected, or it stopped reading)."""


class ZmqPath:
    """One transport path to a receiver: a DEALER socket to its ROUTER address."""

    def __init__(self, ctx: zmq.Context, name: str, address: str, send_timeout_s: float) -> None:
        self.name, self.address = name, address
        self.faults: TransportFaults | None = None  # set by the sender for each transfer
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # Nothing queued for a peer that is not connected, and no send waits long: a dead receiver
        # must fail the attempt (PathDownError), never hang the sender.
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.setsockopt(zmq.SNDTIMEO, max(1, int(send_timeout_s * 1000)))
        self.sock.connect(address)
        self.sent = 0

    def _send(self, data: bytes) -> None:
        try:
            self.sock.send(data, copy=False)
        except zmq.Again as exc:
            raise PathDownError(f"{self.name} path to {self.address} is not taking data") from exc

    def send_chunk(self, chunk: KVChunk) -> int:
        """Send one chunk (through the fault switch); returns the bytes put on the wire."""
        self.sent += 1
        f = self.faults
        if f is not None:
            if f.delay_s:
                time.sleep(f.delay_s)
            if f.stall_every and self.sent % f.stall_every == 0:
                time.sleep(f.stall_s)
            if f.drop_every and self.sent % f.drop_every == 0:
                return 0
            if f.corrupt_every and self.sent % f.corrupt_every == 0:
                flipped = bytearray(chunk.data)
                flipped[len(flipped) // 2] ^= 0xFF
                chunk = msgspec.structs.replace(chunk, data=bytes(flipped))
        self._send(_encoder.encode(chunk))
        return len(chunk.data)

    def send(self, msg: KVCommit | KVAbort) -> None:
        self._send(_encoder.encode(msg))

    def wait_ack(self, request_id: str, attempt: int, timeout_s: float) -> KVAck | None:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                return None
            ack = _ack.decode(self.sock.recv())
            if ack.request_id == request_id and ack.attempt == attempt:
                return ack
        return None

    def close(self) -> None:
        self.sock.close(linger=0)


@dataclass
class TransferResult:
    request_id: str
    ok: bool
    block_ids: list[int] = field(default_factory=list)
    path: str = ""  # the path that delivered it
    retries: int = 0  # attempts beyond the first
    fallbacks: int = 0  # paths given up on
    bytes: int = 0
    seconds: float = 0.0  # commit → acknowledged
    error: str = ""
    stream_seconds: float = 0.0  # first chunk sent → acknowledged


@dataclass
class _Outgoing:
    request_id: str
    addresses: list[tuple[str, str]]  # (path name, address), in fallback order
    num_tokens: int
    chunks: dict[tuple[int, int], tuple[int, bytes]] = field(default_factory=dict)  # (layer, start) -> count, data
    streamed: set[tuple[int, int]] = field(default_factory=set)  # sent on the first path during prefill
    bytes: int = 0
    t_commit: float = 0.0
    t_first: float = 0.0  # when the first chunk went out


class KVSender:
    """The prefill side. The engine thread copies each layer's K/V out of the arena as soon as the
    forward pass wrote it (a small gather; the bytes then stay valid whatever happens to the blocks)
    and queues it; one thread checksums and sends, so the forward pass never waits on the network.
    The bytes are kept until the transfer ends, for resends. Results come back through `results()`."""

    def __init__(
        self,
        num_layers: int,
        timeout_s: float,
        retries: int,
        backoff_s: float,
        faults: Callable[[], TransportFaults | None] = lambda: None,
    ) -> None:
        """`faults`: the fault switch, asked again at the start of every transfer."""
        self.num_layers = num_layers
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.fault_source = faults
        self.faults: TransportFaults | None = None
        self.ctx = zmq.Context.instance()
        self._jobs: queue.Queue[tuple[str, tuple]] = queue.Queue()
        self._results: queue.Queue[TransferResult] = queue.Queue()
        self._out: dict[str, _Outgoing] = {}
        self._paths: dict[tuple[str, str], ZmqPath] = {}
        self.pending = 0  # transfers begun and not yet reported (engine thread's count)
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    # --- engine thread ---------------------------------------------------------------------------
    def begin(self, request_id: str, addresses: list[tuple[str, str]], num_tokens: int) -> None:
        self.pending += 1
        self._jobs.put(("begin", (request_id, addresses, num_tokens)))

    def layer(self, request_id: str, layer: int, start: int, count: int, data: bytes, stream: bool) -> None:
        """One layer's K/V of `count` tokens from `start`; `stream`: send it now (layer-wise), else
        keep it for the commit (send-after-prefill)."""
        self._jobs.put(("layer", (request_id, layer, start, count, data, stream)))

    def commit(self, request_id: str) -> None:
        """Every token's KV has been given: send what is left, then the commit, and wait for the ack."""
        self._jobs.put(("commit", (request_id,)))

    def abort(self, request_id: str) -> None:
        self._jobs.put(("abort", (request_id,)))

    def results(self) -> list[TransferResult]:
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                self.pending -= len(out)
                return out

    def close(self) -> None:
        self._jobs.put(("stop", ()))
        self._thread.join(timeout=5)
        for path in self._paths.values():
            path.close()

    # --- sender thread ---------------------------------------------------------------------------
    def _path(self, name: str, address: str) -> ZmqPath:
        key = (name, address)
        if key not in self._paths:
            self._paths[key] = ZmqPath(self.ctx, name, address, self.timeout_s)
        path = self._paths[key]
        f = self.faults
        path.faults = f if f is not None and f.path in (name, "*") else None
        return path

    def _run(self) -> None:
        while True:
            kind, args = self._jobs.get()
            try:
                if kind == "stop":
                    return
                if kind == "begin":
                    rid, addresses, num_tokens = args
                    self._out[rid] = _Outgoing(rid, addresses, num_tokens)
                    self.faults = self.fault_source()
                    if self.faults is not None:  # a drill: say so, so nobody mistakes it for a real fault
                        log.warning("KV transfer of %s: fault switch armed: %s", rid, self.faults)
                elif kind == "layer":
                    self._layer(*args)
                elif kind == "commit":
                    self._commit(*args)
                elif kind == "abort":
                    out = self._out.pop(args[0], None)
                    if out is not None:
                        with contextlib.suppress(PathDownError):
                            self._path(*out.addresses[0]).send(KVAbort(out.request_id))
                        self._results.put(TransferResult(out.request_id, False, error="aborted"))
            except Exception as exc:  # a broken transfer must end in a result, never hang its request
                rid = args[0] if args else ""
                log.exception("KV transfer of %s failed", rid)
                if self._out.pop(rid, None) is not None:
                    self._results.put(TransferResult(rid, False, error=f"sender error: {exc}"))

    def _send(self, path: ZmqPath, out: _Outgoing, attempt: int, key: tuple[int, int]) -> None:
        count, data = out.chunks[key]
        layer, start = key
        chunk = KVChunk(
            out.request_id, attempt, layer, start, count, out.num_tokens, xxhash.xxh3_64_intdigest(data), data
        )
        out.bytes += path.send_chunk(chunk)
        out.t_first = out.t_first or time.perf_counter()

    def _layer(self, rid: str, layer: int, start: int, count: int, data: bytes, stream: bool) -> None:
        out = self._out.get(rid)
        if out is None:
            return
        out.chunks[(layer, start)] = (count, data)
        if stream:
            try:
                self._send(self._path(*out.addresses[0]), out, 0, (layer, start))
            except PathDownError:
                return  # not streamed: the commit sends it (or finds the path down then)
            out.streamed.add((layer, start))

    def _commit(self, rid: str) -> None:
        out = self._out.pop(rid, None)
        if out is None:
            return
        out.t_commit = time.perf_counter()
        spans = sorted({(start, count) for (_, start), (count, _) in out.chunks.items()})
        retries = fallbacks = 0
        errors: list[str] = []
        for attempt, (name, address) in enumerate(out.addresses):
            path = self._path(name, address)
            # What the first path streamed during prefill is not sent again unless found missing.
            todo = [k for k in sorted(out.chunks) if attempt or k not in out.streamed]
            for tries in range(self.retries + 1):
                try:
                    for key in todo:
                        self._send(path, out, attempt, key)
                    path.send(KVCommit(rid, attempt, out.num_tokens, self.num_layers, spans))
                    ack = path.wait_ack(rid, attempt, self.timeout_s)
                except PathDownError as exc:
                    errors.append(str(exc))
                    ack, todo = None, sorted(out.chunks)
                    if tries < self.retries:
                        retries += 1
                        time.sleep(self.backoff_s * 2**tries)
                    continue
                if ack is not None and ack.ok:
                    now = time.perf_counter()
                    result = TransferResult(rid, True, ack.block_ids, name, retries, fallbacks, out.bytes)
                    result.seconds, result.stream_seconds = now - out.t_commit, now - (out.t_first or out.t_commit)
                    self._results.put(result)
                    return
                if ack is not None and ack.error:
                    errors.append(f"{name}: {ack.error}")
                    break  # the receiver refused the transfer itself (no room): retrying cannot help
                todo = [(layer, start) for layer, start in ack.missing] if ack is not None else sorted(out.chunks)
                errors.append(f"{name}: " + ("no answer" if ack is None else f"{len(todo)} chunks missing or corrupt"))
                if tries < self.retries:
                    retries += 1
                    time.sleep(self.backoff_s * 2**tries)
            with contextlib.suppress(PathDownError):
                path.send(KVAbort(rid))
            fallbacks += 1
        seconds = time.perf_counter() - out.t_commit
        error = "every path failed: " + "; ".join(errors[-3:])
        self._results.put(TransferResult(rid, False, [], "", retries, fallbacks, out.bytes, seconds, error))


@dataclass
class _Incoming:
    request_id: str
    attempt: int
    num_tokens: int
    block_ids: list[int]
    got: set[tuple[int, int]] = field(default_factory=set)  # (layer, start) written and verified
    bad: set[tuple[int, int]] = field(default_factory=set)
    last: float = field(default_factory=time.monotonic)
    done: bool = False


class KVReceiver:
    """The decode side: one thread binds `address`, takes blocks for each incoming transfer from the
    node's pool (`grant`), writes verified chunks into them and acknowledges a complete commit. The
    engine thread `claim`s a completed transfer's blocks; blocks of a transfer that stalls, is aborted
    or never claimed within `timeout_s` are given back (`release`): nothing leaks."""

    def __init__(
        self,
        arena: KVArena,
        block_size: int,
        addresses: list[str],
        grant: Callable[[int], list[int]],
        release: Callable[[list[int]], None],
        timeout_s: float,
        lease_check: Callable[[], None] = lambda: None,
    ) -> None:
        """`addresses`: one per path (`tcp://host:0` takes a free port). `lease_check` raises unless
        this worker's lease is surely valid: no byte is written without."""
        self.arena, self.block_size = arena, block_size
        self.lease_check = lease_check
        self.grant, self.release, self.timeout_s = grant, release, timeout_s
        self.ctx = zmq.Context.instance()
        self.socks: list[zmq.Socket] = []
        self.addresses: list[str] = []
        for address in addresses:
            sock = self.ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            if address.endswith(":0"):
                host = address.rsplit(":", 1)[0]
                address = f"{host}:{sock.bind_to_random_port(host)}"
            else:
                sock.bind(address)
            self.socks.append(sock)
            self.addresses.append(address)
        self._lock = threading.Lock()
        self._incoming: dict[str, _Incoming] = {}
        self._stop = False
        self.received_bytes = 0
        self.corrupt_chunks = 0
        self._thread = threading.Thread(target=self._run, name="kv-receiver", daemon=True)
        self._thread.start()

    def claim(self, request_id: str) -> list[int] | None:
        """The blocks of a completed transfer, now the engine's; None if there is none (expired)."""
        with self._lock:
            t = self._incoming.get(request_id)
            if t is None or not t.done:
                return None
            del self._incoming[request_id]
            return t.block_ids

    def close(self) -> None:
        """Stop; blocks of transfers nobody claimed go back to the pool."""
        self._stop = True
        self._thread.join(timeout=5)
        for sock in self.socks:
            sock.close(linger=0)
        with self._lock:
            for rid in list(self._incoming):
                self._drop(rid)

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self.socks:
            poller.register(sock, zmq.POLLIN)
        while not self._stop:
            for sock, _ in poller.poll(100):
                peer, data = sock.recv_multipart()
                try:
                    reply = self._handle(_to_receiver.decode(data))
                except Exception as exc:  # one bad message must not stop the receiver
                    log.exception("bad KV transfer message")
                    reply = None
                    self.corrupt_chunks += isinstance(exc, msgspec.DecodeError)
                if reply is not None:
                    sock.send_multipart([peer, _encoder.encode(reply)])
            self._expire()

    def _handle(self, msg: KVChunk | KVCommit | KVAbort) -> KVAck | None:
        with self._lock:
            if isinstance(msg, KVAbort):
                self._drop(msg.request_id)
                return None
            t = self._incoming.get(msg.request_id)
            if t is not None and msg.attempt > t.attempt and not t.done:
                t.attempt, t.got, t.bad = msg.attempt, set(), set()  # a new path: start clean, same blocks
            if t is None:
                need = -(-msg.num_tokens // self.block_size)
                blocks = self.grant(need)
                if len(blocks) < need:
                    self.release(blocks)
                    if isinstance(msg, KVCommit):
                        return KVAck(msg.request_id, msg.attempt, False, error=f"no room for {need} KV blocks")
                    return None
                t = self._incoming[msg.request_id] = _Incoming(msg.request_id, msg.attempt, msg.num_tokens, blocks)
            t.last = time.monotonic()
            if msg.attempt != t.attempt:
                return None  # a straggler of an attempt given up on
            if isinstance(msg, KVChunk):
                self.lease_check()
                self._write(t, msg)
                return None
            expected = {(layer, start) for start, _ in msg.spans for layer in range(msg.num_layers)}
            missing = sorted(expected - t.got)
            if missing:
                return KVAck(msg.request_id, msg.attempt, False, missing=missing)
            t.done = True
            return KVAck(msg.request_id, msg.attempt, True, block_ids=t.block_ids)

    def _write(self, t: _Incoming, chunk: KVChunk) -> None:
        key = (chunk.layer, chunk.start)
        if xxhash.xxh3_64_intdigest(chunk.data) != chunk.checksum:
            self.corrupt_chunks += 1
            t.bad.add(key)
            t.got.discard(key)
            return
        write_span(
            self.arena, chunk.layer, slots_for(t.block_ids, self.block_size, chunk.start, chunk.count), chunk.data
        )
        self.received_bytes += len(chunk.data)
        t.got.add(key)
        t.bad.discard(key)

    def _drop(self, request_id: str) -> None:
        t = self._incoming.pop(request_id, None)
        if t is not None:
            self.release(t.block_ids)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            # A transfer in progress that went quiet is given up soon; a complete one waits longer for
            # the engine to claim it (the router sends the request on after the prefill side hears).
            stale = [
                rid
                for rid, t in self._incoming.items()
                if now - t.last > (max(CLAIM_TIMEOUT_S, 4 * self.timeout_s) if t.done else 2 * self.timeout_s)
            ]
            for rid in stale:
                log.warning("KV transfer of %s expired; its blocks go back to the pool", rid)
                self._drop(rid)
