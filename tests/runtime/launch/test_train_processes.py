"""``ddiloco train --engine processes``: real syncer and learner processes on loopback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runtime_helpers import max_gap_ratio, read_jsonl, step_walls, tiny_config

from ddiloco.runtime.launch.launcher import Launcher


@pytest.mark.timeout(120)
def test_three_learners_train_and_eval_loss_falls(tmp_path):
    cfg = tiny_config(tmp_path / "run", learners=3, steps=80)
    with Launcher(cfg) as la:
        s = la.run()
    assert s["ok"], s
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5, (
        s["initial_eval_loss"],
        s["final_eval_loss"],
    )
    assert s["merges"] > 0 and s["rejections"] == {}
    # a global budget of 3 x 80 inner steps, and a few more: learners hear that it is spent by
    # heartbeat (every 0.25 s), so each may take what it steps in a heartbeat, its reply and
    # a margin (0.6 s at its measured rate; on two idle cores 25-30 steps in all)
    over = sum(pl["steps"] / pl["time"]["stepping_s"] * 0.6 + 5 for pl in s["per_learner"])
    assert 240 <= sum(pl["steps"] for pl in s["per_learner"]) <= 240 + over, (
        over,
        s["per_learner"],
    )
    for pl in s["per_learner"]:
        assert pl["steps"] > 40
        assert pl["ledger_balance_error"] < 1e-6
        assert pl["ledger_steps"]["merged"] > 0.5 * pl["steps"]
    kinds = {r["kind"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")}
    assert {"config", "eval", "step", "merge", "final"} <= kinds
    assert (tmp_path / "run" / "summary.json").is_file()
    assert (tmp_path / "run" / "logs" / "syncer.log").is_file()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_a_learner_the_others_never_pause_and_it_rejoins(tmp_path):
    run = tmp_path / "run"
    chaos = run.parent / "chaos.json"
    # Each learner sleeps four times its compute time after a step (chaos slow-down 5x), so
    # three learners need about 0.6 core: on this 2-core machine OS time-slicing between
    # CPU-bound processes (and the restarted learner's start-up) would otherwise dominate the
    # step-gap distribution. A learner that blocked on the network or on its dead peer would
    # still show as a long gap.
    chaos.write_text(
        '{"kill_at_step": [[1, 60]], "kill_downtime_s": 2.0, '
        '"slowdown": {"0": 5.0, "1": 5.0, "2": 5.0}}'
    )
    # steps of a few hundred ms, so that OS scheduling hiccups stay small beside them
    cfg = tiny_config(run, learners=3, steps=160, batch_size=48, block_size=64, chaos=str(chaos))
    with Launcher(cfg) as la:
        s = la.run()
    assert s["ok"], s
    events = [r["kind"] for r in read_jsonl(run / "chaos.jsonl")]
    assert events.count("kill-learner") == 1 and events.count("restart-learner") == 1
    assert s["per_learner"][1]["failures"] == 1 and s["per_learner"][1]["starts"] == 2
    # the others never pause
    for m in (0, 2):
        ratio, gap, med = max_gap_ratio(step_walls(run, m))
        assert ratio <= 3.0, (
            f"learner {m}: longest gap {gap:.3f} s = {ratio:.1f}x median {med:.3f} s"
        )
    # it rejoins with the current global parameters, at the step it had saved
    rows = read_jsonl(run / "learner_1" / "metrics.jsonl")
    starts = [i for i, r in enumerate(rows) if r["kind"] == "learner_start"]
    assert len(starts) == 2 and rows[starts[1]]["step"] >= 50
    assert rows[starts[1]]["resumed_optimizer"]  # its AdamW moments, saved with its progress
    first_loss_after = next(r["loss"] for r in rows[starts[1] :] if r["kind"] == "step")
    assert first_loss_after < s["initial_eval_loss"] - 0.5
    joins = [
        r
        for r in read_jsonl(run / "syncer.metrics.jsonl")
        if r["kind"] == "join" and r["learner"] == 1
    ]
    assert [j["incarnation"] for j in joins] == [1, 2]
    # the token ledger balances for everyone
    for pl in s["per_learner"]:
        assert pl["ledger_balance_error"] < 1e-6, pl
    assert sum(pl["ledger_steps"]["computed"] for pl in s["per_learner"]) >= 3 * 160
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5


@pytest.mark.timeout(150)
def test_the_global_step_budget_lets_a_fast_learner_make_up_for_a_slow_one(tmp_path):
    run = tmp_path / "run"
    chaos = run.parent / "chaos.json"
    chaos.write_text('{"slowdown": {"1": 4.0}}')
    cfg = tiny_config(run, learners=2, steps=60, chaos=str(chaos))
    with Launcher(cfg) as la:
        s = la.run()
    assert s["ok"], s
    steps = [pl["steps"] for pl in s["per_learner"]]
    assert steps[0] > 60 > steps[1], steps  # the fast one did more than its share
    assert 120 <= sum(steps) <= 120 + 2 * 20, steps
    spent = [r for r in read_jsonl(run / "syncer.metrics.jsonl") if r["kind"] == "budget-spent"]
    assert len(spent) == 1 and spent[0]["budget"] == 120
    for m in range(2):  # both were told and stopped within a few steps of each other in time
        assert read_jsonl(run / f"learner_{m}" / "metrics.jsonl")[-1]["kind"] == "learner_end"
    # mostly single-learner merges (each half an outer step) over 120 steps: it falls, a little
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_the_syncer_and_resume_loses_no_merged_update(tmp_path):
    run = tmp_path / "run"
    chaos = run.parent / "chaos.json"
    chaos.write_text(
        '{"syncer_kill_at_step": 50, "syncer_downtime_s": 2.0, "slowdown": {"0": 5.0, "1": 5.0}}'
    )
    cfg = tiny_config(run, learners=2, steps=160, batch_size=16, block_size=64, chaos=str(chaos))
    with Launcher(cfg) as la:
        s = la.run()
    assert s["ok"], s
    ev = read_jsonl(run / "chaos.jsonl")
    kill = next(r["wall"] for r in ev if r["kind"] == "kill-syncer")
    back = next(r["wall"] for r in ev if r["kind"] == "restart-syncer")
    assert back - kill >= 1.9
    syncer_rows = read_jsonl(run / "syncer.metrics.jsonl")
    resume = next(r for r in syncer_rows if r["kind"] == "resume")
    for m in range(2):
        walls = step_walls(run, m)
        # learners keep stepping while the syncer is down ...
        assert sum(kill < w < back for w in walls) >= 3, f"learner {m} paused"
        # (a learner that waited for the syncer would show a gap as long as its downtime;
        # the ratio allows for a loaded machine, where one step can take a few medians)
        ratio, gap, med = max_gap_ratio(walls)
        assert ratio <= 6.0 and gap < 0.5 * (back - kill), (
            f"learner {m}: longest gap {gap:.3f} s = {ratio:.1f}x median {med:.3f} s"
        )
        # ... the versions they install never go back ...
        seen: dict[str, int] = {}
        for r in read_jsonl(run / f"learner_{m}" / "metrics.jsonl"):
            if r["kind"] != "step":
                continue
            for p, v in r["installed"].items():
                assert v > seen.get(p, -1), (m, p, v, seen)
                seen[p] = v
                # ... and nothing a learner installed before the kill is lost by the resume
                if r["wall"] < kill:
                    assert resume["versions"][int(p)] >= v
    after = [r for r in syncer_rows if r["kind"] == "merge" and r["wall"] > resume["wall"]]
    assert after, "no merge after the resume"
    last: dict[int, int] = {}
    for r in after:
        p = r["fragment"]
        assert r["version"] > max(last.get(p, -1), resume["versions"][p])
        last[p] = r["version"]
    for pl in s["per_learner"]:
        assert pl["ledger_balance_error"] < 1e-6, pl
    assert s["syncer_counters"].get("resumes") == 1
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_two_rank_torchrun_island_is_one_learner(tmp_path):
    run = tmp_path / "run"
    cfg = tiny_config(run, learners=1, steps=60, island_size=2)
    with Launcher(cfg) as la:
        s = la.run()
    assert s["ok"], s
    final = read_jsonl(run / "learner_0" / "metrics.jsonl")[-1]["report"]
    assert final["island_size"] == 2
    assert final["island_max_param_diff"] == 0.0  # every rank holds the same parameters
    # the tau overlap steps of every round are overwritten by design (tau / H of them)
    assert s["per_learner"][0]["ledger_steps"]["merged"] > 0.9 * 60 * (
        1 - cfg.sync.tau / cfg.sync.H
    )
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5
    st = [r for r in read_jsonl(run / "syncer.metrics.jsonl") if r["kind"] == "join"]
    assert len(st) == 1  # one learner: only rank 0 talks to the syncer


TINY_FLAGS = ["--model", "gpt_tiny", "--vocab-size", "64", "--block-size", "32"]
TINY_FLAGS += ["--batch-size", "8", "--eval-batches", "4", "--no-progress"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "flags,error",
    [
        (["-P", "35", "-H", "40"], "P=35 fragments but the model has only 29 tensors"),
    ],
)
def test_a_learner_crashing_at_start_up_ends_the_run_with_its_error(tmp_path, capsys, flags, error):
    import time

    from ddiloco.cli import main

    (tmp_path / "empty").mkdir()
    flags = [f.format(empty=tmp_path / "empty") for f in flags]
    t0 = time.monotonic()
    argv = ["train", *TINY_FLAGS, "-M", "2", "--steps", "50", "--out", str(tmp_path), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    head, *tail = err.splitlines()
    assert head.startswith("ddiloco train: error: learner_") and (
        "failed 3 times in a row at start-up (exit code 2), without a new step; not "
        "restarting it. Its last lines (" in head
    ), err
    # the learner's log since its last start, ending with its one-line error
    assert tail and tail[-1].startswith("    ddiloco learner: error: "), err
    assert error in tail[-1] and "Traceback" not in err
    crashed = [r for r in read_jsonl(tmp_path / "chaos.jsonl") if r["kind"] == "learner-crashed"]
    assert 2 <= len(crashed) <= 2 * 3  # given up after 3 in a row, not restarted forever
    assert time.monotonic() - t0 < 90


@pytest.mark.timeout(60)
def test_a_busy_or_foreign_syncer_address_is_one_line(tmp_path, capsys):
    import socket

    from ddiloco.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["train", "--port", str(port), "--out", str(tmp_path)]) == 2
        assert capsys.readouterr().err == (
            f"ddiloco train: error: runtime.port {port} on 127.0.0.1 is in use (another "
            f"syncer?): choose another --port (0: a free one) or stop the process holding it\n"
        )
    assert main(["train", "--host", "192.0.2.1", "--out", str(tmp_path)]) == 2  # TEST-NET-1
    assert capsys.readouterr().err.startswith(
        "ddiloco train: error: runtime.host '192.0.2.1' is not an address of this host"
    )
    # a data path that is not here: refused before any learner starts, as in-process
    assert main(["train", "--data", "text:/nonexistent", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        "ddiloco train: error: data.source 'text:/nonexistent': /nonexistent does not exist; "
        f"check the path (relative paths are resolved from {Path.cwd()})\n"
    )
    assert not (tmp_path / "logs").exists()


@pytest.mark.timeout(120)
def test_json_and_the_results_table_on_the_real_runtime(tmp_path, capsys):
    from ddiloco.cli import main

    argv = ["train", *TINY_FLAGS, "-P", "4", "-H", "8", "-M", "2", "--steps", "30"]
    assert main([*argv, "--out", str(tmp_path / "a"), "--json"]) == 0
    out = capsys.readouterr().out
    s = json.loads(out)  # stdout is the summary alone
    assert s["engine"] == "processes" and s["ok"] and s["merges"] > 0
    assert s == json.loads((tmp_path / "a" / "summary.json").read_text())
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["method", "decoupled", "(processes,", "M=2)"]
    assert any(r.startswith("final eval loss") for r in table)
    assert table[-1] == f"wrote {tmp_path / 'b'}/summary.json, metrics.jsonl and config.toml"
    # the learners share a budget of 2 x 30 steps: the range they took, and why
    s = json.loads((tmp_path / "b" / "summary.json").read_text())
    steps = sorted(pl["steps"] for pl in s["per_learner"])
    span = f"{steps[0]}-{steps[-1]}" if steps[0] < steps[-1] else f"{steps[0]}"
    rows = _table("\n".join(table))
    assert rows["inner steps / learner"] == f"{span} (shared budget of 60)"
    assert sum(steps) >= 60 and rows["tokens"] == f"{sum(steps) * 8 * 32:,}"


def _table(stdout: str) -> dict[str, str]:
    """The results table of ``ddiloco train``: row name -> value."""
    import re

    return dict(re.split(r"\s{2,}", ln, maxsplit=1) for ln in stdout.splitlines() if "  " in ln)


@pytest.mark.timeout(150)
def test_ctrl_c_ends_the_run_as_interrupted_with_what_it_trained_and_its_model(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from ddiloco.runtime.export import state_dict_from_checkpoint

    out = tmp_path / "run"
    argv = [sys.executable, "-m", "ddiloco.cli", "train", *TINY_FLAGS, "-M", "2"]
    argv += ["--steps", "100000", "--eval-every", "10", "--out", str(out)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        if all(
            (out / f"learner_{m}" / "metrics.jsonl").is_file()
            and sum(r["kind"] == "step" for r in read_jsonl(out / f"learner_{m}" / "metrics.jsonl"))
            >= 40
            for m in (0, 1)
        ):
            break
        time.sleep(0.2)
    time.sleep(1.5)  # a few status polls: the evaluations of those steps
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, (stdout, stderr)
    assert "Traceback" not in stderr, stderr
    s = json.loads((out / "summary.json").read_text())
    table = _table(stdout)
    assert s["interrupted"] and not s["ok"]
    assert stdout.splitlines()[0].split(None, 1) == ["status", "interrupted (Ctrl-C)"]
    # what the learners trained, not the budget
    steps = [pl["steps"] for pl in s["per_learner"]]
    assert min(steps) >= 40 and sum(steps) < 200_000
    assert table["inner steps / learner"] == (
        f"{min(steps):,}-{max(steps):,} ({sum(steps):,} of a shared budget of 200,000)"
        if min(steps) < max(steps)
        else f"{steps[0]:,} ({sum(steps):,} of a shared budget of 200,000)"
    )
    assert s["tokens"] == sum(steps) * 8 * 32 and table["tokens"] == f"{s['tokens']:,}"
    # the model that exists: the syncer's last checkpoint, evaluated and named
    _, meta = state_dict_from_checkpoint(out)
    assert s["final_model"]["source"] == "checkpoint" and s["merges"] == meta["merges"] > 0
    assert table["global model"] == (
        f"the syncer's last checkpoint ({meta['merges']:,} merges); "
        f"`ddiloco export {out}` writes it"
    )
    assert table["final eval loss"] == f"{s['final_eval_loss']:.4f}"
    assert s["final_eval_loss"] < s["initial_eval_loss"]
    # the global model evaluated on the in-process engine's schedule while it trained
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals[0]["step"] == 0 and len(evals) >= 2, evals
    later = [r["step"] for r in evals[1:]]
    assert later == sorted(later) and later[0] >= 10 and later[-1] <= sum(steps) / 2


@pytest.mark.timeout(120)
def test_a_missing_optional_dependency_or_unreadable_data_is_one_line_before_any_start(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "run"
    argv = ["train", "--model", "vit_digits", "--data", "digits", "-M", "2", "--steps", "20"]
    argv += ["--no-progress", "--out", str(out)]
    # scikit-learn made unimportable in the launcher's interpreter only
    code = (
        "import sys\nsys.modules['sklearn'] = None\nfrom ddiloco.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert (r.returncode, r.stdout) == (2, ""), r
    assert r.stderr == (
        "ddiloco train: error: the digits dataset needs scikit-learn: pip install scikit-learn\n"
    )
    assert not (out / "logs").exists()  # no syncer, no learner started
    # data the launcher cannot read either: a folder without text
    (tmp_path / "empty").mkdir()
    argv = ["train", *TINY_FLAGS, "--data", f"text:{tmp_path / 'empty'}", "--out", str(out)]
    r = subprocess.run([sys.executable, "-m", "ddiloco.cli", *argv], capture_output=True, text=True)
    assert (r.returncode, r.stdout) == (2, ""), r
    assert r.stderr == (
        f"ddiloco train: error: no .txt/.md files under {tmp_path / 'empty'}; add some, or pass "
        f"all_files=True to read every file\n"
    )
    assert not (out / "logs").exists()
