"""Fault an arena's pages in once, in the background, so that no step pays for them later.

Two costs hide in a fresh mapping of the arena file, both paid on a page's first touch, and both land on
the critical path of whoever touches it first: a prefill writing its KV, a migration's receiver writing
its final round while the request is paused, the first step of a request adopted or migrated here.

- A new file's pages: `posix_fallocate` on a tmpfs reserves them but leaves them unwritten; the first
  touch zeroes each one, and on a virtual machine whose memory the host backs lazily that costs ~3 µs per
  KiB (measured on this project's machines: 300 MB/s against 1.5 GB/s for a page already made).
- Each process's own page tables: a page made by another process still faults once in this one (reading
  a 512-token request's KV took 31 ms in a process new to its pages, 9 ms after they were populated).

So every process that maps the arena has its mapping populated here (`MADV_POPULATE_WRITE`: the page
tables filled as a write would fill them, no byte read or written), which makes the file's pages on the
way. The calls go through ctypes, which lets go of the GIL, in chunks, from a thread of its own at the
lowest CPU priority: the process keeps serving and the workers starting beside it keep loading.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
import time

import torch

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20  # populated per call: bounds how long one call runs
MADV_POPULATE_WRITE = 23  # Linux 5.14 (not in Python's mmap module before 3.13)
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def populate(tensor: torch.Tensor) -> None:
    """This process's mapping under `tensor` (a whole file mapping, page aligned) populated, blocking.
    OSError if the kernel refuses (EINVAL: older than 5.14)."""
    start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    for offset in range(0, nbytes, CHUNK_BYTES):
        if _libc.madvise(start + offset, min(CHUNK_BYTES, nbytes - offset), MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"populating bytes {offset}+: {os.strerror(err)}")


def fault_in(fd: int, nbytes: int) -> None:
    """Every page of the first `nbytes` of file `fd` made (read faults through a mapping of its own:
    any kernel), blocking; this process's mapping of the arena is not populated by it."""
    for offset in range(0, nbytes, CHUNK_BYTES):
        n = min(CHUNK_BYTES, nbytes - offset)
        addr = _libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_POPULATE, fd, offset)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mapping bytes {offset}+{n}: {os.strerror(err)}")
        _libc.munmap(addr, n)


def make_resident(tensor: torch.Tensor, fd: int, name: str) -> threading.Thread:
    """`populate(tensor)` on a thread of its own; where the kernel has no `MADV_POPULATE_WRITE`, the
    file's pages are made at least (`fault_in` on a duplicate of `fd`: the caller may close its own)."""
    own = os.dup(fd)

    def run() -> None:
        # On Linux a thread id names one thread: only this one gets the idle priority.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        t0 = time.perf_counter()
        nbytes = tensor.numel() * tensor.element_size()
        try:
            try:
                populate(tensor)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                fault_in(own, nbytes)
        except OSError as exc:  # only slower first touches: the pages are reserved either way
            log.warning("KV arena %s: pages not made resident ahead of use: %s", name, exc)
        else:
            log.info("KV arena %s: %d MiB resident in %.1fs", name, nbytes >> 20, time.perf_counter() - t0)
        finally:
            os.close(own)

    thread = threading.Thread(target=run, name="arena-resident", daemon=True)
    thread.start()
    return thread
