"""Page-level calls on a file mapping, through ctypes (which lets go of the GIL) and torch-free, so the
kvpool daemon can use them: populate a range of this process's mapping, fault a file's pages in."""

from __future__ import annotations

import ctypes
import mmap
import os

MADV_POPULATE_WRITE = 23  # Linux 5.14 (not in Python's mmap module before 3.13)
# Per call, small: a call holds this process's mmap_lock, so an allocation (mmap) on the engine thread
# waits for it, and page faults queue behind that. With 64 MiB calls at idle priority on two busy cores an
# engine stalled for 13 s (`populated` thread preempted inside its call); with 4 MiB at normal priority,
# 12 ms at worst.
CHUNK_BYTES = 4 << 20
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def populate_range(start: int, nbytes: int, chunk: int = CHUNK_BYTES) -> None:
    """This process's mapping of `nbytes` at address `start` (page aligned) populated as a write would
    (`MADV_POPULATE_WRITE`: page tables filled, no byte read or written), blocking, `chunk` bytes a call.
    OSError if the kernel refuses (EINVAL: older than 5.14; ENOMEM: no memory to back a page)."""
    for offset in range(0, nbytes, chunk):
        if _libc.madvise(start + offset, min(chunk, nbytes - offset), MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"populating bytes {offset}+: {os.strerror(err)}")


def fault_in(fd: int, nbytes: int, chunk: int = CHUNK_BYTES) -> None:
    """Every page of the first `nbytes` of file `fd` made (read faults through a mapping of its own:
    any kernel), blocking; this process's own mappings of the file are not populated by it."""
    for offset in range(0, nbytes, chunk):
        n = min(chunk, nbytes - offset)
        addr = _libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_POPULATE, fd, offset)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mapping bytes {offset}+{n}: {os.strerror(err)}")
        _libc.munmap(addr, n)
