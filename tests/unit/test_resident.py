"""A new arena's pages faulted in ahead of use: nothing in the file changes, even while a worker writes
into it meanwhile, every chunk (the last one short) is mapped, and a file it cannot map is a clear error,
logged by the background thread, which closes its own descriptor either way."""

from __future__ import annotations

import logging
import mmap
import os

import pytest
import torch

from steadfast.kv import arena_file, resident

pytestmark = pytest.mark.unit

NBYTES = 64 * mmap.PAGESIZE + 512  # not a whole number of pages


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_faulting_in_changes_no_byte_while_a_worker_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(resident, "CHUNK_BYTES", 3 * mmap.PAGESIZE)  # many chunks, the last one short
    path = str(tmp_path / "a.kv")
    fd = arena_file.create(path, NBYTES)  # reserved, not written: what a new arena is
    flat = torch.from_file(path, shared=True, size=NBYTES // 4, dtype=torch.float32)
    flat[::7] = 1.5
    try:
        before = open_fds()
        thread = resident.fault_in_background(fd, NBYTES, "test")
        flat[3::7] = -2.0  # a worker writing while the pages are faulted in
        thread.join(30)
        assert not thread.is_alive() and open_fds() == before  # its duplicate closed
        assert (flat[::7] == 1.5).all() and (flat[3::7] == -2.0).all()
        assert int((flat != 0).sum()) == len(flat[::7]) + len(flat[3::7])
    finally:
        os.close(fd)


def test_a_file_it_cannot_map_is_logged_not_raised(tmp_path, caplog):
    path = tmp_path / "short"
    path.write_bytes(b"x")
    fd = os.open(path, os.O_WRONLY)  # not readable: every mapping of it is refused
    try:
        with pytest.raises(OSError, match="mapping bytes 0"):
            resident.fault_in(fd, 4096)
        with caplog.at_level(logging.WARNING, logger=resident.__name__):
            resident.fault_in_background(fd, 4096, "short").join(30)
        assert "pages not made resident ahead of use" in caplog.text
    finally:
        os.close(fd)
