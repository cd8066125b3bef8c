"""The supervisor's side of the worker zygote (worker/zygote.py): start it, ask it for workers, and hold
each forked worker like a `subprocess.Popen`. Torch-free, as the supervisor is.

The supervisor is a child subreaper (`become_subreaper`): a forked worker, whose middle parent exits at
once, becomes the supervisor's own child, reaped and read (exit code) like the ones it execs. The
socket pair to the zygote is this process's alone (inherited by nobody else), one message per packet.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Protocol

from steadfast.util.proc import process_gone
from steadfast.wire.codec import encode
from steadfast.wire.zygote import ForkWorker, WorkerForked, ZygoteReady, decode_from_zygote

log = logging.getLogger("steadfast.launcher")

_PR_SET_CHILD_SUBREAPER = 36
MAX_PACKET = 4096  # the zygote's answers are a pid or a short error
FORK_TIMEOUT_S = 5.0  # a fork answers in milliseconds; past this the zygote is taken as stuck


class Process(Protocol):
    """What the supervisor uses of a child process, whether it exec'd it or the zygote forked it."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


def become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (Linux ≥ 3.4); False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except OSError:
        return False


class ForkedWorker:
    """A worker the zygote forked, now this process's child: reaped with waitpid like a Popen's."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not ours after all (no subreaper): its code cannot be known
                self.returncode = -1 if process_gone(self.pid) else None
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped yet, so the pid is still this process's
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def reap_orphans(known: set[int]) -> int:
    """Reap this subreaper's exited children that it did not start (a dead worker's own children,
    adopted), leaving the `known` ones to their handles; return how many. A zombie is never reaped by
    waitpid(-1), which would take a known child's exit code from its handle."""
    me, reaped = os.getpid(), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in known:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == me:
            try:
                os.waitpid(int(entry), os.WNOHANG)
                reaped += 1
            except ChildProcessError:
                pass
    return reaped


class ZygoteState(enum.Enum):
    STARTING = "starting"  # importing torch, building the model
    READY = "ready"  # forks workers
    GONE = "gone"  # exited, failed or stuck: workers are exec'd until a new one is ready


class Zygote:
    """One zygote process and the supervisor's end of its socket."""

    def __init__(self, cfg_json: str, weights_dir: str) -> None:
        self.cfg_json = cfg_json
        self.weights_dir = weights_dir
        self.state = ZygoteState.GONE
        self.was_ready = False  # the current process has been ready (a restart is then worth it)
        self.proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None

    def start(self) -> subprocess.Popen[bytes]:
        """Start a zygote (it reports ready once its model is built); return its process."""
        self.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [
            sys.executable,
            "-m",
            "steadfast.worker.zygote",
            "--config-json",
            self.cfg_json,
            "--weights-dir",
            self.weights_dir,
            "--control-fd",
            str(theirs.fileno()),
        ]
        try:
            self.proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), process_group=0)
        finally:
            theirs.close()
        self._sock, self.state, self.was_ready = ours, ZygoteState.STARTING, False
        return self.proc

    def ready(self, timeout: float = 0.0) -> bool:
        """Whether it forks workers now; waits up to `timeout` for a starting one's word."""
        deadline = time.monotonic() + timeout
        while self.state is ZygoteState.STARTING:
            assert self._sock is not None and self.proc is not None
            left = max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([self._sock], [], [], min(left, 0.2))
            if readable:
                try:
                    message = self._receive()
                except OSError as exc:
                    self._lost(f"its socket failed while starting: {exc}")
                    break
                if isinstance(message, ZygoteReady):
                    log.info("worker zygote (pid %d) ready in %.1fs", self.proc.pid, message.seconds)
                    self.state, self.was_ready = ZygoteState.READY, True
                else:
                    self._lost("it said something else than ready")
            elif self.proc.poll() is not None:
                self._lost(f"it exited with code {self.proc.returncode} while starting")
            elif time.monotonic() >= deadline:
                break
        return self.state is ZygoteState.READY

    def fork(self, argv: list[str]) -> ForkedWorker | None:
        """A worker forked with `steadfast.worker.main`'s arguments `argv`; None if the zygote is not
        ready or fails (the caller execs the worker instead)."""
        if not self.ready():
            return None
        assert self._sock is not None
        try:
            self._sock.settimeout(FORK_TIMEOUT_S)
            self._sock.send(encode(ForkWorker(argv)))
            message = self._receive()
        except OSError as exc:  # its end closed, or no answer in time
            self._lost(f"no answer to a fork: {exc}")
            return None
        finally:
            if self._sock is not None:
                self._sock.settimeout(None)
        if not isinstance(message, WorkerForked) or message.pid <= 0:
            log.warning("the worker zygote could not fork: %s", getattr(message, "error", message))
            return None
        return ForkedWorker(message.pid)

    def _receive(self) -> ZygoteReady | WorkerForked | None:
        assert self._sock is not None
        data = self._sock.recv(MAX_PACKET)
        if not data:
            raise ConnectionResetError("the zygote closed its end")
        try:
            return decode_from_zygote(data)
        except Exception:  # noqa: BLE001 - msgspec's errors: a zygote that says nonsense is not used
            return None

    def _lost(self, why: str) -> None:
        log.warning("worker zygote not used: %s; workers start from a fresh interpreter", why)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # (its exit is then seen and handled like any)
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock, self.state = None, ZygoteState.GONE
