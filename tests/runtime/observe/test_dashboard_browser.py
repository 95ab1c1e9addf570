"""The live dashboard in a real headless browser (Debian's chromium + chromedriver, driven by
selenium) during a real run: a syncer and learner processes, one learner SIGKILLed by chaos.

The screenshots (the syncer's page late in the run, the run directory's page at its end) go
to a temporary directory; with ``DDILOCO_DASHBOARD_SCREENSHOT=1`` to ``docs/dashboard.png``
and ``docs/dashboard_run_dir.png`` (regenerate them that way)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from observe_helpers import BackgroundRun, DashboardProcess, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
DOCS = Path(__file__).resolve().parents[3] / "docs"

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs Debian's chromium and chromium-driver (apt-get install -y chromium "
    "chromium-driver)",
)


@pytest.fixture
def browser(tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip)")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'chromium'}",
        "--window-size=1400,1250",
    ):
        opts.add_argument(flag)
    os.environ.setdefault("SE_OFFLINE", "true")  # never let selenium look for drivers online
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


_READ_DOM = """
const rows = Array.from(document.querySelectorAll('#learners tbody tr'));
const num = (s) => { const n = parseInt(s.split('/')[0], 10); return isNaN(n) ? -1 : n; };
return {
  merges: num(document.getElementById('merges').textContent),
  steps: Object.fromEntries(rows.map(r => [r.dataset.learner, num(r.querySelector('td.step').textContent)])),
  states: Object.fromEntries(rows.map(r => [r.dataset.learner, r.querySelector('td.state').textContent])),
  events: Array.from(document.querySelectorAll('#events tbody td:nth-child(2)')).map(e => e.textContent),
  versions: document.querySelectorAll('#versions .frag').length,
  loss_lines: document.querySelectorAll('#chart-loss polyline.series').length,
  polls: parseInt(document.body.dataset.polls || '0', 10),
  steps_done: num(document.getElementById('steps').textContent),
  done: document.getElementById('done').textContent,
};"""


def _dom(driver) -> dict:
    """What the page shows now (read in one script, between two renders): merges, each
    learner's step and state, the events' kinds, fragments, loss curves, polls done."""
    return driver.execute_script(_READ_DOM)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_dashboard_in_headless_chromium_follows_a_run_with_a_kill(browser, tmp_path):
    run_dir = tmp_path / "run"
    chaos = {
        "slowdown": {"0": 3.0, "1": 3.0, "2": 3.0},
        "kill_at_step": [[1, 60]],
        "kill_downtime_s": 1.0,
    }
    with (
        BackgroundRun(run_dir, learners=3, steps=220, chaos=chaos) as run,
        DashboardProcess(str(run_dir)) as from_dir,
    ):
        # the syncer's own port: ?token= once, then the session cookie
        wait_for(lambda: _reachable(run.url), 60, "the syncer's HTTP port")
        browser.get(f"{run.url}/?token={run.token}")
        assert browser.current_url.rstrip("/") == run.url  # the token left the address bar
        first = wait_for(
            lambda: (
                (d := _dom(browser))["merges"] > 0
                and len(d["steps"]) == 3
                and all(s > 0 for s in d["steps"].values())
                and d
            ),
            90,
            "merges and three stepping learners in the page",
        )
        later = wait_for(
            lambda: (
                (d := _dom(browser))["merges"] > first["merges"]
                and all(d["steps"][m] > first["steps"][m] for m in ("0", "2"))
                and d
            ),
            60,
            "the page to show more merges and steps",
        )
        assert later["versions"] == 4 and later["loss_lines"] >= 1
        assert later["polls"] > first["polls"]
        assert set(later["states"].values()) <= {"live", "dead", "left"}
        budget = 3 * 220
        wait_for(
            lambda: _dom(browser)["steps_done"] >= 0.7 * budget or not run.running(),
            90,
            "the run to get near its end",
        )
        shots = DOCS if os.environ.get("DDILOCO_DASHBOARD_SCREENSHOT") else tmp_path
        assert browser.save_screenshot(str(shots / "dashboard.png"))
        # the run directory's dashboard (``ddiloco dashboard RUN_DIR``) shows the kill
        browser.get(from_dir.base + from_dir.query)
        seen = wait_for(
            lambda: (d := _dom(browser))["merges"] > 0 and "kill-learner" in d["events"] and d,
            90,
            "the chaos kill in the run directory's page",
        )
        summary = run.join(150)
        assert summary["ok"], summary
        done = wait_for(
            lambda: "run finished" in (d := _dom(browser))["done"] and d,
            30,
            "the page to see the finished run",
        )
        assert done["merges"] >= seen["merges"] and done["merges"] == summary["merges"]
        assert "restart-learner" in done["events"] and done["loss_lines"] == 3
        assert browser.save_screenshot(str(shots / "dashboard_run_dir.png"))
        for name in ("dashboard.png", "dashboard_run_dir.png"):
            assert (shots / name).stat().st_size > 20_000  # a rendered page, not a blank one


def _reachable(url: str) -> bool:
    from observe_helpers import get

    try:
        return get(f"{url}/healthz")[0] == 200
    except OSError:
        return False
