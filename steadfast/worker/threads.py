"""How many threads a worker computes with, following the CPU that other processes leave it.

A worker's kernels run an OpenMP team that meets at a barrier after every layer's parts (~180 a
token). When another process keeps a core busy, the team's thread on that core is preempted and the
other spins at the barrier for it: with two CPU-bound processes beside the default server (2 threads,
2 cores), one step in ~20 took ~1.4 s, and the hardware's solo TPOT read 450-1,280 ms; on one thread the
same machine gave 4.8-5.1 ms and no step over 20 ms. So a worker whose threads are its own choice
(`server.threads_per_worker: 0` and no STEADFAST_THREADS) computes on the cores the others leave free,
at least one, and takes a core back once it has stayed free a few seconds.

Outputs do not change with the thread count: every kernel gives each output to one thread (tested).

The others' load is read from /proc/stat (the cores this process may run on): time in user, system,
interrupts and steal, less this process's own; the router's among them. Niced time is left out: a
niced process takes little from the team and yields at once.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

log = logging.getLogger("steadfast.worker")

# A core counts as taken once others use more than half of it: below, the team's preempted thread
# waits only now and then (the pool daemon's beats, a router between bursts).
SLACK = 0.5
# Seconds over which the others' load is averaged before a decision.
WINDOW_S = 1.0
# Windows in a row that must leave a core free before the team grows again: shrinking is urgent (a
# barrier stall costs seconds), growing is not (one thread already does ~the memory-bound decode).
GROW_AFTER = 3
# /proc/stat's columns, after the CPU's name: user nice system idle iowait irq softirq steal.
BUSY_COLUMNS = (0, 2, 5, 6, 7)


def threads_for(others: float, cores: int, most: int) -> int:
    """Threads that fit the cores left when others use `others` cores (averaged), from 1 to `most`."""
    return max(1, min(most, math.floor(cores - others + SLACK)))


class ThreadPolicy:
    """The thread count over windows of measured load: down at once, up only after GROW_AFTER windows
    in a row that leave room. Pure."""

    def __init__(self, cores: int, most: int) -> None:
        self.cores = cores
        self.most = most
        self.threads = most
        self._roomy = 0

    def observe(self, others: float) -> int | None:
        """One window's others' load (cores); the new thread count when it changes."""
        fits = threads_for(others, self.cores, self.most)
        if fits < self.threads:
            self._roomy = 0
            self.threads = fits
            return fits
        if fits == self.threads:
            self._roomy = 0
            return None
        self._roomy += 1
        if self._roomy < GROW_AFTER:
            return None
        self._roomy = 0
        self.threads += 1  # one at a time: each core taken back has to stay free on its own
        return self.threads


def others_cpu_seconds(cpus: set[int]) -> float | None:
    """CPU seconds that processes other than this one spent at nice 0 or below on `cpus` since boot
    (None: no /proc/stat to read)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            lines = f.readlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        columns = rest.split()
        ticks += sum(int(columns[i]) for i in BUSY_COLUMNS if i < len(columns))
    total = ticks / os.sysconf("SC_CLK_TCK")
    if os.getpriority(os.PRIO_PROCESS, 0) <= 0:  # a niced worker's own time is in the nice column
        own = os.times()
        total -= own.user + own.system
    return total


class ThreadGovernor:
    """Reads the others' load every WINDOW_S and sets the worker's thread count (`apply`) by the policy."""

    def __init__(
        self,
        most: int,
        apply: Callable[[int], None],
        cpus: set[int] | None = None,
        read: Callable[[set[int]], float | None] = others_cpu_seconds,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cpus = cpus if cpus is not None else os.sched_getaffinity(0)
        self.policy = ThreadPolicy(len(self.cpus), most)
        self.apply = apply
        self.read = read
        self.clock = clock
        self.others = 0.0  # the last window's others' load, in cores
        self._last = (clock(), read(self.cpus))

    @property
    def threads(self) -> int:
        return self.policy.threads

    def tick(self) -> None:
        """Called from the worker's loop as often as it likes; acts once a window."""
        now = self.clock()
        then, before = self._last
        if now - then < WINDOW_S:
            return
        seconds = self.read(self.cpus)
        self._last = (now, seconds)
        if seconds is None or before is None:
            return
        self.others = max(0.0, (seconds - before) / (now - then))
        changed = self.policy.observe(self.others)
        if changed is not None:
            log.info(
                "computing on %d thread(s): other processes use %.1f of %d cores",
                changed,
                self.others,
                self.policy.cores,
            )
            self.apply(changed)
