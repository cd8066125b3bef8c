"""The source side of a KV move between nodes: `KVSender` streams a request's K/V, layer by layer while
its prompt is still being computed, to the receiver of the decode worker's node.

Each path is one move session (`kv/moves/session.py`, kind TRANSFER), named `<request>/<path index>`:
PREALLOC once the first bytes exist, frames once RESERVED, one final copy stage and COMMIT once the prompt
is done, then the decision asked of the destination node's ledger. Missing or corrupt frames named in an
ack are resent after the backoff of one `RetryPolicy`; no answer in time is the session's own retry and, after
its retries, an ABORT; an aborted session moves on to the next path (an alternate address of the same
receiver); when every path failed the result says so and the caller falls back (recomputing the prompt on
the decode side). Every transfer ends in exactly one `TransferResult`.

This module owns the ordering of sends, resends and fallbacks. It must never touch the arena (the engine
copies the bytes out before handing them over), block the engine thread, or know a wire format or a
socket beyond the `Transport` interface.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Iterable

import xxhash
import zmq

from steadfast.kv.moves.faults import FaultSwitch, FaultyPath, TransportFaults
from steadfast.kv.moves.messages import (
    Abort,
    AbortReason,
    Action,
    Commit,
    CommitAck,
    Copy,
    Decide,
    LetGo,
    MoveKind,
    MoveProtocolError,
    Prealloc,
    Reserved,
    ResumeAtSource,
    Send,
    SourceState,
)
from steadfast.kv.moves.outgoing import Outgoing
from steadfast.kv.moves.retry import RetryPolicy
from steadfast.kv.moves.sender_jobs import (
    AbortJob,
    Batch,
    Begin,
    CommitJob,
    GiveUp,
    Job,
    Layer,
    Stop,
    Touch,
    TransferOutcome,
    TransferResult,
)
from steadfast.kv.moves.session import SourceSession
from steadfast.kv.moves.transport import PathDownError, Transport, ZmqPath
from steadfast.kv.moves.wire import AskDecision, Decision, KVFrame, Probe, Progress, ToSource
from steadfast.wire.curve import KeyFile

log = logging.getLogger(__name__)

TOMBSTONE_S = 60.0  # an ended session is remembered this long, so a late answer to it is recognised


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
        block_size: int = 16,
        keys: KeyFile | None = None,
    ) -> None:
        """`timeout_s`: the first wait for an answer (doubling per retry); `backoff_s`: the first pause
        before resending what an answer said is missing. `block_size`: the destination arena's (the same
        model's arena on every node; the receiver refuses a PREALLOC that disagrees). `faults`: the fault
        switch, asked again at the start of every transfer; None: no drills (paths are never wrapped).
        `keys`: the sending side's CURVE keys (None: unauthenticated paths)."""
        self.num_layers, self.block_size = num_layers, block_size
        self.timeout_s = timeout_s
        self.retries = retries
        self.retry = RetryPolicy(retries, backoff_s)
        self.fault_source = faults
        self.keys = keys
        self.faults: TransportFaults | None = None
        self.ctx = zmq.Context.instance()
        self._jobs: queue.Queue[Job] = queue.Queue()
        self._results: queue.Queue[TransferResult] = queue.Queue()
        self._out: dict[str, Outgoing] = {}
        # Every session by name, with its path and, once ended, until when it is kept as a tombstone.
        self._sessions: dict[str, tuple[SourceSession, tuple[str, str], float]] = {}
        self._paths: dict[tuple[str, str], Transport] = {}
        self.pending = 0  # transfers begun and not yet reported (engine thread's count)
        # Since start, for the health check's transport layer: messages and frames sent, those sent again
        # (a retried PREALLOC/COMMIT/ask, a part the ack named missing), sessions given up for no answer.
        self.sent = self.resent = self.timeouts = 0
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    # --- engine thread ---------------------------------------------------------------------------
    def begin(self, request_id: str, addresses: list[tuple[str, str]], num_tokens: int, probe: bool = False) -> None:
        """`probe`: the destination is asked, as parts go out, how many have landed (`landed`)."""
        self.pending += 1
        self._jobs.put(Begin(request_id, addresses, num_tokens, probe))

    def landed(self, request_id: str, parts: int) -> bool:
        """Whether the destination handled the first `parts` streamed parts of a probing transfer, or
        there is nothing to wait for: a path that refuses data or leaves a probe unanswered for `timeout_s`
        is the COMMIT's business (its timer retries, then the next path). Engine thread: reads only."""
        out = self._out.get(request_id)
        if out is None:
            return True
        unanswered = out.probed > out.landed and time.monotonic() - out.probe_at > self.timeout_s
        return out.landed >= parts or bool(out.problem) or unanswered

    def layer(self, request_id: str, layer: int, start: int, count: int, data: memoryview, stream: bool) -> None:
        """One layer's K/V of `count` tokens from `start`; `stream`: send it now (layer-wise), else
        keep it for the commit (send-after-prefill)."""
        self._jobs.put(Layer(request_id, layer, start, count, data, stream))

    def layers(
        self, request_id: str, start: int, count: int, data: list[memoryview], stream: bool, commit: bool
    ) -> None:
        """`layer` for every layer at once (`data[i]`: layer i's), then `commit` if asked: one hand-over."""
        jobs: list[Layer | CommitJob] = [Layer(request_id, i, start, count, d, stream) for i, d in enumerate(data)]
        self._jobs.put(Batch((*jobs, CommitJob(request_id)) if commit else tuple(jobs)))

    def commit(self, request_id: str) -> None:
        """Every token's KV has been given: send what is left, then the commit, and wait for the ack."""
        self._jobs.put(CommitJob(request_id))

    def abort(self, request_id: str) -> None:
        self._jobs.put(AbortJob(request_id))

    def give_up(self, request_id: str, why: str) -> None:
        """Its destination is gone (the router says so): the transfer fails now, to its fallback."""
        self._jobs.put(GiveUp(request_id, why))

    def touch(self, request_ids: list[str]) -> None:
        """These transfers' requests are still alive here (the engine says so once a step): their
        sessions keep the destination's watchdog away while the prompt computes."""
        if request_ids:
            self._jobs.put(Touch(tuple(request_ids)))

    def results(self) -> list[TransferResult]:
        out: list[TransferResult] = []
        with contextlib.suppress(queue.Empty):
            while True:
                out.append(self._results.get_nowait())
        self.pending -= len(out)
        return out

    def close(self) -> None:
        self._jobs.put(Stop())
        self._thread.join(timeout=5)
        for path in self._paths.values():
            path.close()

    # --- sender thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._wait())
            except queue.Empty:
                job = None
            if isinstance(job, Stop):
                return
            if isinstance(job, Touch):
                for out in filter(None, map(self._out.get, job.request_ids)):
                    out.alive = time.monotonic()
            elif job is not None:
                for j in job.jobs if isinstance(job, Batch) else (job,):
                    self._guard(j.request_id, self._job, j)
            self._poll()

    def _wait(self) -> float | None:
        """How long the thread may sleep on its job queue: briefly while an answer is awaited."""
        waiting = any(o.session is not None and o.session.state is not SourceState.COPYING for o in self._out.values())
        return 0.0005 if waiting else (min(0.2, self.timeout_s / 4) if self._sessions else None)

    def _guard(self, rid: str, fn, *args) -> None:  # noqa: ANN001 - a handler and its arguments
        try:
            fn(*args)
        except Exception as exc:  # a broken transfer must end in a result, never hang its request
            log.exception("KV transfer of %s failed", rid)
            out = self._out.get(rid)
            if out is not None:
                out.errors.append(f"sender error: {exc}")
                self._end(out, TransferOutcome.FAILED)

    def _job(self, job: Begin | Layer | CommitJob | AbortJob | GiveUp) -> None:
        if job.request_id in self._out:
            self._out[job.request_id].alive = time.monotonic()
        match job:
            case Begin():
                n_blocks = -(-job.num_tokens // self.block_size)
                out = Outgoing(job.request_id, job.addresses, job.num_tokens, n_blocks, probe=job.probe)
                self._out[job.request_id] = out
                self.faults = self.fault_source() if self.fault_source is not None else None
                if self.faults is not None:  # a drill: say so, so nobody mistakes it for a real fault
                    log.warning("KV transfer of %s: fault switch armed: %s", job.request_id, self.faults)
            case Layer():
                out = self._out.get(job.request_id)
                if out is None:
                    return
                out.parts.append(job)
                if job.stream:
                    if out.session is None:
                        self._open(out)
                    # Reserved and the path taking data (a part it refused goes at the commit).
                    elif out.session.state is SourceState.COPYING and not out.problem:
                        self._send_parts(out, [len(out.parts) - 1])
            case CommitJob():
                out = self._out.get(job.request_id)
                if out is None:
                    return
                out.commit_wanted, out.t_commit = True, time.perf_counter()
                if out.session is None:
                    self._open(out)
                elif out.session.state is SourceState.COPYING:
                    self._finish(out)
            case AbortJob() | GiveUp():  # the request ended here / its destination is known gone
                out = self._out.get(job.request_id)
                if out is None:
                    return
                s = out.session
                if s is not None and s.can_abort:
                    self._act(out, s.abort(AbortReason.SOURCE_ABORT, time.monotonic()), reported=True)
                # In doubt (acked, decision asked): nothing to tell; an adopted reservation nobody claims
                # is given back by the receiver. Given up, it falls back as when nobody answers the ask.
                gave_up = isinstance(job, GiveUp)
                out.errors.append(job.why if gave_up else "aborted")
                self._end(out, TransferOutcome.FAILED if gave_up else TransferOutcome.ABORTED)

    def _path(self, out: Outgoing) -> Transport:
        key = out.addresses[out.path]
        if key not in self._paths:
            path: Transport = ZmqPath(self.ctx, key[0], key[1], self.timeout_s, self.keys)
            self._paths[key] = FaultyPath(path) if self.fault_source is not None else path
        path = self._paths[key]
        if isinstance(path, FaultyPath):
            path.arm(self.faults)
        return path

    def _open(self, out: Outgoing) -> None:
        """A session on the current path: PREALLOC (everything is sent again on a new path)."""
        sid = f"{out.request_id}/{out.path}"
        s = out.session = SourceSession(sid, MoveKind.TRANSFER, self.timeout_s, self.retries)
        self._sessions[sid] = (s, out.addresses[out.path], math.inf)
        out.sent, out.asks, out.problem, out.heartbeat = set(), 0, "", time.monotonic()
        out.probed, out.landed = 0, 0
        self._act(out, s.prealloc(out.n_blocks, time.monotonic()))

    def _send_part(self, out: Outgoing, k: int) -> None:
        assert out.session is not None
        p = out.parts[k]
        frame = KVFrame(out.session.session, 0, k, p.layer, p.start, p.count, xxhash.xxh3_64_intdigest(p.data), p.data)
        out.bytes += self._path(out).send_frame(frame)
        self.sent += 1
        out.sent.add(k)
        out.t_first = out.t_first or time.perf_counter()

    def _send_parts(self, out: Outgoing, parts: Iterable[int]) -> None:
        """Those of `parts` not sent in this session yet, up to the first the path refuses (a path that
        is down is not asked again for every part; the session's timer deals with it)."""
        for k in parts:
            if k not in out.sent:
                try:
                    self._send_part(out, k)
                except PathDownError as exc:
                    out.problem = str(exc)
                    return

    def _finish(self, out: Outgoing) -> None:
        """The prompt is done and the destination reserved: the rest of the frames, the one final copy
        stage (every block), COMMIT."""
        s = out.session
        assert s is not None
        self._send_parts(out, range(len(out.parts)))  # one lost: the ack names it
        now = time.monotonic()
        self._act(out, [*s.final_copy(now, parts=len(out.parts)), *s.commit(now)])

    def _poll(self) -> None:
        """Answers from every path, then every session's timer."""
        for path in list(self._paths.values()):
            while (msg := path.recv()) is not None:
                try:
                    self._answer(msg)
                except MoveProtocolError as exc:  # a destination contradicted its session: ignored
                    log.warning("KV move %s: a %s ignored: %s", msg.session, type(msg).__name__, exc)
                except Exception:  # a bug: loud, but one message must not end this thread
                    log.exception("KV move %s: handling a %s failed", msg.session, type(msg).__name__)
        now = time.monotonic()
        for out in list(self._out.values()):
            if out.session is not None:
                self._guard(out.request_id, self._act, out, out.session.on_timeout(now))
            s = out.session
            # The heartbeat: frames are data and may be lost, and a step can outlast the destination's
            # watchdog, so while the engine shows the transfer alive a repeated PREALLOC (idempotent:
            # answered with the same RESERVED) tells the destination the source is there. An engine
            # silent for `timeout_s` gets none: its reservation expires as a vanished source's.
            if (
                s is not None
                and s.state is SourceState.COPYING
                and now - out.heartbeat > self.timeout_s / 2
                and now - out.alive < self.timeout_s
            ):
                out.heartbeat = now
                self._try(out, lambda s=s, out=out: self._path(out).send(Prealloc(s.session, out.n_blocks)))
            # A copy in rounds: asked what landed whenever parts went out since, or again when unanswered.
            if (
                s is not None
                and out.probe
                and s.state is SourceState.COPYING
                and out.landed < len(out.sent)
                and (len(out.sent) > out.probed or now - out.probe_at > self.timeout_s / 2)
            ):
                out.probed, out.probe_at = len(out.sent), now
                self._try(out, lambda s=s, out=out: self._path(out).send(Probe(s.session, len(out.sent))))
        for sid, (_, _, until) in list(self._sessions.items()):
            if now > until:
                del self._sessions[sid]

    def _answer(self, msg: ToSource) -> None:
        entry = self._sessions.get(msg.session)
        if entry is None:
            return  # from a session ended long ago
        s, key, _ = entry
        out = self._out.get(msg.session.rsplit("/", 1)[0])
        if out is not None and out.session is s:
            self._guard(out.request_id, self._on_answer, out, s, msg)
            return
        # An ended session: a destination that still holds blocks for it is told to let them go. The
        # rest (a decision, a probe's late answer) has nothing left to act on.
        if not isinstance(msg, Reserved | CommitAck | Abort) or not s.finished:
            return
        for action in s.receive(msg, time.monotonic()):
            if isinstance(action, Send):
                with contextlib.suppress(PathDownError):
                    self._paths[key].send(action.message)

    def _on_answer(self, out: Outgoing, s: SourceSession, msg: ToSource) -> None:
        now = time.monotonic()
        if isinstance(msg, Decision):
            self._act(out, s.on_decided(msg.outcome, now))
            return
        if isinstance(msg, Progress):
            out.landed = max(out.landed, min(msg.sent, len(out.sent)))
            return
        was = s.state
        if isinstance(msg, CommitAck) and msg.missing and s.state is SourceState.COMMITTING:
            named = {part for stage, part in msg.parts if stage == 0}
            out.problem = f"{out.addresses[out.path][0]}: {len(named) or len(out.parts)} chunks missing or corrupt"
            if msg.attempt == s.attempt and s.attempt < self.retries:
                self.retry.sleep(s.attempt)
                again = named or set(range(len(out.parts)))
                self.resent += len(again)
                out.sent -= again  # sent again before the copy stage's manifest
        if isinstance(msg, Abort):
            log.warning(
                "KV transfer of %s: the destination aborted session %s (%s)", out.request_id, s.session, msg.reason
            )
            out.problem = f"{out.addresses[out.path][0]}: " + (
                f"no room for {out.n_blocks} KV blocks" if msg.reason is AbortReason.NO_ROOM else f"{msg.reason}"
            )
        self._act(out, s.receive(msg, now))
        if was is SourceState.PREALLOCATING and s.state is SourceState.COPYING:
            self._send_parts(out, [k for k, p in enumerate(out.parts) if p.stream])
            if out.commit_wanted:
                self._finish(out)

    def _act(self, out: Outgoing, actions: list[Action], reported: bool = False) -> None:
        s = out.session
        for a in actions:
            match a:
                case Send(message=Copy() as copy):
                    self._send_parts(out, range(copy.parts))
                    self._try(out, lambda m=copy: self._path(out).send(m))
                case Send(message=msg):
                    if isinstance(msg, Prealloc | Commit) and s is not None and s.attempt:
                        out.retries += 1
                        self.resent += 1
                    self._try(out, lambda m=msg: self._path(out).send(m))
                case Decide():
                    out.asks += 1
                    if out.asks > self.retries + 1:
                        # In doubt and nobody answers: the router sends the request on with the fallback
                        # (the decode side's claim finds the blocks only if the ledger said COMMITTED).
                        out.errors.append(f"{out.addresses[out.path][0]}: no decision from the destination")
                        self._end(out, TransferOutcome.FAILED)
                        return
                    out.retries += out.asks > 1
                    self.resent += out.asks > 1
                    self._try(out, lambda d=a: self._path(out).send(AskDecision(d.session, d.proposal)))
                case ResumeAtSource(reason=reason):
                    if reported:
                        return
                    why = "no answer" if reason is AbortReason.TIMEOUT else str(reason)
                    self.timeouts += reason is AbortReason.TIMEOUT
                    out.errors.append(out.problem or f"{out.addresses[out.path][0]}: {why}")
                    self._next_path(out)
                    return
                case LetGo():
                    assert s is not None
                    self._end(out, TransferOutcome.OK, list(s.dest_blocks))
                    return

    def _try(self, out: Outgoing, send) -> None:  # noqa: ANN001 - a send with its arguments bound
        """A send on a path that is down is an unanswered one: the session's timer retries, then aborts."""
        try:
            send()
            self.sent += 1
        except PathDownError as exc:
            out.problem = str(exc)

    def _next_path(self, out: Outgoing) -> None:
        self._retire(out)
        out.fallbacks += 1
        out.path += 1
        if out.path < len(out.addresses):
            self._open(out)
        else:
            self._end(out, TransferOutcome.FAILED)

    def _retire(self, out: Outgoing) -> None:
        if out.session is not None:
            sid = out.session.session
            self._sessions[sid] = (out.session, self._sessions[sid][1], time.monotonic() + TOMBSTONE_S)
            out.session = None

    def _end(self, out: Outgoing, outcome: TransferOutcome, block_ids: list[int] | None = None) -> None:
        if self._out.pop(out.request_id, None) is None:
            return
        self._retire(out)
        self._results.put(out.result(outcome, block_ids or []))
