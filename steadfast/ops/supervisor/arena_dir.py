"""The launcher's private folder for its arena files, and the sweep of folders whose launcher is gone.

Each `steadfast serve` keeps its arenas in `<cache.arena_dir>/steadfast-<uid>-<pid>-<random>/`, mode 0700,
and holds an flock on that folder for as long as it lives. The kernel drops the lock however the launcher
ends (SIGKILL included) and no child inherits it, so a folder whose lock can be taken belongs to nobody:
the next launcher of the same user removes it, instead of leaving a 1 GiB arena in /dev/shm per crash.
The launcher's run folder (sockets, ledgers, wire keys) in the temp dir is one of these too.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass

log = logging.getLogger(__name__)

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _prefix() -> str:
    return f"steadfast-{os.geteuid()}-"


@dataclass
class ArenaDir:
    path: str
    _lock: int  # the folder itself, open and flocked while this launcher lives

    @classmethod
    def create(cls, parent: str) -> ArenaDir:
        """Sweep `parent` of dead launchers' folders, then make and lock this launcher's own."""
        os.makedirs(parent, mode=0o700, exist_ok=True)
        sweep(parent)
        for _ in range(5):
            path = tempfile.mkdtemp(prefix=f"{_prefix()}{os.getpid()}-", dir=parent)  # 0700, a fresh name
            fd = _lock_if_free(path)
            if fd is not None:
                return cls(path, fd)
            # Another launcher's sweep took it in the instant before our lock (it was unlocked): again.
        raise OSError(f"could not make a private arena folder in {parent}")

    def release(self) -> None:
        """Remove the folder and everything in it (a normal exit)."""
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock)


def _lock_if_free(path: str) -> int | None:
    """The folder at `path`, open and exclusively locked, if it is ours and nobody holds its lock."""
    try:
        fd = os.open(path, _OPEN_DIR)
    except OSError:
        return None
    st = os.fstat(fd)
    if st.st_uid == os.geteuid():
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            now = os.lstat(path)
            # Still the folder at `path`: a sweep may have removed it between our open and our lock.
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                return fd
        except OSError:
            pass
    os.close(fd)
    return None


def sweep(parent: str) -> list[str]:
    """Remove the folders in `parent` that this user's launchers made and no live launcher holds;
    return their paths. Anything else (another user's, a symlink, a held lock) is left alone."""
    pattern = re.compile(re.escape(_prefix()) + r"\d+-[A-Za-z0-9_]+")
    removed = []
    for name in sorted(os.listdir(parent)):
        path = os.path.join(parent, name)
        try:
            if not pattern.fullmatch(name) or not stat.S_ISDIR(os.lstat(path).st_mode):
                continue
        except OSError:
            continue
        fd = _lock_if_free(path)
        if fd is None:
            continue
        try:
            shutil.rmtree(path)
            removed.append(path)
            log.info("removed %s, left by a launcher that is gone", path)
        except OSError as exc:
            log.warning("could not remove stale arena folder %s: %s", path, exc)
        finally:
            os.close(fd)
    return removed
