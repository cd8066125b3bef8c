"""A move arriving at the KV receiver (`kv/moves/receiver.py`): its state there, and the in-memory decision
record of a receiver with no ledger."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq

from steadfast.kv.moves.checks import covers
from steadfast.kv.moves.faults import TransportFaults
from steadfast.kv.moves.messages import Action, Commit, CommitAck, Copy, DestinationState, MoveOutcome, Send
from steadfast.kv.moves.seal import Opener
from steadfast.kv.moves.session import DestinationSession
from steadfast.kv.moves.wire import KVFrame, ToDestination

log = logging.getLogger("steadfast.kv.moves.receiver")

Decider = Callable[[str, MoveOutcome], MoveOutcome]


class MemoryDecisions:
    """The decision record when there is no ledger (a receiver on its own, in tests): first writer wins."""

    def __init__(self) -> None:
        self._decided: dict[str, MoveOutcome] = {}

    def __call__(self, session: str, proposal: MoveOutcome) -> MoveOutcome:
        return self._decided.setdefault(session, proposal)


@dataclass
class Incoming:
    """One move arriving: its session, the connection it came on, what has been written and verified."""

    session: DestinationSession
    request_id: str
    sock: zmq.Socket  # the connection that opened it: the only one it hears (a made-up copy of a live
    peer: bytes  # session's name from elsewhere writes nothing); `peer`, its routing id, is where answers go
    manifests: dict[int, Copy] = field(default_factory=dict)
    # stage -> part -> (layer, start, count) of the parts written and verified
    spans: dict[int, dict[int, tuple[int, int, int]]] = field(default_factory=dict)
    ended: float = math.inf
    faults: TransportFaults | None = None  # a drill's, armed when the session opened
    acks_dropped: int = 0
    held_until: float = 0.0  # a held stage: its messages wait in `held` until then
    held: list[ToDestination] = field(default_factory=list)
    opener: Opener | None = None  # its sealed data channel (`kv/moves/seal.py`), when the source asked
    data_port: int = 0  # that channel's socket, beside `sock`

    def held_back(self, msg: ToDestination, now: float) -> bool:
        """A drill's `hold_s`: from the session's first frame its stage waits (frames, manifests, COMMITs;
        the source's heartbeat and ABORT still get through)."""
        hold = self.faults.hold_s if self.faults is not None else 0.0
        if not hold or not isinstance(msg, KVFrame | Copy | Commit):
            return False
        if not self.held_until:
            self.held_until = now + hold
            log.warning("KV move %s: fault drill: its stage is held for %.2f s", msg.session, hold)
        if now >= self.held_until:
            return False
        self.held.append(msg)
        return True

    def prepares(self, msg: Commit) -> bool:
        """Whether this COMMIT finds every stage it names received (the session would prepare)."""
        d = self.session
        receiving = d.state in (DestinationState.RESERVED, DestinationState.RECEIVING)
        return receiving and all(s in d.got for s in range(msg.stages))

    def covered(self, num_layers: int, block_size: int) -> bool:
        """Whether the announced parts written give every layer every token of the move."""
        spans = [
            span
            for stage, parts in self.spans.items()
            if stage in self.manifests
            for k, span in parts.items()
            if k < self.manifests[stage].parts
        ]
        return covers(spans, num_layers, len(self.session.block_ids), block_size)

    def with_parts(self, action: Action) -> Action:
        """An ack that names missing stages also names their missing parts, so only those are resent."""
        if not (isinstance(action, Send) and isinstance(action.message, CommitAck) and action.message.missing):
            return action
        parts = tuple(
            (stage, k)
            for stage in action.message.missing
            if stage in self.manifests
            for k in range(self.manifests[stage].parts)
            if k not in self.spans.get(stage, {})
        )
        return Send(msgspec.structs.replace(action.message, parts=parts))
