"""An arena's mapping populated ahead of use: nothing in the file changes, even while a worker writes
into it meanwhile, every chunk (the last one short) is done, a kernel without `MADV_POPULATE_WRITE`
still gets the file's pages made, and a failure is logged by the background thread, which closes its own
descriptor either way."""

from __future__ import annotations

import errno
import logging
import mmap
import os

import pytest
import torch

from steadfast.kv.arena import files as arena_file
from steadfast.kv.arena import resident

pytestmark = pytest.mark.unit

NBYTES = 64 * mmap.PAGESIZE + 512  # not a whole number of pages


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def new_file(tmp_path, monkeypatch):
    """A file made as an arena's is (reserved, not written), mapped as the arena maps it, and its fd."""
    monkeypatch.setattr(resident, "CHUNK_BYTES", 3 * mmap.PAGESIZE)  # many chunks, the last one short
    path = str(tmp_path / "a.kv")
    fd = arena_file.create(path, NBYTES)
    yield torch.from_file(path, shared=True, size=NBYTES // 4, dtype=torch.float32), fd
    os.close(fd)


@pytest.mark.parametrize("kernel", ["populate", "before 5.14"])
def test_no_byte_changes_while_a_worker_writes(new_file, monkeypatch, caplog, kernel):
    flat, fd = new_file
    if kernel != "populate":

        def refused(tensor):
            raise OSError(errno.EINVAL, "no MADV_POPULATE_WRITE")

        monkeypatch.setattr(resident, "populate", refused)
    flat[::7] = 1.5
    before = open_fds()
    with caplog.at_level(logging.INFO, logger=resident.__name__):
        thread = resident.make_resident(flat, fd, "test")
        flat[3::7] = -2.0  # a worker writing while the pages are made resident
        thread.join(30)
    assert "KV arena test: 0 MiB resident in" in caplog.text
    assert not thread.is_alive() and open_fds() == before  # its duplicate closed
    assert (flat[::7] == 1.5).all() and (flat[3::7] == -2.0).all()
    assert int((flat != 0).sum()) == len(flat[::7]) + len(flat[3::7])


def test_a_failure_is_logged_not_raised(new_file, monkeypatch, caplog):
    flat, fd = new_file
    monkeypatch.setattr(resident, "populate", lambda tensor: (_ for _ in ()).throw(OSError(errno.ENOMEM, "no")))
    with caplog.at_level(logging.WARNING, logger=resident.__name__):
        resident.make_resident(flat, fd, "short").join(30)
    assert "pages not made resident ahead of use" in caplog.text
    wrong = os.open(os.devnull, os.O_WRONLY)  # not readable: no mapping of it is allowed
    try:
        with pytest.raises(OSError, match="mapping bytes 0"):
            resident.fault_in(wrong, 4096)
    finally:
        os.close(wrong)
