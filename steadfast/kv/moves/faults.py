"""Fault injection for KV transfers (tests, chaos drills): `TransportFaults` says what to do to chunks
(delay, drop, corrupt, stall) of data frames and on which path; `FaultyPath` wraps any `Transport` and does it on the
sending side, behind the same interface, so the real path never knows about drills. Two faults only the
destination can make: a lost COMMIT ack and a stage the destination sits on; the receiver reads them from the
same spec (`drop_acks`, `hold_s`) and applies them to the sessions it opens while they are armed.

The spec comes from config, else from two environment variables (`transfer_fault_source`, read at the
start of every transfer); nothing here ever retries or resends.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from steadfast.config import TransferConfig
from steadfast.kv.moves.transport import Transport
from steadfast.kv.moves.wire import KVFrame, ToDestination, ToSource

FaultSwitch = Callable[[], "TransportFaults | None"]


def transfer_fault_source(cfg: TransferConfig) -> Callable[[], str] | None:
    """The KV transfer fault drill's spec text, asked for at the start of every transfer: the faults
    file's content (missing file: no faults) when one is named, else the `faults` spec; the environment
    variables stand in for unset keys. None when no drill is configured at all.

    Test and chaos hooks only: nothing sets these outside fault-injection runs.
    """
    where = cfg.faults_file or os.environ.get("STEADFAST_TRANSFER_FAULTS_FILE", "")
    if where:

        def read() -> str:
            try:
                with open(where) as f:
                    return f.read().strip()
            except FileNotFoundError:
                return ""

        return read
    spec = cfg.faults or os.environ.get("STEADFAST_TRANSFER_FAULTS", "")
    return (lambda: spec) if spec else None


@dataclass(frozen=True)
class TransportFaults:
    """Faults injected on one path (tests, chaos drills). Sending side: `every`: which chunks (1 = all,
    3 = every third); a stalled chunk holds the path for `stall_s` first. Receiving side, per session:
    its first `drop_acks` prepared COMMIT acks are never sent, and its frames, copy manifests and COMMITs
    wait `hold_s` from its first frame before they are handled (the stage stalls, the session lives)."""

    delay_s: float = 0.0
    drop_every: int = 0
    corrupt_every: int = 0
    stall_every: int = 0
    stall_s: float = 0.0
    drop_acks: int = 0
    hold_s: float = 0.0
    path: str = "primary"  # the path they apply to; "*" for every path

    @classmethod
    def parse(cls, spec: str) -> TransportFaults | None:
        """`'drop_every=2,path=primary'` → faults; None for an empty spec."""
        if not spec:
            return None
        values: dict[str, object] = {}
        for item in spec.split(","):
            key, _, value = item.partition("=")
            kind = cls.__dataclass_fields__[key.strip()].type
            values[key.strip()] = value.strip() if kind == "str" else (float if "float" in kind else int)(value)
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls) -> TransportFaults | None:
        """The faults the default config's sources hold now (`STEADFAST_TRANSFER_FAULTS`, or the file
        named by `STEADFAST_TRANSFER_FAULTS_FILE`, read by `steadfast.config.env`); None when neither is set."""
        source = transfer_fault_source(TransferConfig())
        return cls.parse(source()) if source is not None else None

    def applies_to(self, path_name: str) -> bool:
        return self.path in (path_name, "*")


def fault_switch(spec_source: Callable[[], str] | None) -> FaultSwitch | None:
    """A fault switch over a spec source (`transfer_fault_source`): asked again for
    every transfer, so a drill can change the spec while the server runs. None when there is no source."""
    if spec_source is None:
        return None
    return lambda: TransportFaults.parse(spec_source())


class FaultyPath:
    """A `Transport` that does `faults` to the chunks it passes on to `inner`. The chunk count behind
    each `every` runs across transfers, whatever their faults (None: chunks pass untouched)."""

    def __init__(self, inner: Transport, faults: TransportFaults | None = None) -> None:
        self.inner, self.name = inner, inner.name
        self.faults = faults
        self.sent = 0

    def arm(self, faults: TransportFaults | None) -> None:
        """The faults of the transfer about to use this path, if they are meant for it."""
        self.faults = faults if faults is not None and faults.applies_to(self.name) else None

    def send_frame(self, frame: KVFrame) -> int:
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
                flipped = bytearray(frame.data)
                flipped[len(flipped) // 2] ^= 0xFF
                frame = msgspec.structs.replace(frame, data=memoryview(flipped))
        return self.inner.send_frame(frame)

    def send(self, msg: ToDestination) -> None:
        self.inner.send(msg)

    def recv(self) -> ToSource | None:
        return self.inner.recv()

    def close(self) -> None:
        self.inner.close()
