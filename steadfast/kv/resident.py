"""Fault a new arena file's pages in once, in the background, so that no step pays for them later.

`posix_fallocate` on a tmpfs reserves the pages but leaves them unwritten: the first touch of each one
zeroes it, and on a virtual machine whose memory the host backs lazily that touch costs ~3 µs per KiB
(measured on this project's machines: 300 MB/s against 1.5 GB/s for a page already made). Untouched,
that cost lands on the critical path of whoever uses a block first: a prefill writing its KV, a
migration's receiver writing a final round during the request's pause. The pages are faulted in here,
read-only (nothing in the file can change), through `mmap(MAP_POPULATE)` in chunks called through
ctypes, which lets go of the GIL, at the lowest CPU priority: the process owning the arena keeps serving
and the workers starting beside it keep loading meanwhile.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
import time

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20  # mapped at once: bounds what this thread holds mapped
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)  # Linux; the module lacks it before Python 3.10
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def fault_in(fd: int, nbytes: int) -> None:
    """Every page of the first `nbytes` of file `fd`, made resident (blocking). OSError if a chunk
    cannot be mapped."""
    for offset in range(0, nbytes, CHUNK_BYTES):
        n = min(CHUNK_BYTES, nbytes - offset)
        addr = _libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_POPULATE, fd, offset)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mapping bytes {offset}+{n}: {os.strerror(err)}")
        _libc.munmap(addr, n)


def fault_in_background(fd: int, nbytes: int, name: str) -> threading.Thread:
    """`fault_in` on a thread of its own, with a duplicate of `fd` (the caller may close its own)."""
    own = os.dup(fd)

    def run() -> None:
        # Idle priority for this thread alone (on Linux a thread id names one thread): workers loading
        # their model, or serving, come first; the pages are only needed before their first use.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        t0 = time.perf_counter()
        try:
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
