"""Building the C kernels in `csrc/`: compiled on first use with the system C compiler for the CPU it
runs on, into a cache keyed by the source, the compiler and the CPU's flags, sharing torch's OpenMP
runtime (both link `libgomp.so.1`; torch's copy is the one loaded). A library is loaded only from a
folder only this user can write, and is written under a private name and renamed, so processes starting
together never load half a file."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from steadfast.config.env import kernel_cache_dir

log = logging.getLogger(__name__)

CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _ours_alone(path: Path, kind: Callable[[int], bool]) -> bool:
    """Whether `path` is of `kind` (never a symlink), owned by us and writable by nobody else."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return kind(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def build(source: Path, what: str, linked: tuple[Path, ...] = ()) -> Path | None:
    """The shared library of `source` (with the kernels of `linked` compiled into it) for this machine,
    compiled unless already cached; None (with a warning naming `what`, which then stays on torch) where
    there is no compiler or it fails."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler: %s stays on the torch path", what)
        return None
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    # The headers beside the source count too: an edited `bf16.h` rebuilds every kernel (a few, small).
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]
    texts = [p.read_text() for p in (source, *linked)]
    key = hashlib.sha256("\0".join([*texts, *headers, version, " ".join(CFLAGS), _cpu_flags()]).encode())
    name = f"{source.stem}-{key.hexdigest()[:16]}.so"
    # The user's cache first; a private temporary directory where that cannot be written. A library
    # found where someone else could have put it is anyone's code: such a folder is passed over.
    for folder in (kernel_cache_dir(), Path(tempfile.gettempdir()) / f"steadfast-kernels-{os.getuid()}"):
        target = folder / name
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            continue
        if not _ours_alone(folder, stat.S_ISDIR):
            log.warning("%s is not a folder only this user can write: no kernel kept there is loaded", folder)
            continue
        if _ours_alone(target, stat.S_ISREG):
            return target
        if os.path.lexists(target):
            log.warning("%s is a symlink, another user's or writable by others: not loaded", target)
            continue
        try:
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        except OSError:
            continue
        os.close(fd)
        done = subprocess.run(
            [compiler, *CFLAGS, "-o", tmp, *map(str, (source, *linked))], capture_output=True, text=True
        )
        if done.returncode != 0:
            os.unlink(tmp)
            log.warning("%s kernel did not compile; %s stays on torch:\n%s", source.name, what, done.stderr)
            return None
        os.chmod(tmp, 0o700)  # the linker's mode follows the umask, which may let the group write
        os.replace(tmp, target)
        return target
    log.warning("nowhere to write the %s kernel; %s stays on the torch path", source.name, what)
    return None


def load_library(source: Path, what: str, supported: str, linked: tuple[Path, ...] = ()) -> ctypes.CDLL | None:
    """`source` (and `linked`) built and loaded where it runs here: None without a compiler, or where its
    function `supported()` says this CPU lacks what it needs (AVX-512), `what` then staying on torch."""
    flags = _cpu_flags()
    if flags.startswith("flags") and "avx512f" not in flags.split():
        # Every kernel needs AVX-512F; most do not even compile without it (-march=native), and a failed
        # build is not cached: ~2 s of compiler a process start, a traceback-like log each time.
        log.info("this CPU has no AVX-512: %s stays on the torch path", what)
        return None
    path = build(source, what, linked)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    if not getattr(lib, supported)():
        log.info("this CPU has no AVX-512: %s stays on the torch path", what)
        return None
    return lib
