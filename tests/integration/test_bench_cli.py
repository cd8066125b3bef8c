"""`steadfast bench` end to end: two servers (two Steadfasts on the small model) measured in alternating
rounds, with priorities, multi-turn chats and Poisson arrivals; the table, the JSON and the PNG come out,
and the figures agree with what the servers say they served."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.integration.server import ServerProcess

pytestmark = pytest.mark.integration

CFG = "model: {dtype: float32, device: cpu}\ncache: {kv_memory_mb: 128}\nserver: {standby_workers: 0}\n"


def generated(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(
        next(line.split()[-1] for line in text.splitlines() if line.startswith("steadfast_generation_tokens_total"))
    )


def test_bench_compares_two_servers_in_alternating_rounds(tmp_path, small_model_path):
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir(), b_dir.mkdir()
    a, b = ServerProcess(a_dir, CFG, model=small_model_path), ServerProcess(b_dir, CFG, model=small_model_path)
    try:
        a.wait_ready(), b.wait_ready()
        out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
        args = [sys.executable, "-m", "steadfast.ops.cli", "bench", "--url", a.url, "--compare", b.url]
        args += ["--rounds", "2", "--requests", "6", "--arrivals", "poisson", "--rate", "20", "--turns", "2"]
        args += ["--prompt-words", "8:0.5,24:0.5", "--output-tokens", "12", "--priorities", "high:0.5,low:0.5"]
        args += ["--json", str(out_json), "--plot", str(out_png), "--fail-on-error"]
        run = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        for figure in ("output tokens/s", "TTFT p99 ms", "B / A"):
            assert figure in run.stdout, run.stdout
        report = json.loads(out_json.read_text())
        for name, server in (("A", a), ("B", b)):
            got = report["servers"][name]
            assert got["url"] == server.url and len(got["rounds"]) == 2
            total = got["total"]
            assert total["requests"] == 2 * 6 * 2 and total["failed"] == 0  # rounds x sessions x turns
            assert total["output_tokens"] == 2 * 6 * 2 * 12  # ignore_eos: every request its 12 tokens
            assert total["output_tokens"] == generated(server.url)  # as the server counted them
            assert 0 < total["ttft_ms"]["p50"] <= total["ttft_ms"]["p99"]
        ratios = report["ratios_b_over_a"]
        a_rate = report["servers"]["A"]["total"]["output_tokens_per_s"]
        b_rate = report["servers"]["B"]["total"]["output_tokens_per_s"]
        assert ratios["output tokens/s"] == pytest.approx(b_rate / a_rate, rel=1e-2)
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000
        assert report["workload"]["turns"] == 2 and report["workload"]["arrivals"] == "poisson"

        # Bounded by time, not by count (a run of 100000 chats would not end): closed-loop chats with
        # a system prompt each, no session started after one second, every one started waited for.
        timed = tmp_path / "timed.json"
        args = [sys.executable, "-m", "steadfast.ops.cli", "bench", "--url", a.url, "--rounds", "1"]
        args += ["--requests", "100000", "--seconds", "1", "--concurrency", "2", "--turns", "2"]
        args += ["--system-words", "40", "--prompt-words", "8", "--output-tokens", "8", "--fail-on-error"]
        run = subprocess.run([*args, "--json", str(timed)], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        total = json.loads(timed.read_text())["servers"]["A"]["total"]
        assert 2 <= total["requests"] < 100 and total["failed"] == 0 and total["requests"] % 2 == 0, total
    finally:
        a.stop()
        b.stop()


def test_bench_reports_a_server_that_is_not_there(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "steadfast.ops.cli", "bench", "--url", "http://127.0.0.1:9", "--requests", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1 and "cannot reach" in run.stderr and "Traceback" not in run.stderr, run.stderr
