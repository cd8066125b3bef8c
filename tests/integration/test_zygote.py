"""The worker zygote: workers are forked from it, become the supervisor's own children, outlive it; a
dead zygote is started again and a dead worker's replacement is forked from the new one. A malformed
request on its socket gets an error answer, and the zygote keeps answering."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from steadfast.config import Config
from steadfast.util.proc import process_gone
from steadfast.wire.codec import encode
from steadfast.wire.zygote import WorkerForked, decode_from_zygote
from tests.chaos.test_crash_recovery import admin, small_server_config
from tests.conftest import wait_until
from tests.integration.server import ServerProcess

pytestmark = pytest.mark.integration


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def zygotes(launcher: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            worker = Path(f"/proc/{entry}/comm").read_text().startswith("sf-worker")  # (forked: same argv)
            if b"steadfast.worker.zygote" in argv and not worker and parent_of(int(entry)) == launcher:
                found.append(int(entry))
        except OSError:
            continue
    return found


def zombies_of(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == pid:
            found.append(int(entry))
    return found


def complete(server: ServerProcess) -> str:
    body = {"model": server_model(server), "prompt": "The zygote forks", "max_tokens": 12, "temperature": 0.0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def server_model(server: ServerProcess) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def test_workers_are_forked_outlive_the_zygote_and_replacements_come_from_its_successor(tmp_path, small_model_path):
    server = ServerProcess(tmp_path, small_server_config("{workers: 1, standby_workers: 1}"), model=small_model_path)
    try:
        server.wait_ready()
        launcher = server.proc.pid
        wait_until(
            lambda: any(w["state"] == "ready" for w in admin(server, "workers") if w["role"] == "standby"),
            60,
            "a ready standby",
        )
        workers = admin(server, "workers")
        for w in workers:  # forked, then adopted by the supervisor (a child subreaper)
            assert parent_of(w["pid"]) == launcher, w
            assert Path(f"/proc/{w['pid']}/comm").read_text().strip() == f"sf-worker{w['id']}"
        (zygote,) = zygotes(launcher)
        (standby,) = [w for w in workers if w["role"] == "standby"]
        # It has computed nothing (a fork runs no warm-up): its step cost is the zygote's warm-up's.
        assert standby["step_decode_ms"] > 0 and standby["step_prefill_ms"] > 0, standby
        assert standby["step_base_ms"] >= 0, standby
        before = complete(server)

        os.kill(zygote, signal.SIGKILL)
        wait_until(lambda: process_gone(zygote), 10, "the zygote to be gone")
        successor = wait_until(lambda: [z for z in zygotes(launcher) if z != zygote], 30, "a new zygote")[0]
        wait_until(lambda: f"worker zygote (pid {successor}) ready" in server.output(), 60, "the new zygote ready")
        assert {w["pid"] for w in admin(server, "workers")} == {w["pid"] for w in workers}  # none died with it
        assert complete(server) == before

        (mixed,) = [w for w in workers if w["role"] == "mixed"]
        os.kill(mixed["pid"], signal.SIGKILL)
        first = {w["id"] for w in workers}  # (the old standby may still read "standby" for a moment)
        replacement = wait_until(
            lambda: next(
                (
                    w
                    for w in admin(server, "workers")
                    if w["role"] == "standby" and w["state"] == "ready" and w["id"] not in first
                ),
                None,
            ),
            60,
            "a ready replacement",
        )
        assert parent_of(replacement["pid"]) == launcher
        assert f"zygote[{successor}] INFO steadfast.zygote: forked worker {replacement['id']} as pid" in server.output()
        assert complete(server) == before
        assert zombies_of(launcher) == []  # the dead zygote and worker were reaped
    finally:
        print(server.output()[-3000:])
        server.stop()


def test_a_malformed_fork_request_is_answered_with_an_error(tmp_path, small_model_path):
    """The zygote's socket is the supervisor's alone; still, what arrives on it is decoded strictly."""
    cfg = Config().replace(model={"path": small_model_path, "dtype": "float32", "device": "cpu"})
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    weights = tmp_path / "weights"
    weights.mkdir(mode=0o700)
    argv = [sys.executable, "-m", "steadfast.worker.zygote", "--config-json", json.dumps(cfg.public().to_dict())]
    argv += ["--weights-dir", str(weights), "--control-fd", str(theirs.fileno())]
    proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),))
    theirs.close()
    try:
        ours.settimeout(120)
        assert decode_from_zygote(ours.recv(4096)).seconds > 0  # ZygoteReady
        for junk in (b"\xc1not msgpack", encode(WorkerForked(pid=1)), b"\x92\xa4fork\x05"):
            ours.send(junk)
            reply = decode_from_zygote(ours.recv(4096))
            assert isinstance(reply, WorkerForked) and reply.pid == 0 and reply.error, reply
        ours.close()  # the supervisor gone: the zygote ends
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
