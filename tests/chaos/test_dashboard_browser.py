"""The dashboard in a real browser (Debian's Chromium, headless, driven by Playwright) during a
`steadfast chaos kill-worker` run: the page shows the worker's death, the takeovers and the level, the
rehearsal passes (every stream token-identical to its undisturbed twin), and a screenshot is kept as a
test artifact (`test-artifacts/`, or $STEADFAST_TEST_ARTIFACTS)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import wait_until
from tests.integration.server import free_port

pytestmark = pytest.mark.chaos

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("STEADFAST_TEST_ARTIFACTS", ROOT / "test-artifacts"))
CONFIG = (
    "model: {dtype: float32, device: cpu}\n"
    "cache: {kv_memory_mb: 128}\n"
    "server: {workers: 1, standby_workers: 1, status_interval_s: 0.25}\n"
    "fault_recovery: {lease: {renew_interval_ms: 100, lease_timeout_ms: 1000}}\n"
)


def browser_or_skip():  # noqa: ANN201 - Playwright's sync API module and the browser's path
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no Chromium on this machine (`make test` installs Debian's chromium where it may: root or sudo)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    return sync_api, chromium


def chaos(tmp_path: Path, scenario: str, config: str, model: str, *extra: str) -> tuple[subprocess.Popen, int, Path]:
    cfg, report = tmp_path / "chaos.yaml", tmp_path / "chaos.json"
    cfg.write_text(config)
    port = free_port()
    cmd = [sys.executable, "-m", "steadfast.ops.cli", "chaos", scenario, "--config", str(cfg), "--model", model]
    # Its files in the test's folder (the default, a new folder under /tmp, would outlive the test).
    cmd += ["--port", str(port), "--json", str(report), "--folder", str(tmp_path / "run"), "--tokens", "120", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, port, report


def up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_dashboard_shows_a_killed_worker_its_takeover_and_the_level(tmp_path, small_model_path):
    sync_api, chromium = browser_or_skip()
    with sync_api.sync_playwright() as pw:
        # The browser first (its first start on a busy machine takes a while), then the rehearsal, which
        # keeps its server up after its report (--linger) until this test has read the page.
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        args = ("--streams", "3", "--at", "0.5", "--linger", "180")
        # The last soak's report beside it (a real one: a 60-minute soak's that failed, and its timeline PNG).
        soak = tmp_path / "soak.json"
        shutil.copy(ROOT / "benchmarks" / "results" / "soak_60min_d5d1a41.json", soak)
        shutil.copy(ROOT / "benchmarks" / "results" / "soak_60min_d5d1a41.png", soak.with_suffix(".png"))
        config = CONFIG.replace("status_interval_s: 0.25}", f"status_interval_s: 0.25, soak_report: '{soak}'}}")
        assert config != CONFIG
        proc, port, report = chaos(tmp_path, "kill-worker", config, small_model_path, *args)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: up(url) or proc.poll() is not None, 120, "the chaos run's server")
            assert proc.poll() is None, proc.communicate()[0]
            page.goto(url + "/dashboard")
            page.wait_for_selector("#workers tbody tr", timeout=15_000)  # the page polls and draws
            # The last soak: its verdict, a row per fault kind, its failures, its timeline drawn.
            page.wait_for_selector("#soak-kinds tbody tr[data-kind=kill-worker]", timeout=15_000)
            assert page.locator("#soak-verdict").get_attribute("data-passed") == "false"
            assert page.locator("#soak-failures li").count() == 10
            page.wait_for_function("() => document.querySelector('#soak-timeline').naturalWidth > 0", timeout=15_000)
            crash = page.wait_for_selector("#events tr[data-kind=crash]", timeout=120_000)
            assert "died" in crash.inner_text() and "fenced" in crash.inner_text()
            page.wait_for_selector("#events tr[data-kind=takeover]", timeout=30_000)
            wait_until(report.exists, 180, "the rehearsal's report")  # every takeover is in the timeline now
            state = httpx.get(url + "/admin/dashboard").json()
            takeovers = [e for e in state["events"] if e["kind"] == "takeover"]
            wait_until(lambda: page.locator("#events tr[data-kind=takeover]").count() == len(takeovers), 10, "rows")
            page.wait_for_function(  # the page's level badge shows the router's level
                "want => document.querySelector('#level').textContent === want", arg=f"L{state['level']['level']}"
            )
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            shot = ARTIFACTS / "dashboard-kill-worker.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            browser.close()
            proc.send_signal(signal.SIGTERM)  # ends the lingering; the server stops, the exit code stays
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, out
            got = json.loads(report.read_text())
            assert got["passed"] and got["identical"] == got["streams"] == 3 and got["takeovers"] == len(takeovers)
        finally:
            if proc.poll() is None:
                proc.terminate()  # the rehearsal stops its server on the way out
                proc.wait(120)
