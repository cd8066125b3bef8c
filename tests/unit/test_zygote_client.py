"""The supervisor's handle of a forked worker (exit codes as Popen gives them, timeouts, signals) and
the reaping of adopted orphans a subreaper must do without taking a known child's exit code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from steadfast.ops.supervisor.zygote_client import ForkedWorker

pytestmark = pytest.mark.unit


def fork_child(action) -> int:  # noqa: ANN001 - what the child does before it exits
    pid = os.fork()
    if pid == 0:
        try:
            action()
        finally:
            os._exit(7)
    return pid


def test_a_forked_workers_exit_code_reads_like_popens():
    child = ForkedWorker(fork_child(lambda: None))
    assert child.wait(timeout=10) == 7 and child.poll() == 7
    child.kill()  # reaped: no signal goes to a pid that may be another process's now


def test_wait_times_out_and_a_signal_ends_the_child():
    child = ForkedWorker(fork_child(lambda: time.sleep(30)))
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.1)
    assert child.poll() is None
    child.terminate()
    assert child.wait(timeout=10) == -signal.SIGTERM


def test_a_subreaper_reaps_adopted_orphans_and_leaves_its_known_children():
    script = textwrap.dedent(
        """
        import os, time
        from steadfast.ops.supervisor.zygote_client import ForkedWorker, become_subreaper, reap_orphans

        assert become_subreaper()
        known = os.fork()
        if known == 0:
            os._exit(5)
        middle = os.fork()
        if middle == 0:  # its child outlives it: adopted by this process, then exits unreaped
            if os.fork() == 0:
                time.sleep(0.2)
                os._exit(0)
            os._exit(0)
        os.waitpid(middle, 0)
        time.sleep(0.6)
        assert reap_orphans({known}) == 1
        assert reap_orphans({known}) == 0
        assert ForkedWorker(known).wait(timeout=5) == 5
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
