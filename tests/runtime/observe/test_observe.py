"""The syncer's observability port (Prometheus /metrics, /healthz, /readyz, the dashboard's
JSON) and ``ddiloco dashboard``: real syncer and learner processes on loopback."""

from __future__ import annotations

import http.client
import json
import os

import pytest
from observe_helpers import BackgroundRun, DashboardProcess, free_port, get, wait_for
from prometheus_client.parser import text_string_to_metric_families
from runtime_helpers import init_syncer, self_signed_cert, tiny_model


def scrape(url: str, token: str) -> dict[tuple[str, tuple], float]:
    """``/metrics`` parsed by prometheus_client: {(sample name, sorted labels): value}."""
    code, headers, body = get(f"{url}/metrics", token)
    assert code == 200, body
    assert headers["Content-Type"].startswith("text/plain; version=")
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_probes_auth_and_readiness_of_a_syncer_process(syncer_factory):
    from ddiloco.runtime.learner.client import SyncerClient

    port = free_port()
    s = syncer_factory("--http-port", str(port))
    url = f"http://127.0.0.1:{port}"
    # probes answer without the token; no model yet: not ready
    assert get(f"{url}/healthz")[0] == 200
    code, _, body = get(f"{url}/readyz")
    assert code == 503 and b"no model yet" in body
    # everything else needs the token: none, a wrong one, a wrong cookie
    for path in ("/", "/api/state", "/metrics"):
        assert get(url + path)[0] == 401
        assert get(url + path, "wrong-token")[0] == 401
        assert get(url + path, headers={"Cookie": "ddiloco_session=0123"})[0] == 401
    assert get(f"{url}/?token=wrong")[0] == 401
    assert get(f"{url}/nothing-here", s.token)[0] == 404
    # ?token= once: a session cookie (not the token itself) and a redirect that drops it
    code, headers, _ = get(f"{url}/?token={s.token}")
    assert code == 303 and headers["Location"] == "/"
    cookie = headers["Set-Cookie"].split(";")[0]
    assert s.token not in cookie and "HttpOnly" in headers["Set-Cookie"]
    code, _, page = get(f"{url}/", headers={"Cookie": cookie})
    assert (
        code == 200
        and b"<svg" in page
        and b"http://" not in page.replace(b"http://www.w3.org/2000/svg", b"")
    )  # nothing fetched from elsewhere
    assert get(f"{url}/api/state", headers={"Cookie": cookie})[0] == 200
    # a learner uploads the initial model: ready
    client = SyncerClient(s.address, s.token)
    try:
        init_syncer(client, tiny_model())
    finally:
        client.close()
    code, _, body = get(f"{url}/readyz")
    assert code == 200 and body.startswith(b"ready"), body
    m = scrape(url, s.token)
    assert m[("ddiloco_syncer_initialised", ())] == 1.0
    assert m[("ddiloco_learners", (("state", "live"),))] == 1.0
    assert m[("ddiloco_fragment_version", (("fragment", "0"),))] == 0.0
    view = wait_for(
        lambda: (
            (v := json.loads(get(f"{url}/api/state", s.token)[2]))["summary"]["initialised"] and v
        ),
        10,
        "the dashboard to see the model",
    )
    assert view["versions"] == [0, 0] and view["learners"][0]["state"] == "live"
    assert [e["kind"] for e in view["events"]][:1] == ["syncer"]


@pytest.mark.timeout(60)
def test_with_a_certificate_the_port_speaks_https(syncer_factory, tmp_path):
    import ssl

    cert, key = self_signed_cert(tmp_path)
    port = free_port()
    s = syncer_factory("--http-port", str(port), "--tls-cert", str(cert), "--tls-key", str(key))
    ctx = ssl.create_default_context(cafile=str(cert))
    code, _, body = get(f"https://127.0.0.1:{port}/metrics", s.token, context=ctx)
    assert code == 200 and b"ddiloco_syncer_initialised 0.0" in body
    code, headers, _ = get(f"https://127.0.0.1:{port}/?token={s.token}", context=ctx)
    assert code == 303 and "; Secure" in headers["Set-Cookie"]
    with pytest.raises((OSError, http.client.HTTPException)):  # plain HTTP is not answered
        get(f"http://127.0.0.1:{port}/healthz", timeout_s=3)


