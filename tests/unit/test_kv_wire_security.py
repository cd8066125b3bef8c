"""The KV wire between nodes under hostile or broken peers, over real ZeroMQ sockets: nothing listens on a
one-node deployment; only the deployment's CURVE client key gets a byte in; junk, oversized and absurd
messages leave the receiver thread serving; frames outside their session are dropped and abort it; the
moves and blocks held at once are capped; nobody but a session's own connection writes its blocks, and a
request whose KV committed gets no second move."""

from __future__ import annotations

import logging
import os
import stat
import time

import msgspec
import pytest
import xxhash
import zmq

from steadfast.config import Config, TransferConfig
from steadfast.kv.arena.arena import KVArena
from steadfast.kv.moves.checks import Drop, IncomingLimits, max_message_bytes
from steadfast.kv.moves.messages import Abort, AbortReason, Commit, CommitAck, Copy, MoveOutcome, Prealloc, Reserved
from steadfast.kv.moves.packing import layer_span, slots_for
from steadfast.kv.moves.receiver import KVReceiver
from steadfast.kv.moves.seal import Opener, Sealer, SealError, new_key
from steadfast.kv.moves.sender import KVSender
from steadfast.kv.moves.transport import PathDownError, ZmqPath
from steadfast.kv.moves.wire import AskDecision, Decision, KVFrame, encode
from steadfast.ops.supervisor.children import ChildKind, ChildSpec, OnExit, PoolNode
from steadfast.ops.supervisor.workers import WorkerLaunch, Workers
from steadfast.wire.curve import KeyFile, TransferSide, write_deployment_keys
from steadfast.wire.worker import WorkerRole, WorkerState, WorkerStatus
from steadfast.worker.kv.wiring import _other_nodes, transfer_side
from tests.unit.fake_pool import FakePool
from tests.unit.test_move_receiver import SPEC, Source
from tests.unit.test_transfer import wait_result

pytestmark = pytest.mark.unit

TOKENS = 10  # a move of 3 blocks of 4 tokens


@pytest.fixture
def source_arena() -> KVArena:
    arena = KVArena.create_device(SPEC, "cpu")
    arena.tensor.normal_()
    return arena


@pytest.fixture
def make_rx():
    made: list[KVReceiver] = []

    def make(keys: KeyFile | None = None, limits: IncomingLimits | None = None) -> tuple[KVReceiver, FakePool]:
        pool = FakePool(SPEC.num_blocks)
        arena = KVArena.create_device(SPEC, "cpu")
        made.append(
            KVReceiver(
                arena, SPEC.block_size, ["tcp://127.0.0.1:0"], pool.grant, pool.release, 0.5, keys=keys, limits=limits
            )
        )
        return made[-1], pool

    yield make
    for rx in made:
        rx.close()


def frames(session: str, arena: KVArena, blocks: list[int], tokens: int = TOKENS) -> list[KVFrame]:
    """One part per layer, every token."""
    out = []
    for layer in range(SPEC.num_layers):
        data = layer_span(arena, layer, slots_for(blocks, SPEC.block_size, 0, tokens))
        out.append(KVFrame(session, 0, layer, layer, 0, tokens, xxhash.xxh3_64_intdigest(data), data))
    return out


def reserve(src: Source, session: str, n_blocks: int = 3) -> tuple[int, ...]:
    src.send(Prealloc(session, n_blocks))
    reserved = src.answer()
    assert isinstance(reserved, Reserved), reserved
    return reserved.block_ids


def commit(src: Source, session: str, sent: list[KVFrame], n_blocks: int = 3) -> None:
    """The rest of a move after RESERVED: its frames, the one final stage, COMMIT, the decision."""
    for f in sent:
        src.send(f)
    src.send(Copy(session, 0, tuple(range(n_blocks)), True, parts=len(sent)))
    src.send(Commit(session, 0, 1))
    assert src.answer() == CommitAck(session, 0)
    src.send(AskDecision(session, MoveOutcome.COMMITTED))
    assert src.answer() == Decision(session, MoveOutcome.COMMITTED)


