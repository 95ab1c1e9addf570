"""``ddiloco report``: plots and HTML from run directories of both engines, and its errors."""

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from ddiloco.cli import main
from ddiloco.report import goodput_timeline, learner_states, load_run, loss_curve, make_report

PNGS = ("loss.png", "goodput.png", "learners.png", "bytes.png")
TINY = dict(
    steps=30,
    batch_size=4,
    block_size=16,
    vocab_size=16,
    learners=2,
    eval_every=10,
    eval_batches=2,
    progress=False,
)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """A decoupled run with failures and a dp run, trained in-process."""
    from ddiloco.config import TrainConfig
    from ddiloco.engine import run

    root = tmp_path_factory.mktemp("runs")
    run(TrainConfig(out=str(root / "dec"), H=6, fragments=3, mtbi_s=12.0, downtime_s=3.0, **TINY))
    run(TrainConfig(out=str(root / "dp"), method="dp", **TINY))
    return root / "dec", root / "dp"


def _write_run(d: Path, summary: dict, rows: list, extra_lines: tuple = ()) -> Path:
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps(summary))
    with open(d / "metrics.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return d


def _processes_run(d: Path) -> Path:
    """A run directory shaped like the process runtime's: wall clock, learner_start rows,
    chaos-* rows, an unknown row kind and rows with missing fields."""
    summary = {
        "method": "decoupled",
        "engine": "processes",
        "learners": 2,
        "steps": 10,
        "tokens": 1280,
        "final_eval_loss": 2.5,
        "entropy_floor": 1.2,
        "goodput": 0.5,
        "uptime": 1.0,
        "bytes_up": 4 << 20,
        "bytes_down": 8 << 20,
        "merges": 3,
        "wall_s": 14.0,
        "train_wall_s": 10.0,
        "config": {"fragments": 1},
        "per_learner": [
            {"learner": 0, "ledger_steps": {"computed": 10, "merged": 6, "dropped": 1, "lost": 3}},
            {"learner": 1},
        ],
    }
    rows = [
        {"kind": "config", "fragments": 1},
        {"kind": "eval", "t_s": 0.0, "step": 0, "eval_loss": 2.8},
        {"kind": "learner_start", "learner": 0, "t_s": 2.0, "incarnation": 0},
        {"kind": "learner_start", "learner": 1, "t_s": 2.0, "incarnation": 1},
        {"kind": "step", "learner": 0, "step": 1, "t_s": 3.0, "loss": 2.7},
        {"kind": "merge", "t_s": 4.0, "fragment": 0, "version": 1, "learners": [0, 1]},
        {"kind": "chaos-kill-learner", "t_s": 5.0, "target": "learner_1", "downtime_s": 2},
        {"kind": "dead", "t_s": 8.0, "learner": 1},
        {"kind": "chaos-restart-learner", "t_s": 7.0, "target": "learner_1"},
        {"kind": "learner_start", "learner": 1, "t_s": 8.0, "incarnation": 2},
        {"kind": "chaos-stop-learner", "t_s": 6.0, "target": "learner_0", "duration_s": 1},
        {"kind": "chaos-cont-learner", "t_s": 7.0, "target": "learner_0"},
        {"kind": "merge", "t_s": 10.0, "fragment": 0, "version": 2, "learners": [0, 1]},
        {"kind": "merge", "t_s": 11.0},  # no learners: ignored
        {"kind": "a-row-kind-from-the-future", "t_s": 11.5},
        {"kind": "eval", "eval_loss": 9.9},  # no step: ignored
        {"no_kind": True},
        {"kind": "learner_end", "learner": 0, "t_s": 12.0},
        {"kind": "learner_end", "learner": 1, "t_s": 12.0},
        {"kind": "final", "eval_loss": 2.5},
    ]
    return _write_run(d, summary, rows, extra_lines=('{"kind": "step", "learn', "[1, 2]"))


def _check_png(path: Path) -> None:
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert len(data) > 5_000, (path, len(data))
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 200
    colours = np.unique(img.reshape(-1, img.shape[2])[::7], axis=0)
    assert len(colours) > 10, (path, len(colours))


@pytest.mark.timeout(60)
def test_report_of_two_inproc_runs(two_runs, tmp_path, capsys):
    dec, dp = two_runs
    out = tmp_path / "rep"
    assert main(["report", str(dec), str(dp), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / f) for f in (*PNGS, "index.html")]
    for f in PNGS:
        _check_png(out / f)
    page = (out / "index.html").read_text()
    for f in PNGS:
        assert f'src="{f}"' in page
    assert "dec (decoupled)" in page and "dp (dp)" in page
    assert page.count("<tr>") == 3  # header + one row per run


def test_report_default_out_dir_for_one_run(two_runs, capsys, monkeypatch, tmp_path):
    dec, _ = two_runs
    assert main(["report", str(dec), "--x-axis", "step"]) == 0
    assert (dec / "report" / "index.html").is_file()
    monkeypatch.chdir(tmp_path)  # several runs: ./report
    assert main(["report", str(dec), str(dec)]) == 0
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == sorted((*PNGS, "index.html"))


def test_loss_curve_against_tokens_steps_and_the_clock(two_runs, tmp_path):
    """The loss plot's x axes: tokens and steps from the eval rows' step, time from their
    virtual t_s, ending at the run's virtual time; the eval rows also carry the process's own
    wall seconds."""
    dec, dp = (load_run(d) for d in two_runs)
    for run in (dec, dp):
        evals = run.of("eval")
        steps, _ = loss_curve(run, "step")
        tokens, _ = loss_curve(run, "tokens")
        clock, final = loss_curve(run, "time")
        assert [s for s, _ in steps] == [0, 10, 20, 30]
        per_step = run.summary["tokens"] / run.summary["steps"]
        assert [t for t, _ in tokens] == [s * per_step for s, _ in steps]
        assert [t for t, _ in clock] == sorted(r["t_s"] for r in evals)
        assert final == (run.summary["virtual_time_s"], run.summary["final_eval_loss"])
        walls = [r["wall_s"] for r in evals]
        assert walls == sorted(walls) and walls[-1] <= run.summary["wall_s"]
    out = tmp_path / "rep"
    assert main(["report", *map(str, two_runs), "--x-axis", "time", "--out", str(out)]) == 0
    _check_png(out / "loss.png")


def test_inproc_timeline_matches_failure_and_rejoin_rows(two_runs):
    run = load_run(two_runs[0])
    states = learner_states(run)
    fails = [r for r in run.rows if r["kind"] == "failure"]
    assert fails, "the fixture should have failures"
    for r in fails:
        assert any(st == "down" and s == r["t_s"] for s, _, st in states[r["learner"]])
    tl = goodput_timeline(run)
    assert tl["derived"]
    # the row-derived estimate lands near the engine's own accounting
    assert abs(tl["goodput"][-1] - run.summary["goodput"]) < 0.15
    assert 0.0 < tl["goodput"][-1] <= tl["available"][-1] <= 1.0


def test_goodput_timeline_exact(tmp_path):
    # one learner, one fragment: up 0-4, down 4-6, up 6-10; merges at t=2 and t=8.
    # credits: 2 s (0-2) and 2 s (6-8, the work of 2-4 was lost at the failure)
    d = _write_run(
        tmp_path / "r",
        {
            "method": "decoupled",
            "learners": 1,
            "fragments": 1,
            "virtual_time_s": 10.0,
            "goodput": 0.4,
        },
        [
            {"kind": "merge", "t_s": 2.0, "fragment": 0, "learners": [0]},
            {"kind": "failure", "t_s": 4.0, "learner": 0},
            {"kind": "rejoin", "t_s": 6.0, "learner": 0},
            {"kind": "merge", "t_s": 8.0, "fragment": 0, "learners": [0]},
        ],
    )
    run = load_run(d)
    assert learner_states(run) == {0: [(0.0, 4.0, "up"), (4.0, 6.0, "down"), (6.0, 10.0, "up")]}
    tl = goodput_timeline(run, n=10)
    assert tl["t"] == pytest.approx([1.0 * i for i in range(1, 11)])
    assert tl["goodput"][-1] == pytest.approx(0.4)
    assert tl["goodput"][1] == pytest.approx(2.0 / 2.0)  # t=2: credited 0-2
    assert tl["goodput"][6] == pytest.approx(2.0 / 7.0)  # t=7: nothing since
    assert tl["available"][-1] == pytest.approx(0.8)


def test_processes_run_rows_and_tolerance(tmp_path, caplog):
    d = _processes_run(tmp_path / "proc")
    with caplog.at_level(logging.WARNING, logger="ddiloco.report"):
        run = load_run(d)
    assert run.skipped_lines == 2
    assert "skipped 2 corrupt lines" in caplog.text
    assert learner_states(run) == {
        0: [(2.0, 6.0, "up"), (6.0, 7.0, "stopped"), (7.0, 12.0, "up")],
        1: [(2.0, 5.0, "up"), (5.0, 8.0, "down"), (8.0, 12.0, "up")],
    }
    tl = goodput_timeline(run, n=10)
    # clock from the first learner_start (t=2) to the last row (t=12); credits at t=4:
    # 2 + 2, at t=10: learner 0 up 4-6 and 7-10 (5 s), learner 1 since rejoin 8-10 (2 s)
    assert tl["derived"] and tl["goodput"][-1] == pytest.approx((4 + 5 + 2) / (2 * 10))
    paths = make_report([d], tmp_path / "out")
    assert [p.name for p in paths] == [*PNGS, "index.html"]
    assert "skipped 2 corrupt line(s)" in paths[-1].read_text()


def test_chaos_jsonl_is_read_when_metrics_lack_chaos_rows(tmp_path):
    d = _write_run(
        tmp_path / "r",
        {"method": "decoupled", "learners": 1},
        [
            {"kind": "learner_start", "learner": 0, "t_s": 0.0},
            {"kind": "learner_end", "learner": 0, "t_s": 10.0},
        ],
    )
    (d / "chaos.jsonl").write_text(
        json.dumps({"t_s": 3.0, "kind": "kill-learner", "target": "learner_0"})
        + "\n"
        + json.dumps({"t_s": 4.0, "kind": "restart-learner", "target": "learner_0"})
        + "\n"
    )
    with open(d / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "learner_start", "learner": 0, "t_s": 5.0}) + "\n")
    assert learner_states(load_run(d))[0] == [
        (0.0, 3.0, "up"),
        (3.0, 5.0, "down"),
        (5.0, 10.0, "up"),
    ]


