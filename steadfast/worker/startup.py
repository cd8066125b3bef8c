"""A worker's start to ready, by phase: what a replacement makes its node wait for, logged once it is
ready, so that a slow start says where its time went (interpreter and imports, model, KV, warm-up)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from pathlib import Path


def trim_heap() -> None:
    """Hand the C heap's free pages back to the kernel (glibc `malloc_trim`). Once a large block has
    been freed, glibc serves blocks that size from its heap and keeps them when freed: a worker that
    built the model (or warmed up) would otherwise hold hundreds of MiB it no longer uses."""
    name = ctypes.util.find_library("c")
    if name:
        libc = ctypes.CDLL(name)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)


def since_process_start() -> float:
    """Seconds since this process began (exec, interpreter start and imports included), from /proc."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start time after boot, in ticks
    return max(0.0, float(Path("/proc/uptime").read_text().split()[0]) - started)


class StartupPhases:
    """Phases timed one after another from the process's start; the first is everything before it."""

    def __init__(self, first: str = "interpreter and imports") -> None:
        self.phases: list[tuple[str, float]] = [(first, since_process_start())]
        self._since = time.perf_counter()

    def mark(self, name: str) -> None:
        """The phase `name` ends now (it began when the last one ended)."""
        now = time.perf_counter()
        self.phases.append((name, now - self._since))
        self._since = now

    @property
    def total(self) -> float:
        return sum(seconds for _, seconds in self.phases)

    def summary(self) -> str:
        return ", ".join(f"{name} {seconds:.1f}s" for name, seconds in self.phases)
