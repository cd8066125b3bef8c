"""The launcher's private arena folder: mode 0700, removed on a normal exit, and swept by the next
launcher once its own launcher is gone (even killed with SIGKILL), never while that launcher lives."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys

import pytest

from steadfast.ops.supervisor.arena_dir import ArenaDir

pytestmark = pytest.mark.unit


def test_the_folder_is_private_and_a_normal_exit_removes_it(tmp_path):
    folder = ArenaDir.create(str(tmp_path / "shm"))
    name = os.path.basename(folder.path)
    assert name.startswith(f"steadfast-{os.geteuid()}-{os.getpid()}-")
    assert stat.S_IMODE(os.lstat(folder.path).st_mode) == 0o700
    (tmp_path / "shm" / name / "kvpool.kv").write_bytes(b"kv")
    folder.release()
    assert list((tmp_path / "shm").iterdir()) == []


def killed_launcher_folder(parent: str) -> str:
    """The folder of a launcher (another process) killed with SIGKILL, an arena file left in it."""
    code = (
        "import sys, time; from steadfast.ops.supervisor.arena_dir import ArenaDir\n"
        "f = ArenaDir.create(sys.argv[1]); open(f.path + '/kvpool.kv', 'w').close()\n"
        "print(f.path, flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, parent], stdout=subprocess.PIPE, text=True)
    path = proc.stdout.readline().strip()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and os.path.exists(path + "/kvpool.kv")
    return path


def test_a_new_launcher_sweeps_folders_of_dead_launchers_only(tmp_path):
    parent = str(tmp_path / "shm")
    alive = ArenaDir.create(parent)  # its lock is held by this process: a live launcher
    dead = killed_launcher_folder(parent)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    symlink = os.path.join(parent, f"steadfast-{os.geteuid()}-1-abc")  # looks like one, is a symlink
    os.symlink(elsewhere, symlink)
    other_user = os.path.join(parent, f"steadfast-{os.geteuid() + 1}-1-abc")  # another uid's name
    os.mkdir(other_user)
    given_away = os.path.join(parent, f"steadfast-{os.geteuid()}-1-xyz")  # our name, not ours (root only)
    os.mkdir(given_away)
    if os.geteuid() == 0:
        os.chown(given_away, 12345, 12345)

    new = ArenaDir.create(parent)
    assert not os.path.exists(dead)
    assert os.path.isdir(alive.path) and os.path.isdir(other_user) and os.path.islink(symlink)
    assert os.path.isdir(given_away) == (os.geteuid() == 0)  # an unlocked folder of ours is swept
    assert elsewhere.is_dir()
    new.release()
    alive.release()