def test_errors_are_user_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err

    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert f"not a ddiloco run directory: {tmp_path / 'empty'} (expected summary.json)" in err

    (tmp_path / "file.txt").write_text("x")
    assert main(["report", str(tmp_path / "file.txt")]) == 2
    assert "not a directory" in capsys.readouterr().err

    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "summary.json").write_text('{"method": "dp", ')
    assert main(["report", str(tmp_path / "torn")]) == 2
    assert "summary.json is not valid JSON" in capsys.readouterr().err

    ok = _write_run(tmp_path / "ok", {"method": "dp", "learners": 1}, [])
    assert main(["report", str(ok), "--out", str(tmp_path / "file.txt")]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "ok" / "report").exists()


def test_minimal_run_without_metrics(tmp_path, capsys):
    d = tmp_path / "bare"
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({"method": "local"}))
    assert main(["report", str(d)]) == 0
    assert (d / "report" / "index.html").is_file()


def _shared_budget_run(d: Path, evals: list[tuple[float, float]]) -> Path:
    """A process run whose two learners shared a budget of 2 x 10 steps and trained 13 and
    11 (64 tokens a step), with eval rows at ``evals`` (step, loss) and step rows of both
    learners interleaved in time."""
    summary = {
        "method": "decoupled",
        "engine": "processes",
        "learners": 2,
        "steps": 10,
        "step_budget": 20,
        "steps_trained": 24,
        "tokens": 24 * 64,
        "final_eval_loss": 1.5,
        "per_learner": [
            {"learner": 0, "steps": 13, "ledger_steps": {"computed": 13, "merged": 13}},
            {"learner": 1, "steps": 11, "ledger_steps": {"computed": 11, "merged": 9, "lost": 2}},
        ],
    }
    rows = [{"kind": "eval", "t_s": 0.0, "step": s, "eval_loss": v} for s, v in evals]
    rows += [{"kind": "learner_start", "learner": m, "t_s": 1.0} for m in (0, 1)]
    rows += [
        {"kind": "step", "learner": m, "step": k, "t_s": 1.0 + k / n, "loss": 3.0 - 0.1 * k}
        for m, n in ((0, 13), (1, 11))
        for k in range(1, n + 1)
    ]
    rows.append({"kind": "final", "eval_loss": 1.5})
    return _write_run(d, summary, rows)