def held(arena: KVArena, blocks, tokens: int = TOKENS) -> list[bytes]:
    return [
        layer_span(arena, layer, slots_for(list(blocks), SPEC.block_size, 0, tokens))
        for layer in range(SPEC.num_layers)
    ]


def transfer(sender: KVSender, address: str, arena: KVArena, rid: str = "good") -> None:
    """A whole transfer through a real sender: 10 tokens in source blocks [5, 9, 2], two spans."""
    sender.begin(rid, [("primary", address)], TOKENS)
    for start, count in [(0, 6), (6, 4)]:
        slots = slots_for([5, 9, 2], SPEC.block_size, start, count)
        for layer in range(SPEC.num_layers):
            sender.layer(rid, layer, start, count, layer_span(arena, layer, slots), True)
    sender.commit(rid)


def quiet_and_empty(rx: KVReceiver, pool: FakePool, src: Source) -> bool:
    return src.silent(0.5) and rx.reserved_blocks == 0 and len(pool.free) == SPEC.num_blocks and not pool.calls


# --- 1. one node: nothing listens ---------------------------------------------------------------------
def launch_sides(tmp_path, decode_node: str) -> dict[tuple[str, int], list[str]]:
    """The worker command lines a launcher builds, by (role, node), without starting anything."""
    server = {"workers": 0, "prefill_workers": 1, "decode_workers": 1, "decode_node": decode_node}
    cfg = Config().replace(server=server, fault_recovery={"kv_cache": {"external_ledger": True}})
    specs: list[ChildSpec] = []
    keys = write_deployment_keys(tmp_path) if decode_node == "separate" else {}
    pool = ChildSpec(ChildKind.POOL, "kvpool", (), OnExit.RESTART)
    nodes = [PoolNode(i, f"ipc://pool{i}", "sqlite://", pool) for i in range(2 if decode_node == "separate" else 1)]
    launch = WorkerLaunch("{}", "ipc://x", SPEC, tmp_path, "", keys)
    workers = Workers(cfg, launch, nodes, [], specs.append, lambda msg: None)  # type: ignore[arg-type]
    placed = [(WorkerRole.PREFILL, 0), (WorkerRole.DECODE, len(nodes) - 1)]
    placed += [(WorkerRole.STANDBY, node) for node in range(len(nodes))]
    for worker_id, (role, node) in enumerate(placed):
        workers.start(worker_id, role, node)
    return {(str(role), node): list(spec.argv) for (role, node), spec in zip(placed, specs, strict=True)}


def side_of(argv: list[str]) -> TransferSide:
    return transfer_side(
        WorkerRole(argv[argv.index("--role") + 1]), TransferSide(argv[argv.index("--transfer-side") + 1])
    )


def test_a_one_node_deployment_binds_no_kv_socket_and_a_decode_node_receives_with_its_keys(tmp_path):
    for sub in ("one", "two"):
        (tmp_path / sub).mkdir()
    one = launch_sides(tmp_path / "one", "same")
    assert all(side_of(argv) is TransferSide.NONE and "--transfer-keys" not in argv for argv in one.values())
    # The worker, told so, makes neither a receiver nor a sender: no socket bound, none connected.
    cfg = Config()
    assert _other_nodes(cfg, None, "", None, None, TransferSide.NONE, None) == (None, None)  # type: ignore[arg-type]

    two = launch_sides(tmp_path / "two", "separate")
    sides = {key: side_of(argv) for key, argv in two.items()}
    # A prefill worker only sends; every worker that may decode (standbys too: one may be promoted)
    # receives (a prefill's KV, a migration's) and sends (a migration away).
    assert sides == {
        ("prefill", 0): TransferSide.SEND,
        ("decode", 1): TransferSide.BOTH,
        ("standby", 0): TransferSide.BOTH,
        ("standby", 1): TransferSide.BOTH,
    }
    for key, argv in two.items():
        paths = [argv[i + 1] for i, a in enumerate(argv) if a == "--transfer-keys"]
        loaded = [KeyFile.load(p) for p in paths]
        want = {TransferSide.SEND, TransferSide.RECEIVE} if sides[key] is TransferSide.BOTH else {sides[key]}
        assert {k.side for k in loaded} == want and len(paths) == len(want)
        assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in paths)
        for keys in loaded:
            assert not any(keys.secret.decode() in arg for arg in argv)  # a path on the command line, never a key


