"""Fault an arena's pages in once, in the background, so that no step pays for them later.

Two costs hide in a fresh mapping of the arena file, both paid on a page's first touch, and both land on
the critical path of whoever touches it first: a prefill writing its KV, a migration's receiver writing
its final round while the request is paused, the first step of a request adopted or migrated here.

- A new file's pages: `posix_fallocate` on a tmpfs reserves them but leaves them unwritten; the first
  touch zeroes each one, and on a virtual machine whose memory the host backs lazily that costs ~3 µs per
  KiB (measured on this project's machines: 300 MB/s against 1.5 GB/s for a page already made).
- Each process's own page tables: a page made by another process still faults once in this one (reading
  a 512-token request's KV took 31 ms in a process new to its pages, 9 ms after they were populated).

So every process that maps a reserved-whole arena has its mapping populated here (`MADV_POPULATE_WRITE`:
the page tables filled as a write would fill them, no byte read or written), which makes the file's pages
on the way. The calls go through ctypes, which lets go of the GIL, in small chunks (`pages.py`), from a
thread of its own at normal priority: each call holds the process's mmap_lock, and a thread starved at
idle priority inside one stalled the engine thread's allocations for seconds. A kvpool's arena made as
it is used is populated as far as it is made instead (`grants.py`).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

import torch

from steadfast.kv.arena import pages

log = logging.getLogger(__name__)

CHUNK_BYTES = pages.CHUNK_BYTES  # populated per call: bounds how long one call runs


def populate(tensor: torch.Tensor) -> None:
    """This process's mapping under `tensor` (a whole file mapping, page aligned) populated, blocking.
    OSError if the kernel refuses (EINVAL: older than 5.14)."""
    pages.populate_range(tensor.data_ptr(), tensor.numel() * tensor.element_size(), CHUNK_BYTES)


def fault_in(fd: int, nbytes: int) -> None:
    """Every page of the first `nbytes` of file `fd` made (read faults through a mapping of its own:
    any kernel), blocking; this process's mapping of the arena is not populated by it."""
    pages.fault_in(fd, nbytes, CHUNK_BYTES)


def make_resident(tensor: torch.Tensor, fd: int, name: str) -> threading.Thread:
    """`populate(tensor)` on a thread of its own; where the kernel has no `MADV_POPULATE_WRITE`, the
    file's pages are made at least (`fault_in` on a duplicate of `fd`: the caller may close its own)."""
    own = os.dup(fd)

    def run() -> None:
        # At normal priority, in small calls (`pages.CHUNK_BYTES`): at idle priority this thread, preempted
        # inside a call, held the mmap_lock the engine thread's allocations need (a 13 s stall measured).
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
