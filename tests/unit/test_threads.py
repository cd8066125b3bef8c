"""The worker's thread count follows the CPU other processes leave it (worker/threads.py): down at
once when a core is taken, back up only after it stayed free; the load read from /proc/stat really
sees a busy process beside this one; and a prompt's logits are the same bits on one thread or two,
so changing the count mid-stream changes no token."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from steadfast.config import Config
from steadfast.worker.loaded import load_model
from steadfast.worker.threads import GROW_AFTER, WINDOW_S, ThreadGovernor, ThreadPolicy, others_cpu_seconds, threads_for
from tests.conftest import load_deterministic
from tests.unit.test_deterministic import logits, same_bits

pytestmark = pytest.mark.unit


def test_a_core_counts_as_taken_once_others_use_more_than_half_of_it():
    assert threads_for(0.0, 2, 2) == 2
    assert threads_for(0.4, 2, 2) == 2
    assert threads_for(0.6, 2, 2) == 1
    assert threads_for(2.0, 2, 2) == 1  # never none
    assert threads_for(1.2, 8, 4) == 4  # never more than the worker's share
    assert threads_for(5.0, 8, 8) == 3


def test_the_team_shrinks_at_once_and_grows_back_one_thread_after_the_core_stayed_free():
    p = ThreadPolicy(cores=4, most=4)
    assert p.observe(0.1) is None and p.threads == 4
    assert p.observe(2.0) == 2  # two cores taken: at once
    for _ in range(GROW_AFTER - 1):
        assert p.observe(0.0) is None  # free, but not for long enough yet
    assert p.observe(0.0) == 3  # one at a time
    assert p.observe(1.8) == 2  # taken again before the next step up: down at once
    assert p.observe(0.0) is None and p.observe(1.8) is None  # a blip breaks the free run
    for _ in range(GROW_AFTER - 1):
        p.observe(0.0)
    assert p.observe(0.0) == 3


def test_the_governor_reads_a_window_and_applies_what_the_policy_says():
    now = [0.0]
    used = [100.0]
    applied: list[int] = []
    g = ThreadGovernor(2, applied.append, cpus={0, 1}, read=lambda cpus: used[0], clock=lambda: now[0])
    now[0], used[0] = 0.5, 100.5
    g.tick()  # half a window: nothing read yet
    assert applied == [] and g.others == 0.0
    now[0], used[0] = 1.0, 101.0  # one core busy over the window
    g.tick()
    assert g.others == pytest.approx(1.0) and applied == [1] and g.threads == 1
    for _ in range(GROW_AFTER):
        now[0] += WINDOW_S
        g.tick()  # nothing used
    assert applied == [1, 2]


def test_proc_stat_sees_a_busy_process_beside_this_one():
    cpus = os.sched_getaffinity(0)
    before = others_cpu_seconds(cpus)
    if before is None:
        pytest.skip("no /proc/stat here")
    t0 = time.monotonic()
    spin = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"
    hog = subprocess.Popen([sys.executable, "-c", spin])
    hog.wait()
    after = others_cpu_seconds(cpus)
    seconds = time.monotonic() - t0
    assert after is not None
    # The hog spun ~1.5 s of CPU (less on a busy machine, but far more than this idle test's process).
    assert after - before > 0.5 * min(seconds, 1.5), (after - before, seconds)


# Other requests of other lengths beside the prompt: three make a mixed batch as well as seven did, at
# half the time (bf16 without AVX-512 took 57 s with seven).
OTHERS = 3


@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16-deterministic"])
def test_a_prompts_logits_are_the_same_bits_on_one_thread_or_two(make_engine, small_config: Config, mode):
    cfg = small_config.replace(scheduler={"max_num_seqs": 32})
    if mode != "fp32":
        cfg = cfg.replace(model={"dtype": "bfloat16", "deterministic": mode == "bf16-deterministic"})
    loaded = load_deterministic(cfg) if mode == "bf16-deterministic" else load_model(cfg)  # skipped where it cannot run
    was = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = logits(make_engine, cfg, loaded, OTHERS)
        torch.set_num_threads(1)
        one = logits(make_engine, cfg, loaded, OTHERS)
    finally:
        torch.set_num_threads(was)
    assert same_bits(two, one)