def _lines(fig, prefix: str) -> dict:
    return {ln.get_gid(): ln for ln in fig.axes[0].lines if (ln.get_gid() or "").startswith(prefix)}


@pytest.mark.timeout(60)
def test_the_loss_plot_of_a_process_run_marks_evals_and_ends_every_curve_at_the_star(tmp_path):
    from ddiloco.report import plot_loss

    run = load_run(_shared_budget_run(tmp_path / "two", [(0, 3.5), (6.0, 2.0)]))
    _label_one(run)
    fig = plot_loss([run], tmp_path / "loss.png", "tokens")
    ev, star, train = _lines(fig, "eval:0")["eval:0"], _lines(fig, "final")["final:0"], None
    # two evaluations: markers, no line drawn from 3.5 straight to the final loss
    assert ev.get_linestyle() == "None" and ev.get_marker() == "o"
    assert list(zip(ev.get_xdata(), ev.get_ydata())) == [(0, 3.5), (6.0 * 2 * 64, 2.0)]
    assert not _lines(fig, "line:")
    # tokens trained (13 + 11 steps) put the star at 24 x 64, where the training loss ends
    assert (star.get_xdata()[0], star.get_ydata()[0]) == (24 * 64, 1.5)
    train = _lines(fig, "train:0")["train:0"]
    xs = list(train.get_xdata())
    assert xs == sorted(xs) and xs[-1] == 24 * 64 and max(xs) <= star.get_xdata()[0]
    # against steps: the mean inner step per learner, ending at 12
    fig = plot_loss([run], tmp_path / "loss.png", "step")
    assert _lines(fig, "final")["final:0"].get_xdata()[0] == 12
    assert max(_lines(fig, "train:0")["train:0"].get_xdata()) == 12
    # three evaluations or more: a curve through them to the star
    run = load_run(_shared_budget_run(tmp_path / "three", [(0, 3.5), (4.0, 2.5), (8.0, 2.0)]))
    _label_one(run)
    fig = plot_loss([run], tmp_path / "loss.png", "step")
    line = _lines(fig, "line:0")["line:0"]
    assert list(line.get_xdata()) == [0, 4.0, 8.0, 12] and not _lines(fig, "train:")