@pytest.mark.timeout(150)
def test_metrics_and_both_dashboard_commands_follow_a_real_run(tmp_path):
    run_dir = tmp_path / "run"
    # steps stretched (x3, slept) so that the run outlasts the dashboards' start-up
    with (
        BackgroundRun(
            run_dir, learners=2, steps=200, chaos={"slowdown": {"0": 3.0, "1": 3.0}}
        ) as run,
        DashboardProcess(str(run_dir)) as from_dir,
        DashboardProcess(
            f"127.0.0.1:{_grpc_port(run_dir)}", env={**os.environ, "DDILOCO_TOKEN": run.token}
        ) as proxy,
    ):
        first = wait_for(lambda: _merged_metrics(run), 60, "a first merge on /metrics")
        assert from_dir.token and proxy.token is None  # made its own / used the run's
        assert get(from_dir.base + "api/state")[0] == 401
        assert get(proxy.base + "api/state", "wrong")[0] == 401
        v0 = json.loads(get(from_dir.base + "api/state", from_dir.token)[2])
        p0 = json.loads(get(proxy.base + "api/state", run.token)[2])
        later = wait_for(lambda: _grown(run, first), 60, "more merges and steps")
        v1 = wait_for(
            lambda: _view_grown(from_dir.base, from_dir.token, v0),
            30,
            "the run directory's dashboard to advance",
        )
        p1 = wait_for(
            lambda: _view_grown(proxy.base, run.token, p0), 30, "the proxy dashboard to advance"
        )
        assert get(proxy.base + "metrics", run.token)[0] == 200
        assert get(from_dir.base + "metrics", from_dir.token)[0] == 404
        summary = run.join()
    assert summary["ok"], summary
    # the scrapes: counters grow, learner gauges are there, versions follow merges
    assert later[("ddiloco_merges_total", ())] > first[("ddiloco_merges_total", ())]
    for m in ("0", "1"):
        assert later[("ddiloco_learner_step", (("learner", m),))] > first.get(
            ("ddiloco_learner_step", (("learner", m),)), 0
        )
    assert later[("ddiloco_received_bytes_total", ())] > 0
    assert sum(v for (n, _), v in later.items() if n == "ddiloco_fragment_version") > 0
    assert later[("ddiloco_live_learners", ())] == 2
    # the dashboards: run directory (every step's loss, merges from the syncer's events)
    assert v1["summary"]["merges"] > v0["summary"]["merges"]
    assert {L["learner"] for L in v1["learners"]} == {"0", "1"}
    assert all(L["step"] > 0 for L in v1["learners"])
    assert v1["series"]["learners_per_merge"] and v1["loss"]
    assert p1["summary"]["merges"] > p0["summary"]["merges"] and p1["series"]["live"]


def _grpc_port(run_dir) -> int:
    return int(
        wait_for(
            lambda: (run_dir / "syncer.port").is_file() and (run_dir / "syncer.port").read_text(),
            30,
            "the syncer's port",
        )
    )


def _merged_metrics(run: BackgroundRun):
    try:
        m = scrape(run.url, run.token)
    except OSError:
        return None  # the port is not bound yet
    return m if m.get(("ddiloco_merges_total", ()), 0) > 0 else None


def _grown(run: BackgroundRun, first: dict):
    m = scrape(run.url, run.token)
    steps_up = all(
        m.get(("ddiloco_learner_step", (("learner", k),)), 0)
        > first.get(("ddiloco_learner_step", (("learner", k),)), 0)
        for k in "01"
    )
    return (
        m
        if m[("ddiloco_merges_total", ())] > first[("ddiloco_merges_total", ())] and steps_up
        else None
    )


def _view_grown(base: str, token: str, v0: dict):
    v = json.loads(get(base + "api/state", token)[2])
    return v if v["summary"]["merges"] > v0["summary"]["merges"] and v["learners"] else None
