"""The live dashboard in a real headless Chromium (Playwright, Debian's ``chromium``): a real
``shoal serve``, a real coordinator and three real training workers (the digits example,
slowed); the loss chart grows while the job trains, a ``kill -9`` of a worker shows up as a
failure mark on both charts and as a Failed row of the workers table, the decision log and the
log lines stream in. A screenshot is left in the test's directory (and in
``$SHOAL_TEST_ARTIFACTS`` when set)."""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

import pytest

from tests.api.conftest import ApiServer
from tests.helpers import ControlWatcher, wait_until

pytestmark = pytest.mark.slow

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium() -> str | None:
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


@pytest.fixture
def browser_page():
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    exe = chromium()
    if exe is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium): the dashboard test needs a real browser")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        yield page, errors
        browser.close()


def _count(page, selector: str, attr: str) -> int:
    return int(page.get_attribute(selector, attr) or 0)


def test_the_dashboard_shows_a_training_job_live_with_a_failure_mark(api_server: ApiServer, r, procs, job_id, tmp_path,
                                                                     browser_page, monkeypatch) -> None:
    page, errors = browser_page
    monkeypatch.setenv("SHOAL_TEST_STEP_DELAY", "0.12")  # the workers inherit it: about 20 s of training
    spec = {"name": job_id, "entrypoint": "tests.entrypoints:slow_digits", "min_workers": 1, "max_workers": 3,
            "epochs": 3, "max_steps": 160, "heartbeat_interval": 0.2, "heartbeat_ttl": 1.5, "seed": 1}
    resp = api_server.http.post("/jobs", json={"spec": spec, "queue": False}, headers=api_server.auth())
    assert resp.status_code == 201, resp.text
    watch = ControlWatcher(r, job_id)
    procs.coordinator("coord")
    workers = [procs.worker(job_id, f"p{i}") for i in range(3)]
    try:
        page.goto(f"{api_server.url}/#job={job_id}")
        page.wait_for_selector(f"#jobs tr[data-job='{job_id}']")
        watch.wait_for(lambda d: d.world_size == 3, 90)
        # the chart grows while the job trains
        first = wait_until(lambda: _count(page, "#loss-chart", "data-points") >= 3, 60, "points on the loss chart")
        before = _count(page, "#loss-chart", "data-points")
        wait_until(lambda: _count(page, "#loss-chart", "data-points") >= before + 3, 30, "the loss chart to grow")
        assert first and _count(page, "#rate-chart", "data-points") >= before + 3
        assert _count(page, "#loss-chart", "data-failure-marks") == 0

        victim = workers[1]
        victim.signal(signal.SIGKILL)
        watch.wait_for(lambda d: d.failed and d.job_state == "running", 30)
        # the failure mark appears on both charts and in the legend, and training goes on after it
        wait_until(lambda: _count(page, "#loss-chart", "data-failure-marks") >= 1, 20, "a failure mark on the loss chart")
        assert _count(page, "#rate-chart", "data-failure-marks") >= 1
        assert "failed" in page.inner_text("#marks li.mark-failure")
        at_failure = _count(page, "#loss-chart", "data-points")
        wait_until(lambda: _count(page, "#loss-chart", "data-points") >= at_failure + 4, 60,
                   "the loss chart to go on after the failure")
        wait_until(lambda: "Failed" in page.inner_text("#workers tbody"), 20,
                   lambda: f"a Failed worker in the table: {page.inner_text('#workers tbody')!r}")
        wait_until(lambda: "world size 2" in page.inner_text("#decisions"), 20, "the decision log")
        wait_until(lambda: page.inner_text("#logs").strip(), 20, "log lines")
        assert "running" in page.inner_text("#job-state")
        page.wait_for_timeout(300)  # one more frame of the charts before the picture
        shot = tmp_path / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 20_000
        if os.environ.get("SHOAL_TEST_ARTIFACTS"):
            out = Path(os.environ["SHOAL_TEST_ARTIFACTS"])
            out.mkdir(parents=True, exist_ok=True)
            shutil.copy2(shot, out / "dashboard.png")
        # stopping it from the page: the token is asked for, sent, and the job stops
        page.on("dialog", lambda d: d.accept(api_server.token) if d.type == "prompt" else d.accept())
        page.click("#stop-job")
        wait_until(lambda: "stop requested" in page.inner_text("#action-result"), 20, "the stop to be requested")
        watch.wait_for(lambda d: d.job_state == "stopped" and "stopped from the dashboard" in d.reason, 30)
        wait_until(lambda: "stopped" in page.inner_text("#job-state"), 20, "the page to show the job stopped")
        assert page.is_hidden("#stop-job")
        assert errors == [], errors
    except BaseException:
        page.screenshot(path=str(tmp_path / "dashboard-failed.png"), full_page=True)
        raise
    finally:
        api_server.http.post(f"/jobs/{job_id}/stop", headers=api_server.auth())
