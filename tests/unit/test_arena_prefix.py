"""A kvpool's arena made as it is used (`cache.kv_ahead_mb`): the file holds memory only for the blocks
made; the pool grants no block past them and makes more ahead as grants climb, at once when short; a
failure to get memory (a full tmpfs) means fewer blocks granted, never a page that kills its toucher; a
worker populates its mapping only as far as the pool made the arena; and a restarted pool makes what is
in use again before it serves."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
import uuid
from pathlib import Path

import pytest

from steadfast.config import Config
from steadfast.kv.arena import grants as arena_prefix
from steadfast.kv.arena.arena import KVArena
from steadfast.kv.arena.grants import Reserved, spans
from steadfast.kv.arena.spec import ArenaSpec
from steadfast.kv.ledger.open import sqlite_url
from steadfast.kv.pool.daemon import KVPool
from steadfast.wire.pool import PoolGrant, PoolRegister

pytestmark = pytest.mark.unit

# 2 layers x K/V x 2 heads = 8 planes; a block is 16 x 64 x 4 B = one page of each plane: 32 KiB.
SPEC = ArenaSpec(256, 2, 16, 2, 64, "float32")
PAGE = mmap.PAGESIZE


def file_bytes(path: str) -> int:
    """Memory the file holds (its allocated blocks)."""
    return os.stat(path).st_blocks * 512


def wait_for(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def cfg() -> Config:
    # Ahead: 64 blocks (2 MiB), the grant batch below it.
    return Config().replace(cache={"kv_ahead_mb": 2, "pool_grant_batch": 8})


@pytest.fixture
def arena_path():
    path = f"/dev/shm/steadfast-prefixtest-{os.getpid()}-{uuid.uuid4().hex[:8]}.kv"
    yield path
    for thread in threading.enumerate():  # its pages made resident: done before this test's log is closed
        if thread.name == "arena-resident":
            thread.join(timeout=10)
    ledger = str(Path(path).with_suffix(".db"))  # the tests' SQLite ledger beside it, and its WAL files
    for p in (path, path + ".json", ledger, ledger + "-wal", ledger + "-shm"):
        Path(p).unlink(missing_ok=True)


def register(pool: KVPool, worker: str) -> int:
    return pool.handle(PoolRegister(worker, os.getpid())).epoch


def test_spans_hold_exactly_the_blocks_in_every_plane():
    strip = SPEC.block_bytes // 8  # one block in one plane
    plane = strip * SPEC.num_blocks
    assert spans(SPEC, 3, 5) == [(p * plane + 3 * strip, 2 * strip) for p in range(8)]
    assert spans(SPEC, 0, SPEC.num_blocks) == [(0, SPEC.nbytes)]  # the planes touch: one span
    assert spans(SPEC, 5, 5) == []
    # A block smaller than a page: widened to whole pages, never past the file.
    small = ArenaSpec(100, 1, 4, 1, 8, "bfloat16")  # 64 B a block, two planes of 6400 B
    assert PAGE == 4096
    assert spans(small, 1, 2) == [(0, 8192)]  # bytes 64 and 6464: pages 0 and 1, which touch
    assert spans(small, 99, 100) == [(4096, 4096), (12288, 512)]  # not past the file's 12800 bytes


def test_the_pool_holds_memory_for_what_is_granted_and_ahead_only(cfg, arena_path):
    pool = KVPool(cfg, arena_path, sqlite_url(Path(arena_path).with_suffix(".db")), SPEC)
    try:
        ahead = 64
        assert pool.made == ahead
        assert file_bytes(arena_path) == ahead * SPEC.block_bytes  # not the 8 MiB of the whole arena
        epoch = register(pool, "w0")
        got: list[int] = []
        for _ in range(12):  # 96 blocks: past the first 64 made
            reply = pool.handle(PoolGrant("w0", epoch, 8))
            assert reply.ok and len(reply.block_ids) == 8
            assert max(reply.block_ids) < reply.made  # never a block without memory
            got += reply.block_ids
        assert got == list(range(96))  # lowest first: the blocks in use stay a prefix
        wait_for(lambda: pool.made >= 96 + ahead)  # the background keeps `ahead` made past them
        assert pool.made == 96 + ahead
        assert file_bytes(arena_path) == (96 + ahead) * SPEC.block_bytes
    finally:
        pool.close()


def test_a_full_tmpfs_means_fewer_blocks_granted_and_a_warning(cfg, arena_path, monkeypatch, caplog):
    pool = KVPool(cfg, arena_path, sqlite_url(Path(arena_path).with_suffix(".db")), SPEC)
    try:
        epoch = register(pool, "w0")
        assert len(pool.handle(PoolGrant("w0", epoch, 60)).block_ids) == 60

        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(arena_prefix.os, "posix_fallocate", full)
        with caplog.at_level(logging.WARNING, logger=arena_prefix.__name__):
            reply = pool.handle(PoolGrant("w0", epoch, 8))
        assert reply.block_ids == [60, 61, 62, 63] and reply.made == 64  # what was made, no more
        assert "not made" in caplog.text and "No space left" in caplog.text
        assert pool.handle(PoolGrant("w0", epoch, 8)).block_ids == []  # short: the engine waits or preempts
        # Memory back (and the retry delay passed): grants go on past the old end.
        monkeypatch.undo()
        monkeypatch.setattr(arena_prefix, "RETRY_S", 0.0)
        reply = pool.handle(PoolGrant("w0", epoch, 8))
        assert reply.block_ids == list(range(64, 72)) and reply.made >= 72
    finally:
        pool.close()


def test_a_restarted_pool_makes_the_blocks_in_use_before_it_serves(cfg, arena_path):
    db = sqlite_url(Path(arena_path).with_suffix(".db"))
    pool = KVPool(cfg, arena_path, db, SPEC)
    epoch = register(pool, "w0")
    for _ in range(12):
        pool.handle(PoolGrant("w0", epoch, 8))
    pool.close()
    again = KVPool(cfg, arena_path, db, SPEC)
    try:
        assert again.made == 96 + 64  # in use, and ahead of them
    finally:
        again.close()


def test_with_no_ahead_the_whole_arena_is_reserved_at_start(arena_path):
    pool = KVPool(Config().replace(cache={"kv_ahead_mb": 0}), arena_path, sqlite_url(arena_path + ".db"), SPEC)
    try:
        assert pool.made == 0 and pool.reserved is None  # 0: every block has its memory
        assert file_bytes(arena_path) >= SPEC.nbytes
        epoch = register(pool, "w0")
        assert len(pool.handle(PoolGrant("w0", epoch, SPEC.num_blocks)).block_ids) == SPEC.num_blocks
    finally:
        pool.close()
        Path(arena_path + ".db").unlink(missing_ok=True)


def test_a_worker_populates_only_what_the_pool_made(cfg, arena_path):
    pool = KVPool(cfg, arena_path, sqlite_url(Path(arena_path).with_suffix(".db")), SPEC)
    try:
        arena = KVArena.attach(arena_path)
        assert arena.prefix is not None  # a hole past what is made: not populated whole
        arena.populate_to(pool.made)
        wait_for(lambda: arena.prefix.made == 64)
        arena.tensor[:, :, :, :64] = 1.0  # every made block writable here
        assert file_bytes(arena_path) == 64 * SPEC.block_bytes  # and no page more taken
        # A whole arena (made at start, or made whole by use) is populated whole, as before.
        whole = Reserved(os.open(arena_path, os.O_RDWR), SPEC, "test")
        whole.ensure(SPEC.num_blocks)
        assert KVArena.attach(arena_path).prefix is None
        os.close(whole.fd)
    finally:
        pool.close()
