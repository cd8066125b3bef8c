"""The `steadfast` command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_generate_prints_a_completion():
    out = subprocess.run(
        [sys.executable, "-m", "steadfast.ops.cli", "generate", "What is the capital of France?", "--max-tokens", "12"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_bad_config_fails_fast_with_a_message(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("scheduler: {max_num_seqs: 0}\n")
    out = subprocess.run(
        [sys.executable, "-m", "steadfast.ops.cli", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "scheduler.max_num_seqs" in out.stderr


def test_missing_model_file_is_reported(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "steadfast.ops.cli", "generate", "hi", "--model", str(tmp_path / "none.gguf")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "cannot load the model: model file not found" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--role", "node"], "needs --join etcd://..., --cluster-keys DIR and --advertise HOST"),
        (["--join", "etcd://127.0.0.1:2379/x"], "add --role router or --role node"),
        (
            ["--role", "router", "--join", "sqlite:///x.db", "--cluster-keys", "KEYS", "--advertise", "127.0.0.1"],
            "etcd",
        ),
        (
            [
                "--role",
                "node",
                "--join",
                "etcd://127.0.0.1:1/x",
                "--cluster-keys",
                "KEYS/router.keys",
                "--advertise",
                "127.0.0.1",
            ],
            "the node needs node.keys",
        ),
        (
            [
                "--role",
                "node",
                "--node",
                "../x",
                "--join",
                "etcd://127.0.0.1:1/x",
                "--cluster-keys",
                "KEYS",
                "--advertise",
                "127.0.0.1",
            ],
            "node name",
        ),
    ],
    ids=["no-join", "join-without-role", "not-etcd", "wrong-keys", "bad-node-name"],
)
def test_a_part_of_a_deployment_over_hosts_is_checked_before_it_starts(tmp_path, args, message):
    keys = tmp_path / "keys"
    made = subprocess.run([sys.executable, "-m", "steadfast.ops.cli", "cluster-keys", str(keys)], capture_output=True)
    assert made.returncode == 0, made.stderr
    argv = [a.replace("KEYS", str(keys)) for a in args]
    out = subprocess.run(
        [sys.executable, "-m", "steadfast.ops.cli", "serve", *argv], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr
