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