# --- 2. authentication ----------------------------------------------------------------------------------
def test_only_the_deployments_client_key_gets_a_message_through(tmp_path, make_rx, source_arena):
    paths = write_deployment_keys(tmp_path)
    server, client = KeyFile.load(paths[TransferSide.RECEIVE]), KeyFile.load(paths[TransferSide.SEND])
    rx, pool = make_rx(keys=server)
    address = rx.addresses[0]
    plain = Source(address)  # no CURVE at all
    plain.send(Prealloc("p/0", 3))
    made_up = KeyFile(TransferSide.SEND, *zmq.curve_keypair(), peers=(server.public,))  # knows the server key
    stranger = Source(address, keys=made_up)
    stranger.send(Prealloc("s/0", 3))
    assert quiet_and_empty(rx, pool, plain) and quiet_and_empty(rx, pool, stranger)
    # A sender pinned to another deployment's server key never streams to this receiver either.
    (tmp_path / "other").mkdir()
    other = KeyFile.load(write_deployment_keys(tmp_path / "other")[TransferSide.SEND])
    tx_other = KVSender(SPEC.num_layers, 0.2, 0, 0.01, block_size=SPEC.block_size, keys=other)
    tx = KVSender(SPEC.num_layers, 1.0, 2, 0.01, block_size=SPEC.block_size, keys=client)
    try:
        transfer(tx_other, address, source_arena, "o")
        assert not wait_result(tx_other).ok and rx.reserved_blocks == 0 and not pool.calls
        transfer(tx, address, source_arena)
        result = wait_result(tx)
        assert result.ok
        assert held(rx.arena, result.block_ids) == held(source_arena, [5, 9, 2])
    finally:
        tx.close()
        tx_other.close()
        plain.sock.close()
        stranger.sock.close()


# --- 3. junk keeps the thread serving -------------------------------------------------------------------
def test_junk_oversized_and_absurd_messages_leave_the_receiver_serving(make_rx, source_arena, caplog):
    rx, pool = make_rx()
    src = Source(rx.addresses[0], routing_id=b"source-1")
    blocks = reserve(src, "r/0")
    with caplog.at_level(logging.WARNING, logger="steadfast.kv.moves.receiver"):
        for _ in range(50):
            src.sock.send_multipart([b"\x93junk", b"more", b"and more"])
            src.raw(b"\x93not a message")
        src.raw(encode(Prealloc("z/0", 1))[:-1])  # cut short
        src.send(Commit("r/0", 0, 10**12))  # a state machine told to count 10^12 stages would never return
        src.send(Copy("r/0", 10**9, (0,), True, parts=1))
        time.sleep(0.3)
    assert rx.dropped[Drop.UNDECODABLE] == 101 and rx.dropped[Drop.OUT_OF_RANGE] == 2
    assert len(caplog.records) <= 3  # rate-limited: one line per kind, not one per message
    # Bigger than any frame this arena can take: dropped by libzmq with its connection, before it is read.
    src.raw(b"\0" * (max_message_bytes(SPEC) + 1))
    time.sleep(0.5)  # (the source reconnects with its routing id and keeps its session)
    assert rx._thread.is_alive() and rx.dropped[Drop.UNDECODABLE] == 101  # it never reached the receiver
    commit(src, "r/0", frames("r/0", source_arena, list(blocks)))
    assert held(rx.arena, rx.claim("r")) == held(source_arena, blocks)
    tx = KVSender(SPEC.num_layers, 1.0, 2, 0.01, block_size=SPEC.block_size)
    try:
        transfer(tx, rx.addresses[0], source_arena)
        assert wait_result(tx).ok
    finally:
        tx.close()
        src.sock.close()


