"""The dashboard in a real browser (Debian's Chromium, headless, driven by Playwright) while a worker is
killed under load: the page shows the worker's death, the takeover and the level, and a screenshot is
kept as a test artifact (`test-artifacts/`, or $STEADFAST_TEST_ARTIFACTS)."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.chaos.test_health import run_streams
from tests.conftest import PROMPTS, wait_until
from tests.integration.server import ServerProcess

pytestmark = pytest.mark.chaos

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("STEADFAST_TEST_ARTIFACTS", ROOT / "test-artifacts"))
TOKENS = 300


def browser_or_skip():  # noqa: ANN201 - Playwright's Browser
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no Chromium on this machine (`make test` installs Debian's chromium where it may: root or sudo)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    return sync_api, chromium


def test_the_dashboard_shows_a_killed_worker_its_takeover_and_the_level(tmp_path, small_model_path):
    sync_api, chromium = browser_or_skip()
    cfg = (
        "model: {dtype: float32, device: cpu}\n"
        "cache: {kv_memory_mb: 128}\n"
        "server: {workers: 1, standby_workers: 1, status_interval_s: 0.25}\n"
        "fault_recovery: {lease: {renew_interval_ms: 100, lease_timeout_ms: 1000}}\n"
    )
    server = ServerProcess(tmp_path, cfg, model=small_model_path)
    try:
        server.wait_ready()
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(server.url + "/dashboard")
            page.wait_for_selector("#workers tbody tr", timeout=15_000)  # the page polls and draws
            results: list = []
            jobs = [(f"{PROMPTS[i]} (dashboard {i})", TOKENS, "normal") for i in range(3)]
            runner = threading.Thread(target=lambda: results.extend(run_streams(server.url, jobs)))
            runner.start()
            rows = lambda: httpx.get(server.url + "/admin/workers").json()  # noqa: E731
            wait_until(lambda: any(w["in_flight"] and w["running"] for w in rows()), 30, "streams running")
            time.sleep(1.5)  # some tokens delivered and blocks sealed: the takeover adopts KV
            victim = next(w for w in rows() if w["in_flight"])
            os.kill(victim["pid"], signal.SIGKILL)
            runner.join(timeout=120)
            assert not runner.is_alive()
            assert [len(ids) for ids, *_ in results] == [TOKENS] * 3  # every stream completed
            crash = page.wait_for_selector(f"#events tr[data-kind=crash]:has-text('worker {victim['id']} died')")
            assert crash is not None and "fenced" in crash.inner_text()
            page.wait_for_selector("#events tr[data-kind=takeover]", timeout=15_000)
            takeovers = page.locator("#events tr[data-kind=takeover]").count()
            state = httpx.get(server.url + "/admin/dashboard").json()
            assert takeovers == sum(1 for e in state["events"] if e["kind"] == "takeover") >= 1
            page.wait_for_function(  # the page's level badge shows the router's level
                "want => document.querySelector('#level').textContent === want", arg=f"L{state['level']['level']}"
            )
            assert page.locator(f"#workers tr[data-worker='{victim['id']}']").count() == 0  # gone from the table
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            shot = ARTIFACTS / "dashboard-kill-worker.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            browser.close()
    finally:
        server.stop()