@pytest.mark.timeout(60)
def test_the_loss_plot_names_an_entropy_floor_only_for_runs_that_have_one(tmp_path):
    from ddiloco.report import plot_loss

    run = load_run(_shared_budget_run(tmp_path / "real", [(0, 3.5), (6.0, 2.0)]))
    _label_one(run)

    def legend(fig) -> list[str]:
        return [t.get_text() for t in fig.legends[0].get_texts()]

    fig = plot_loss([run], tmp_path / "loss.png", "step")  # real text: no known floor
    assert "entropy floor (per run)" not in legend(fig) and "final eval loss" in legend(fig)
    assert not [ln for ln in fig.axes[0].lines if ln.get_linestyle() == "--"]
    run.summary["entropy_floor"] = 1.2  # the synthetic language: its floor is known
    fig = plot_loss([run], tmp_path / "loss.png", "step")
    assert "entropy floor (per run)" in legend(fig)
    assert [ln.get_ydata()[0] for ln in fig.axes[0].lines if ln.get_linestyle() == "--"] == [1.2]


@pytest.mark.timeout(60)
def test_the_ledger_bars_end_inside_their_axes_with_their_totals(tmp_path):
    from ddiloco.report import plot_learners

    run = load_run(_shared_budget_run(tmp_path / "r", [(0, 3.5)]))
    _label_one(run)
    fig = plot_learners([run], tmp_path / "learners.png")
    ledger = fig.axes[1]
    ends = [b.get_x() + b.get_width() for b in ledger.patches]
    assert max(ends) == 13
    # the longest bar and its label end well inside the axes
    assert ledger.get_xlim()[1] >= 1.15 * max(ends)
    assert [t.get_text().strip() for t in ledger.texts] == ["13", "11"]


def _label_one(run) -> None:
    run.label = f"{run.path.name} ({run.method})"


def test_the_report_page_names_every_x_axis():
    import re

    from ddiloco.report import X_AXES

    page = (Path(__file__).resolve().parent.parent / "docs" / "report.md").read_text()
    usage = re.search(r"--x-axis ([a-z|]+)\]", page)
    assert usage is not None and tuple(usage.group(1).split("|")) == X_AXES
    for axis in X_AXES:
        assert f"`--x-axis {axis}`" in page or axis == "tokens"