def test_a_sender_path_keeps_its_sessions_across_a_reconnect(make_rx, source_arena):
    """The receiver hears a session only from the connection that opened it; the path's own routing id
    makes the reconnected one the same (here the receiver dropped the first for an oversized message)."""
    rx, _ = make_rx()
    path = ZmqPath(zmq.Context.instance(), "primary", rx.addresses[0], 1.0)

    def answer():
        deadline = time.monotonic() + 5
        while (got := path.recv()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return got

    def send(msg) -> None:  # noqa: ANN001 - any message a source sends
        deadline = time.monotonic() + 5
        while True:
            try:
                return path.send_frame(msg) if isinstance(msg, KVFrame) else path.send(msg)
            except PathDownError:  # (reconnecting)
                assert time.monotonic() < deadline
                time.sleep(0.05)

    try:
        send(Prealloc("r/0", 3))
        reserved = answer()
        assert isinstance(reserved, Reserved)
        path.sock.send(b"\0" * (max_message_bytes(SPEC) + 1))
        time.sleep(0.3)
        for f in frames("r/0", source_arena, list(reserved.block_ids)):
            send(f)
        send(Copy("r/0", 0, (0, 1, 2), True, parts=SPEC.num_layers))
        send(Commit("r/0", 0, 1))
        assert answer() == CommitAck("r/0", 0) and rx.dropped[Drop.WRONG_PEER] == 0
    finally:
        path.close()


# --- 4. frames checked against their session ------------------------------------------------------------
BAD_FRAMES = [
    ("layer", Drop.LAYER, dict(layer=SPEC.num_layers)),
    ("negative_start", Drop.SPAN, dict(start=-1)),
    ("past_the_blocks", Drop.SPAN, dict(start=8, count=5)),  # tokens 8..13 of 3 blocks (12 tokens)
    ("empty", Drop.SPAN, dict(count=0)),
    ("size", Drop.SIZE, dict(count=4)),  # the data of 10 tokens said to be 4
    ("part", Drop.PART, dict(part=2)),  # the stage announced 2 parts
]


@pytest.mark.parametrize("case,why,change", BAD_FRAMES, ids=[c[0] for c in BAD_FRAMES])
def test_a_frame_outside_its_session_is_dropped_and_aborts_it(make_rx, source_arena, case, why, change):
    rx, pool = make_rx()
    src = Source(rx.addresses[0])
    blocks = reserve(src, "r/0")
    before = held(rx.arena, blocks)
    src.send(Copy("r/0", 0, (0, 1, 2), True, parts=2))
    good = frames("r/0", source_arena, list(blocks))[0]
    fields = {f: getattr(good, f) for f in good.__struct_fields__} | change
    src.send(KVFrame(**fields))
    assert src.answer() == Abort("r/0", AbortReason.DESTINATION_ABORT)
    assert rx.dropped[why] == 1 and rx.reserved_blocks == 0 and len(pool.free) == SPEC.num_blocks
    assert held(rx.arena, blocks) == before  # not a byte written
    assert rx._thread.is_alive()


def test_a_session_whose_parts_leave_tokens_unwritten_never_prepares(make_rx, source_arena):
    """Every announced part came and checked, but layer 1 has no tokens: preparing would commit blocks
    holding whatever their last owner left in them."""
    rx, pool = make_rx()
    src = Source(rx.addresses[0])
    blocks = reserve(src, "r/0")
    src.send(frames("r/0", source_arena, list(blocks))[0])  # layer 0 only
    src.send(Copy("r/0", 0, (0, 1, 2), True, parts=1))
    src.send(Commit("r/0", 0, 1))
    assert src.answer() == Abort("r/0", AbortReason.DESTINATION_ABORT)
    assert rx.dropped[Drop.INCOMPLETE] == 1 and len(pool.free) == SPEC.num_blocks
    src.send(AskDecision("r/0", MoveOutcome.COMMITTED))
    assert src.answer() == Decision("r/0", MoveOutcome.ABORTED) and rx.claim("r") is None


# --- 5. caps --------------------------------------------------------------------------------------------
def test_incoming_moves_and_their_blocks_are_capped_without_reserving(make_rx):
    assert IncomingLimits.of(TransferConfig(), 16) == IncomingLimits(128, 8)
    rx, pool = make_rx(limits=IncomingLimits(sessions=2, blocks=5))
    src = Source(rx.addresses[0])
    reserve(src, "a/0", 2)
    reserve(src, "b/0", 2)
    src.send(Prealloc("c/0", 1))  # a third move at once
    assert src.answer() == Abort("c/0", AbortReason.BUSY)
    src.send(Abort("a/0", AbortReason.SOURCE_ABORT))
    src.send(Prealloc("c/0", 4))  # 2 held + 4 > 5
    assert src.answer() == Abort("c/0", AbortReason.NO_ROOM)
    assert rx.reserved_blocks == 2 and len(pool.free) == SPEC.num_blocks - 2
    assert sum(call == "grant" for call, _ in pool.calls) == 2  # neither refusal asked the pool
    reserve(src, "c/1", 3)  # within both: reserved
    assert rx.counts()[1] == {"busy": 1, "no_room": 1}


# --- 6. nobody overwrites a move's blocks ---------------------------------------------------------------
def test_another_connection_cannot_write_a_session_nor_a_second_move_replace_a_committed_one(make_rx, source_arena):
    rx, pool = make_rx()
    src, intruder = Source(rx.addresses[0]), Source(rx.addresses[0])
    blocks = reserve(src, "r/0")
    sent = frames("r/0", source_arena, list(blocks))
    forged = KVArena.create_device(SPEC, "cpu")
    forged.tensor.fill_(7.0)
    for f in frames("r/0", forged, list(blocks)):  # the session's name, valid checksums, another connection
        intruder.send(f)
    intruder.send(Copy("r/0", 0, (0, 1, 2), True, parts=2))
    intruder.send(Commit("r/0", 0, 1))
    for _ in range(2):  # told to move on; the session is untouched
        assert intruder.answer() == Abort("r/0", AbortReason.DESTINATION_ABORT)
    assert rx.dropped[Drop.WRONG_PEER] == 4 and rx.reserved_blocks == 3
    commit(src, "r/0", sent)
    # Committed, not yet claimed: a second move of the same request reserves nothing and replaces nothing.
    intruder.send(Prealloc("r/1", 3))
    assert intruder.answer() == Abort("r/1", AbortReason.DESTINATION_ABORT)
    assert rx.reserved_blocks == 0 and len(pool.free) == SPEC.num_blocks - 3
    claimed = rx.claim("r")
    assert claimed == list(blocks) and held(rx.arena, claimed) == held(source_arena, blocks)
    src.sock.close()
    intruder.sock.close()


# --- 7. the sealed data channel ------------------------------------------------------------------------
def curve_pair(tmp_path) -> tuple[KeyFile, KeyFile]:
    paths = write_deployment_keys(tmp_path)
    return KeyFile.load(paths[TransferSide.RECEIVE]), KeyFile.load(paths[TransferSide.SEND])


def test_a_curve_transfer_moves_its_bytes_sealed_on_the_data_channel(tmp_path, make_rx, source_arena):
    server, client = curve_pair(tmp_path)
    rx, pool = make_rx(keys=server)
    assert len(rx.data_socks) == 1
    tx = KVSender(SPEC.num_layers, 1.0, 2, 0.01, block_size=SPEC.block_size, keys=client)
    try:
        transfer(tx, rx.addresses[0], source_arena)
        result = wait_result(tx)
        assert result.ok
        assert held(rx.arena, result.block_ids) == held(source_arena, [5, 9, 2])
        # Every frame, the manifest, the COMMIT and the decision's question went sealed.
        assert tx._paths[("primary", rx.addresses[0])].sealed_sent >= 2 * SPEC.num_layers + 3
    finally:
        tx.close()
    plain_rx, _ = make_rx()  # no CURVE: no data channel, every message on the one connection
    assert plain_rx.data_socks == []


def test_the_data_channel_takes_only_what_opens_under_the_sessions_key_once(tmp_path, make_rx, source_arena):
    server, client = curve_pair(tmp_path)
    rx, pool = make_rx(keys=server)
    src = Source(rx.addresses[0], keys=client)
    key = new_key()
    src.send(Prealloc("d/0", 3, seal_key=key))
    reserved = src.answer()
    assert isinstance(reserved, Reserved) and reserved.data_port > 0
    src.send(Prealloc("k/0", 3))  # a session without a key: no channel for it
    assert src.answer().data_port == 0
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{reserved.data_port}")
    sealer = Sealer(key, "d/0")

    def sealed(msg, by: Sealer = sealer, session: str = "d/0") -> list[bytes]:
        return [session.encode(), *by.seal(encode(msg))]

    parts = frames("d/0", source_arena, [5, 9, 2])
    try:
        push.send_multipart(sealed(parts[0], Sealer(new_key(), "d/0")))  # another key
        push.send_multipart(sealed(parts[0], Sealer(key, "k/0"), "k/0"))  # a session with no channel
        push.send_multipart(sealed(parts[0], Sealer(key, "x/0"), "x/0"))  # no such session
        push.send_multipart([b"d/0", b"junk"])
        first = sealed(parts[0])
        push.send_multipart(first)
        push.send_multipart(first)  # the same message again: replayed
        deadline = time.monotonic() + 5
        while rx.dropped[Drop.UNSEALED] < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rx.dropped[Drop.UNSEALED] == 5
        for f in parts[1:]:
            push.send_multipart(sealed(f))
        push.send_multipart(sealed(Copy("d/0", 0, (0, 1, 2), True, parts=len(parts))))
        push.send_multipart(sealed(Commit("d/0", 0, 1)))
        assert src.answer() == CommitAck("d/0", 0)  # answers come on the CURVE connection
        push.send_multipart(sealed(AskDecision("d/0", MoveOutcome.COMMITTED)))
        assert src.answer() == Decision("d/0", MoveOutcome.COMMITTED)
        assert held(rx.arena, rx.claim("d")) == held(source_arena, [5, 9, 2])
        assert rx.dropped[Drop.UNSEALED] == 5 and rx.dropped[Drop.CHECKSUM] == 0
        # What the worker's status report (and so /metrics, `steadfast_kv_wire_dropped`) carries.
        dropped, refused = rx.counts()
        assert dropped == {"unsealed": 5} and refused == {}
        status = WorkerStatus(1, 1, WorkerRole.DECODE, WorkerState.READY, kv_wire_dropped=dropped)
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(status), type=WorkerStatus).kv_wire_dropped == dropped
    finally:
        push.close()
        src.sock.close()


def test_a_sealed_message_opens_once_and_only_under_its_key_and_session():
    key = new_key()
    sealer, opener = Sealer(key, "a/0"), Opener(key, "a/0")
    n1, c1 = sealer.seal(b"one")
    n2, c2 = sealer.seal(b"two")
    with pytest.raises(SealError):
        Opener(key, "b/0").open(n1, c1)  # the session's name is part of what is sealed
    with pytest.raises(SealError):
        Opener(new_key(), "a/0").open(n1, c1)
    tampered = bytearray(c2)
    tampered[0] ^= 1
    with pytest.raises(SealError):
        opener.open(n2, bytes(tampered))
    assert opener.open(n2, c2) == b"two"
    with pytest.raises(SealError):
        opener.open(n1, c1)  # older than one already opened
    with pytest.raises(SealError):
        opener.open(n2, c2)  # the same again
    with pytest.raises(ValueError):
        Sealer(b"short", "a/0")
