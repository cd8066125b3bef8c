"""The arena's files on disk: made private (mode 0600, never over an existing path or through a symlink)
with their space reserved, and opened only while they are still private.

Reserving matters because the arena lives in a tmpfs: a sparse file larger than the free space maps
fine and then kills its process with SIGBUS on the first page that cannot be backed, long after start-up.
So a file is reserved whole when made, or, the kvpool's node arena, made a hole whose pages the pool
reserves before it grants the blocks on them (`grants.py`): no process touches an unreserved page.
This module never maps anything (that is `arena.py`) and never chooses the folder (the launcher's).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import stat
from dataclasses import asdict
from pathlib import Path

from steadfast.kv.arena.spec import ArenaSpec

_NEW = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class ArenaSpaceError(RuntimeError):
    """The arena's folder cannot hold it: raised at creation, naming the bytes needed and free."""


def free_bytes(folder: str) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def check_space(folder: str, nbytes: int, what: str = "the KV arena") -> None:
    """Raise ArenaSpaceError if `folder`'s filesystem has fewer than `nbytes` free."""
    free = free_bytes(folder)
    if nbytes > free:
        raise ArenaSpaceError(_no_room(what, folder, nbytes, free))


def _no_room(what: str, folder: str, nbytes: int, free: int) -> str:
    return (
        f"not enough space for {what} in {folder}: {nbytes / 2**20:.0f} MiB needed, {free / 2**20:.0f} MiB free "
        "(lower cache.kv_memory_mb or cache.num_blocks, or point cache.arena_dir at a larger filesystem)"
    )


def create(path: str, nbytes: int, reserve: bool = True) -> int:
    """Make the file at `path` with all `nbytes` reserved and return it open read-write. Refused if
    anything is at `path` already, a symlink included; nothing is left behind on failure.
    `reserve=False`: the file is a hole of that size (the folder must have room for it now), whose
    pages its owner reserves as they are needed (`arena_prefix.Reserved`)."""
    folder = os.path.dirname(path) or "."
    check_space(folder, nbytes)
    fd = os.open(path, _NEW | os.O_RDWR, 0o600)
    try:
        if reserve:
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, nbytes)
    except BaseException as exc:
        os.close(fd)
        os.unlink(path)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG):
            raise ArenaSpaceError(_no_room("the KV arena", folder, nbytes, free_bytes(folder))) from None
        raise
    return fd


def spec_path(path: str) -> str:
    """Where the arena at `path` keeps its spec (its shape and dtype, JSON)."""
    return path + ".json"


def make_arena(path: str, nbytes: int, spec_json: str, reserve: bool = True) -> int:
    """A new arena file with its spec, as `KVArena.create` makes them but not mapped (the launcher, which
    makes a worker's private arena, and the kvpool must not import torch: workers map it). Returns the
    file open read-write (`reserve`: as `create`)."""
    fd = create(path, nbytes, reserve)
    try:
        write_private(spec_path(path), spec_json)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


def write_private(path: str, text: str) -> None:
    """Write a new file only we can read (refused if anything is at `path`)."""
    fd = os.open(path, _NEW | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def open_private(path: str, flags: int = os.O_RDONLY) -> int:
    """Open the file at `path`, refused unless it is a regular file (not a symlink) owned by us that
    neither group nor others can open: another user's file could hold or read anyone's KV."""
    try:
        # O_NONBLOCK: a FIFO put at the path must not hang us (no effect on a regular file).
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermissionError(f"{path} is a symbolic link; refusing it") from None
        raise
    problem = _refusal(os.fstat(fd))
    if problem:
        os.close(fd)
        raise PermissionError(f"{path} {problem}; refusing it")
    return fd


def _refusal(st: os.stat_result) -> str:
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not {os.geteuid()}"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o} (group or others may open it)"
    return ""


def read_private(path: str) -> str:
    with os.fdopen(open_private(path), "r") as f:
        return f.read()


def open_arena(path: str, flags: int = os.O_RDONLY) -> tuple[ArenaSpec, int]:
    """The spec of the arena another process of ours made at `path` and its file open with `flags`, once
    both files are found private to us and the file's size is the one the spec says (the caller maps,
    or closes, that very descriptor: the path cannot be swapped in between); refused otherwise."""
    try:
        spec = ArenaSpec(**json.loads(read_private(spec_path(path))))
    except FileNotFoundError:
        raise FileNotFoundError(f"no KV arena at {path}") from None
    fd = open_private(path, flags)
    size = os.fstat(fd).st_size
    if size != spec.nbytes:
        os.close(fd)
        raise ValueError(f"KV arena {path} is {size} bytes, its spec says {spec.nbytes}")
    return spec, fd


def tier_spec(arena: ArenaSpec, slots: int) -> ArenaSpec:
    """The tier's spec: the arena's block shape, `slots` of them."""
    return dataclasses.replace(arena, num_blocks=slots)


def make_tier(path: str, spec: ArenaSpec) -> ArenaSpec:
    """Make the tier's file (0600, space reserved), or re-attach the one a previous incarnation of the
    pool made with this spec (its slots' bytes are what the ledger describes). Torch-free."""
    if Path(path).exists():
        found, fd = open_arena(path)
        os.close(fd)
        if found != spec:
            raise ValueError(f"the offload tier at {path} is {found}, not {spec}")
        return found
    os.close(make_arena(path, spec.nbytes, json.dumps(asdict(spec))))
    return spec


def remove_tier(path: str) -> None:
    for p in (path, spec_path(path)):
        Path(p).unlink(missing_ok=True)
