"""A worker's start-up phases: the first counts from the process's own start, each later one from the
end of the one before, and the total is their sum."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from steadfast.worker.startup import StartupPhases, since_process_start

pytestmark = pytest.mark.unit


def test_the_first_phase_counts_from_the_process_start():
    # A child that sleeps before it asks: its interpreter phase includes the sleep, the parent's age does not.
    code = "import time; time.sleep(0.5); from steadfast.worker.startup import since_process_start as s; print(s())"
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.5 <= age < 30
    assert since_process_start() >= 0


def test_phases_follow_one_another_and_add_up():
    phases = StartupPhases()
    time.sleep(0.05)
    phases.mark("model")
    phases.mark("warm-up")
    names = [name for name, _ in phases.phases]
    assert names == ["interpreter and imports", "model", "warm-up"]
    assert phases.phases[1][1] >= 0.05 and phases.phases[2][1] < 0.05
    assert phases.total == pytest.approx(sum(s for _, s in phases.phases))
    assert phases.summary().startswith("interpreter and imports ") and ", model 0." in phases.summary()
