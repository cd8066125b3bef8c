"""KV transfer between two arenas over real ZeroMQ TCP sockets: chunks checksummed, retried, and an
ordered fallback to an alternate path; faults injected on the sending side (drop, corrupt, stall).
No model: the arenas hold random K/V, and every byte the receiver keeps is compared with the source."""

from __future__ import annotations

import time

import pytest

from steadfast.config import TransferConfig
from steadfast.kv.arena.arena import ArenaSpec, KVArena
from steadfast.kv.moves.faults import TransportFaults, fault_switch, transfer_fault_source
from steadfast.kv.moves.packing import layer_span, layer_spans, slots_for
from steadfast.kv.moves.receiver import KVReceiver
from steadfast.kv.moves.retry import RetryPolicy
from steadfast.kv.moves.sender import KVSender
from tests.unit.fake_pool import FakePool

pytestmark = pytest.mark.unit

SPEC = ArenaSpec(num_blocks=32, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


@pytest.fixture
def arenas():
    src, dst = KVArena.create_device(SPEC, "cpu"), KVArena.create_device(SPEC, "cpu")
    src.tensor.normal_()
    return src, dst


def receiver(dst: KVArena, pool: FakePool, timeout_s: float = 0.5) -> KVReceiver:
    addresses = ["tcp://127.0.0.1:0", "tcp://127.0.0.1:0"]  # a primary and an alternate path
    return KVReceiver(dst, SPEC.block_size, addresses, pool.grant, pool.release, timeout_s)


def wait_result(sender: KVSender, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        results = sender.results()
        if results:
            return results[0]
        time.sleep(0.01)
    raise AssertionError("no transfer result")


def send(
    sender: KVSender, src: KVArena, addresses, layerwise: bool = True, num_tokens: int = 10, batched: bool = False
) -> list[int]:
    """Give a 10-token request held in source blocks [5, 9, 2] as two spans (streamed or kept for the
    commit), then commit. `batched`: each span's layers gathered and handed over at once, the commit
    with the last (what a migration does). Returns the source blocks."""
    src_blocks = [5, 9, 2]
    sender.begin("r", addresses, num_tokens)
    for start, count in [(0, 6), (6, 4)]:
        slots = slots_for(src_blocks, SPEC.block_size, start, count)
        if batched:
            sender.layers("r", start, count, layer_spans(src, slots), layerwise, commit=start + count == num_tokens)
            continue
        for layer in range(SPEC.num_layers):
            sender.layer("r", layer, start, count, layer_span(src, layer, slots), layerwise)
    if not batched:
        sender.commit("r")
    return src_blocks


def assert_same_kv(src: KVArena, dst: KVArena, src_blocks, dst_blocks, num_tokens: int = 10) -> None:
    for layer in range(SPEC.num_layers):
        a = layer_span(src, layer, slots_for(src_blocks, SPEC.block_size, 0, num_tokens))
        b = layer_span(dst, layer, slots_for(dst_blocks, SPEC.block_size, 0, num_tokens))
        assert a == b


@pytest.mark.parametrize("layerwise", [True, False])
@pytest.mark.parametrize("batched", [False, True])
def test_a_clean_transfer_delivers_every_byte(arenas, layerwise, batched):
    src, dst = arenas
    pool = FakePool(SPEC.num_blocks)
    rx = receiver(dst, pool)
    tx = KVSender(SPEC.num_layers, timeout_s=1.0, retries=2, backoff_s=0.01, block_size=SPEC.block_size)
    try:
        src_blocks = send(tx, src, [("primary", rx.addresses[0])], layerwise, batched=batched)
        result = wait_result(tx)
        assert result.ok and result.path == "primary" and result.retries == 0 and result.fallbacks == 0
        assert len(result.block_ids) == 3
        assert rx.claim("r") == result.block_ids and rx.claim("r") is None
        assert_same_kv(src, dst, src_blocks, result.block_ids)
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("fault", ["drop_every=4", "corrupt_every=3"])
def test_dropped_or_corrupt_chunks_are_sent_again(arenas, fault, monkeypatch):
    monkeypatch.setenv("STEADFAST_TRANSFER_FAULTS", fault + ",path=primary")
    src, dst = arenas
    pool = FakePool(SPEC.num_blocks)
    rx = receiver(dst, pool)
    tx = KVSender(SPEC.num_layers, 1.0, 3, 0.01, TransportFaults.from_env, block_size=SPEC.block_size)
    try:
        src_blocks = send(tx, src, [("primary", rx.addresses[0])])
        result = wait_result(tx)
        assert result.ok and result.path == "primary" and result.retries >= 1
        if fault.startswith("corrupt"):
            assert rx.corrupt_chunks >= 1  # the checksum caught it; the bytes kept are the resent ones
        assert_same_kv(src, dst, src_blocks, rx.claim("r"))
    finally:
        tx.close()
        rx.close()


def test_a_stalled_path_falls_back_to_the_alternate_one(arenas, monkeypatch):
    monkeypatch.setenv("STEADFAST_TRANSFER_FAULTS", "drop_every=1,path=primary")  # primary delivers nothing
    src, dst = arenas
    pool = FakePool(SPEC.num_blocks)
    rx = receiver(dst, pool)
    alternate = rx.addresses[1]  # the same receiver by another path (its second socket)
    tx = KVSender(SPEC.num_layers, 0.3, 1, 0.01, TransportFaults.from_env, block_size=SPEC.block_size)
    try:
        src_blocks = send(tx, src, [("primary", rx.addresses[0]), ("alternate", alternate)])
        result = wait_result(tx)
        assert result.ok and result.path == "alternate" and result.fallbacks == 1 and result.retries == 1
        assert_same_kv(src, dst, src_blocks, rx.claim("r"))
        assert len(pool.free) == SPEC.num_blocks - 3  # one set of blocks, reused by the second path
    finally:
        tx.close()
        rx.close()


def test_every_path_failing_gives_a_clear_error_and_leaks_no_block(arenas, monkeypatch):
    monkeypatch.setenv("STEADFAST_TRANSFER_FAULTS", "corrupt_every=1,path=primary")
    src, dst = arenas
    pool = FakePool(SPEC.num_blocks)
    rx = receiver(dst, pool)
    tx = KVSender(SPEC.num_layers, 0.2, 1, 0.01, TransportFaults.from_env, block_size=SPEC.block_size)
    try:
        send(tx, src, [("primary", rx.addresses[0])])
        result = wait_result(tx)
        assert not result.ok and result.fallbacks == 1
        assert "corrupt" in result.error
        deadline = time.monotonic() + 5
        while len(pool.free) < SPEC.num_blocks and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(pool.free) == SPEC.num_blocks  # the abort gave the receiver's blocks back
        assert rx.claim("r") is None
    finally:
        tx.close()
        rx.close()


def test_a_transfer_whose_sender_vanishes_expires_and_frees_its_blocks(arenas):
    src, dst = arenas
    pool = FakePool(SPEC.num_blocks)
    rx = receiver(dst, pool, timeout_s=0.2)
    tx = KVSender(SPEC.num_layers, 1.0, 0, 0.01, block_size=SPEC.block_size)
    try:
        tx.begin("r", [("primary", rx.addresses[0])], 10)
        slots = slots_for([5, 9, 2], SPEC.block_size, 0, 6)
        tx.layer("r", 0, 0, 6, layer_span(src, 0, slots), True)  # then nothing: the sender "died"
        deadline = time.monotonic() + 1
        while len(pool.free) == SPEC.num_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(pool.free) == SPEC.num_blocks - 3  # blocks taken for it at the first chunk
        deadline = time.monotonic() + 5
        while len(pool.free) < SPEC.num_blocks and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(pool.free) == SPEC.num_blocks
    finally:
        tx.close()
        rx.close()


def test_faults_parse_from_the_environment(monkeypatch):
    monkeypatch.setenv("STEADFAST_TRANSFER_FAULTS", "delay_s=0.5,drop_every=2,path=alternate")
    assert TransportFaults.from_env() == TransportFaults(delay_s=0.5, drop_every=2, path="alternate")
    monkeypatch.delenv("STEADFAST_TRANSFER_FAULTS")
    assert TransportFaults.from_env() is None


def test_the_fault_spec_comes_from_config_and_a_faults_file_is_read_again_each_time(tmp_path, monkeypatch):
    monkeypatch.delenv("STEADFAST_TRANSFER_FAULTS", raising=False)
    monkeypatch.delenv("STEADFAST_TRANSFER_FAULTS_FILE", raising=False)
    assert fault_switch(transfer_fault_source(TransferConfig())) is None  # no drill: paths are never wrapped
    switch = fault_switch(transfer_fault_source(TransferConfig(faults="corrupt_every=3,path=*")))
    assert switch is not None and switch() == TransportFaults(corrupt_every=3, path="*")
    f = tmp_path / "faults"
    switch = fault_switch(transfer_fault_source(TransferConfig(faults="drop_every=1", faults_file=str(f))))
    assert switch is not None and switch() is None  # the file wins; a missing one means no faults
    f.write_text("stall_every=2,stall_s=0.1\n")
    assert switch() == TransportFaults(stall_every=2, stall_s=0.1)


def test_one_retry_policy_backs_off_exponentially():
    assert RetryPolicy(3, 0.05).delays() == [0.05, 0.1, 0.2]
    assert list(RetryPolicy(0, 0.05).tries()) == [0]
    assert list(RetryPolicy(2, 0.0).tries()) == [0, 1, 2]
