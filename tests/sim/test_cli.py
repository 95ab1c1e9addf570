import json
import os
import subprocess
import sys

import pytest

from ddiloco.sim.cli import main


def test_simulate_json(capsys):
    assert (
        main(
            [
                "simulate",
                "--system",
                "decoupled",
                "--chips",
                "300000",
                "--learners",
                "4",
                "--mtbi-years",
                "1",
                "--seeds",
                "3",
                "--hours",
                "2",
                "--json",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert {"goodput", "uptime", "goodput_ci95"} <= data.keys()
    assert 0 < data["goodput"] < 1 and data["seeds"] == 3
    assert out.err == ""  # no progress bar with --json


def test_simulate_text_and_overrides(capsys):
    assert (
        main(
            [
                "simulate",
                "--system",
                "elastic-dp",
                "--chips",
                "150000",
                "--seeds",
                "2",
                "--hours",
                "2",
                "--set",
                "reconfig_s=60",
            ]
        )
        == 0
    )
    assert "goodput" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--system", "dp", "--chips", "0"], "--chips"),
        (["--system", "dp", "--chips", "1000", "--learners", "2"], "decoupled only"),
        (
            ["--system", "decoupled", "--chips", "100000", "--learners", "2", "--quorum", "3"],
            "exceeds",
        ),
        (["--system", "decoupled", "--chips", "1000", "--learners", "8"], "fewer than M"),
        (["--chips", "1000"], "give --system"),
        (["--system", "dp", "--chips", "1000", "--set", "nope=1"], "FIELD"),
        (["--system", "dp", "--chips", "1000", "--set", "reconfig_s=-1"], "reconfig_s"),
    ],
)
def test_simulate_bad_flags_exit_2_with_a_message(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        main(["simulate", *argv])
    assert e.value.code == 2
    assert match in capsys.readouterr().err


def test_simulate_grid_writes_png_and_table(tmp_path, capsys, monkeypatch):
    png = tmp_path / "grid.png"
    assert main(["simulate", "--grid", "--seeds", "2", "--hours", "1", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert png.stat().st_size > 10_000
    assert "Decoupled, M = 16" in out and "published" in out
    assert out.endswith(f"\nwrote {png}\n")
    # without --png: the table alone, nothing written where it runs
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    argv = ["simulate", "--grid", "--field-costs", "--seeds", "2", "--hours", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Decoupled, M = 16" in out and "wrote" not in out
    assert list((tmp_path / "work").iterdir()) == []


def test_bandwidth_json(capsys):
    assert (
        main(
            [
                "bandwidth",
                "--params",
                "12e9",
                "--step-time",
                "2",
                "--datacenters",
                "4",
                "--bandwidth-gbps",
                "5",
                "--tokens",
                "1e12",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    by = {r["method"]: r for r in data["methods"]}
    assert set(by) == {"dp", "diloco", "streaming", "decoupled"}
    assert by["decoupled"]["speedup_vs_dp"] > 20
    assert by["dp"]["min_bandwidth_gbps"] > by["decoupled"]["min_bandwidth_gbps"]
    # bytes per inner step on one link, both ways: DP's ring sends and receives
    # 2(D-1)/D x 16 bits x N each way; with the syncer sharded over the datacenters, each
    # way carries (D-1)/D of the learner's push and fetch of N/P every H/P steps (its own
    # out and in) and as much of its syncer shard's (the others' pushes in, merges out)
    assert by["dp"]["link_bytes_per_step"] == pytest.approx(2 * 1.5 * 2 * 12e9)
    assert by["decoupled"]["link_bytes_per_step"] == pytest.approx(2 * 0.75 * 4 * 12e9 / 24)


@pytest.mark.parametrize(
    ("syncer", "decoupled_bytes"),
    # sharded: each way carries 7/8 x (16 + 16) bits x N/P; hub: the learner's 16 bits x
    # N/P out and 16 bits x N/P in, nothing of a syncer's own
    [("sharded", 2 * 7 / 8 * 4 * 5e9 / 24), ("hub", 4 * 5e9 / 24)],
)
def test_bandwidth_link_bytes_agree_with_the_bits_the_planner_times(
    syncer, decoupled_bytes, capsys
):
    """The default setting (P = H, bf16 both ways): the planner times Streaming's and
    Decoupled's transfers alike, so a sharded syncer's link carries what Streaming's
    all-reduce carries, both ways as one way; a hub syncer's link carries the learner's own
    traffic only."""
    assert main(["bandwidth", "--syncer", syncer, "--json"]) == 0
    by = {r["method"]: r for r in json.loads(capsys.readouterr().out)["methods"]}
    streaming = 2 * (2 * 7 / 8) * 2 * 5e9 / 24  # both ways of the ring, N/P every step
    assert by["streaming"]["link_bytes_per_step"] == pytest.approx(streaming)
    assert by["decoupled"]["link_bytes_per_step"] == pytest.approx(decoupled_bytes)
    if syncer == "sharded":
        assert by["decoupled"]["min_bandwidth_gbps"] == pytest.approx(
            by["streaming"]["min_bandwidth_gbps"]
        )


def test_bandwidth_bad_flags(capsys):
    with pytest.raises(SystemExit):
        main(["bandwidth", "--datacenters", "1"])
    with pytest.raises(SystemExit):
        main(["bandwidth", "--tokens", "1e9"])
    assert "bandwidth" in capsys.readouterr().err


def test_module_runs_as_a_subprocess():
    r = subprocess.run(
        [sys.executable, "-m", "ddiloco.sim.cli", "bandwidth", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["methods"]


def test_sim_and_bandwidth_do_not_import_torch():
    code = (
        "import sys, ddiloco.sim, ddiloco.sim.cli, ddiloco.sim.grid, ddiloco.sim.systems, "
        "ddiloco.sim.calibration, ddiloco.bandwidth; "
        "from ddiloco.sim.cli import main; main(['bandwidth', '--json']); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
