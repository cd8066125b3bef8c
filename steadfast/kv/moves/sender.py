"""The prefill side of a KV transfer between nodes: `KVSender` streams a request's K/V, layer by layer
while its prompt is still being computed, to the receiver of the decode worker's node.

Each attempt waits `timeout_s` for the receiver's ack; missing or corrupt chunks are resent, attempts
back off by one `RetryPolicy`; after its retries the next path (an alternate address of the same
receiver) is tried; when every path failed the result says so and the caller falls back (recomputing
the prompt on the decode side). Every transfer ends in exactly one `TransferResult`.

This module owns the ordering of sends, resends and fallbacks. It must never touch the arena (the engine
copies the bytes out before handing them over), block the engine thread, or know a wire format or a
socket beyond the `Transport` interface.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import xxhash
import zmq

from steadfast.kv.moves.faults import FaultSwitch, FaultyPath, TransportFaults
from steadfast.kv.moves.retry import RetryPolicy
from steadfast.kv.moves.transport import PathDownError, Transport, ZmqPath
from steadfast.kv.moves.wire import KVAbort, KVChunk, KVCommit

log = logging.getLogger(__name__)


class TransferOutcome(enum.Enum):
    OK = "ok"
    ABORTED = "aborted"  # the caller gave it up (its request ended first): nothing to fall back from
    FAILED = "failed"  # every path failed, or the sender broke: the caller falls back


@dataclass
class TransferResult:
    request_id: str
    outcome: TransferOutcome
    block_ids: list[int] = field(default_factory=list)
    path: str = ""  # the path that delivered it
    retries: int = 0  # attempts beyond the first
    fallbacks: int = 0  # paths given up on
    bytes: int = 0
    seconds: float = 0.0  # commit → acknowledged
    error: str = ""
    stream_seconds: float = 0.0  # first chunk sent → acknowledged

    @property
    def ok(self) -> bool:
        return self.outcome is TransferOutcome.OK


# --- jobs the engine thread queues for the sender thread ---------------------------------------------
@dataclass(frozen=True)
class _Begin:
    request_id: str
    addresses: list[tuple[str, str]]
    num_tokens: int


@dataclass(frozen=True)
class _Layer:
    request_id: str
    layer: int
    start: int
    count: int
    data: bytes
    stream: bool


@dataclass(frozen=True)
class _Commit:
    request_id: str


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Stop:
    pass


_Job = _Begin | _Layer | _Commit | _Abort | _Stop


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
        faults: FaultSwitch | None = None,
    ) -> None:
        """`faults`: the fault switch, asked again at the start of every transfer; None: no drills
        (paths are never wrapped)."""
        self.num_layers = num_layers
        self.timeout_s = timeout_s
        self.retry = RetryPolicy(retries, backoff_s)
        self.fault_source = faults
        self.faults: TransportFaults | None = None
        self.ctx = zmq.Context.instance()
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self._results: queue.Queue[TransferResult] = queue.Queue()
        self._out: dict[str, _Outgoing] = {}
        self._paths: dict[tuple[str, str], Transport] = {}
        self.pending = 0  # transfers begun and not yet reported (engine thread's count)
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    # --- engine thread ---------------------------------------------------------------------------
    def begin(self, request_id: str, addresses: list[tuple[str, str]], num_tokens: int) -> None:
        self.pending += 1
        self._jobs.put(_Begin(request_id, addresses, num_tokens))

    def layer(self, request_id: str, layer: int, start: int, count: int, data: bytes, stream: bool) -> None:
        """One layer's K/V of `count` tokens from `start`; `stream`: send it now (layer-wise), else
        keep it for the commit (send-after-prefill)."""
        self._jobs.put(_Layer(request_id, layer, start, count, data, stream))

    def commit(self, request_id: str) -> None:
        """Every token's KV has been given: send what is left, then the commit, and wait for the ack."""
        self._jobs.put(_Commit(request_id))

    def abort(self, request_id: str) -> None:
        self._jobs.put(_Abort(request_id))

    def results(self) -> list[TransferResult]:
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                self.pending -= len(out)
                return out

    def close(self) -> None:
        self._jobs.put(_Stop())
        self._thread.join(timeout=5)
        for path in self._paths.values():
            path.close()

    # --- sender thread ---------------------------------------------------------------------------
    def _path(self, name: str, address: str) -> Transport:
        key = (name, address)
        if key not in self._paths:
            path: Transport = ZmqPath(self.ctx, name, address, self.timeout_s)
            self._paths[key] = FaultyPath(path) if self.fault_source is not None else path
        path = self._paths[key]
        if isinstance(path, FaultyPath):
            path.arm(self.faults)
        return path

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if isinstance(job, _Stop):
                return
            try:
                match job:
                    case _Begin():
                        self._begin(job)
                    case _Layer():
                        self._layer(job)
                    case _Commit():
                        self._commit(job.request_id)
                    case _Abort():
                        self._abort(job.request_id)
            except Exception as exc:  # a broken transfer must end in a result, never hang its request
                rid = job.request_id
                log.exception("KV transfer of %s failed", rid)
                if self._out.pop(rid, None) is not None:
                    self._results.put(TransferResult(rid, TransferOutcome.FAILED, error=f"sender error: {exc}"))

    def _begin(self, job: _Begin) -> None:
        self._out[job.request_id] = _Outgoing(job.request_id, job.addresses, job.num_tokens)
        self.faults = self.fault_source() if self.fault_source is not None else None
        if self.faults is not None:  # a drill: say so, so nobody mistakes it for a real fault
            log.warning("KV transfer of %s: fault switch armed: %s", job.request_id, self.faults)

    def _abort(self, rid: str) -> None:
        out = self._out.pop(rid, None)
        if out is not None:
            with contextlib.suppress(PathDownError):
                self._path(*out.addresses[0]).send(KVAbort(out.request_id))
            self._results.put(TransferResult(out.request_id, TransferOutcome.ABORTED, error="aborted"))

    def _send(self, path: Transport, out: _Outgoing, attempt: int, key: tuple[int, int]) -> None:
        count, data = out.chunks[key]
        layer, start = key
        chunk = KVChunk(
            out.request_id, attempt, layer, start, count, out.num_tokens, xxhash.xxh3_64_intdigest(data), data
        )
        out.bytes += path.send_chunk(chunk)
        out.t_first = out.t_first or time.perf_counter()

    def _layer(self, job: _Layer) -> None:
        out = self._out.get(job.request_id)
        if out is None:
            return
        key = (job.layer, job.start)
        out.chunks[key] = (job.count, job.data)
        if job.stream:
            try:
                self._send(self._path(*out.addresses[0]), out, 0, key)
            except PathDownError:
                return  # not streamed: the commit sends it (or finds the path down then)
            out.streamed.add(key)

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
            for tries in self.retry.tries():
                if tries:
                    retries += 1
                try:
                    for key in todo:
                        self._send(path, out, attempt, key)
                    path.send(KVCommit(rid, attempt, out.num_tokens, self.num_layers, spans))
                    ack = path.wait_ack(rid, attempt, self.timeout_s)
                except PathDownError as exc:
                    errors.append(str(exc))
                    todo = sorted(out.chunks)
                    continue
                if ack is not None and ack.ok:
                    now = time.perf_counter()
                    result = TransferResult(rid, TransferOutcome.OK, ack.block_ids, name, retries, fallbacks, out.bytes)
                    result.seconds, result.stream_seconds = now - out.t_commit, now - (out.t_first or out.t_commit)
                    self._results.put(result)
                    return
                if ack is not None and ack.error:
                    errors.append(f"{name}: {ack.error}")
                    break  # the receiver refused the transfer itself (no room): retrying cannot help
                todo = [(layer, start) for layer, start in ack.missing] if ack is not None else sorted(out.chunks)
                errors.append(f"{name}: " + ("no answer" if ack is None else f"{len(todo)} chunks missing or corrupt"))
            with contextlib.suppress(PathDownError):
                path.send(KVAbort(rid))
            fallbacks += 1
        seconds = time.perf_counter() - out.t_commit
        error = "every path failed: " + "; ".join(errors[-3:])
        result = TransferResult(rid, TransferOutcome.FAILED, [], "", retries, fallbacks, out.bytes, seconds, error)
        self._results.put(result)
