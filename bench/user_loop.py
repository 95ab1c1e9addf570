"""`DecoupledLearner` in a plain user loop, with learners SIGKILLed and restarted.

Task: MLP regression against a fixed random teacher MLP (inputs N(0, I), targets the
teacher's output plus Gaussian noise of std 0.1; eval MSE against the noiseless teacher on
4096 held-out inputs). Each learner is its own process running an ordinary PyTorch loop
(AdamW, cosine learning rate on ``dl.global_step``) through ``ddiloco.DecoupledLearner``;
a real ``ddiloco syncer`` process merges; the syncer's step budget (M x STEPS) makes every
run train on the same number of samples.

Runs:
  kill    K = 1 + grace window; every ~KILL_EVERY s one learner (seeded choice) gets SIGKILL
          and is started again after 1 s, as a user's supervisor would;
  sync    K = M, no kills: every merge holds all learners (synchronous DiLoCo);
  nokill  K = 1 + grace window, no kills (reference).

--wild (issue 26's wild learner, against the merge guard): K = 1 + grace window, no random
kills; once the syncer has counted WILD_AT of its step budget, learner 0 gets SIGKILL and is
started again at once (its new process was started ahead and waits, imports done, to join
then) with a fresh AdamW at a constant lr of WILD_LR (1e-2) for WILD_STEPS
(100) steps, then the optimizer's state is cleared (a fresh AdamW of the run's configuration)
and its loop goes on. One run per merge-guard setting (--clips, the syncer's --norm-clip;
0 turns the guard off). The supervisor exports the syncer's global model every SAMPLE_EVERY
s and evaluates it: reported are its eval MSE just before the kill, when the wild steps end,
the worst one after the restart, and at the end, with the pushes the guard clipped. Data
streams are seeded by (seed, learner, incarnation) in this mode.

Reported per run: the syncer's global model's eval MSE at the end, each learner's local
model's eval MSE at the end of its loop (its last process), their mean, learners per
merge, kills, and the local models' parameters averaged. Writes bench/results/user_loop.json
and prints a markdown table (the measured figures are in docs/results/user_loop.md).

Usage: python bench/user_loop.py [--steps 400] [--runs kill,sync,nokill] [--seed 0]
       python bench/user_loop.py --wild [--clips 0,2.5] [--wild-at 0.5] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
D_IN, WIDTH, DEPTH, NOISE = 32, 256, 3, 0.1


def mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    d = D_IN
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(d, WIDTH), torch.nn.GELU()]
        d = WIDTH
    layers.append(torch.nn.Linear(d, 1))
    return torch.nn.Sequential(*layers)


def teacher_and_eval(seed: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    teacher = mlp(10_000 + seed)
    with torch.no_grad():
        for p in teacher.parameters():
            p.mul_(2.0)  # a less smooth target than a default-initialised net
        g = torch.Generator().manual_seed(20_000 + seed)
        x = torch.randn(4096, D_IN, generator=g)
        return teacher, x, teacher(x)


@torch.no_grad()
def eval_mse(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float(torch.nn.functional.mse_loss(model(x), y))


# -- one learner: the user's own loop ----------------------------------------------------------
def worker(a: argparse.Namespace) -> None:
    import ddiloco

    torch.set_num_threads(1)
    teacher, x_eval, y_eval = teacher_and_eval(a.seed)
    model = mlp(a.seed)  # every learner builds the same initial model
    wild = a.wild_restart > 0  # this process is the bad restart
    opt = torch.optim.AdamW(model.parameters(), lr=a.wild_lr if wild else a.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(a.seed * 1000 + a.learner * 97 + os.getpid())
    while a.wait_for and not Path(a.wait_for).exists():  # started ahead, imports done
        time.sleep(0.01)
    with ddiloco.DecoupledLearner(
        model,
        opt,
        syncer=a.syncer,
        learner=a.learner,
        P=a.P,
        H=a.H,
        tau=2,
        codec="bf16",
        tokens_per_step=a.batch,
        heartbeat_interval=timedelta(milliseconds=250),
    ) as dl:
        start = dl.global_step
        if a.seeded:  # --wild: data seeded by (seed, learner, incarnation), not by pid
            g.manual_seed(a.seed * 1000 + a.learner * 97 + 7919 * dl.incarnation)
        n = 0
        while not dl.should_stop:
            if wild and n == a.wild_restart:  # the wild steps are over: a fresh AdamW
                opt.state.clear()
                wild = False
                Path(a.result).with_suffix(".wild_done").write_text(str(dl.global_step))
            n += 1
            t = min(dl.global_step / a.steps, 1.0)
            for group in opt.param_groups:  # cosine to 10% over the learner's share
                group["lr"] = (
                    a.wild_lr if wild else a.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))
                )
            x = torch.randn(a.batch, D_IN, generator=g)
            with torch.no_grad():
                y = teacher(x) + NOISE * torch.randn(a.batch, 1, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()  # the post-step hook calls dl.step()
            opt.zero_grad()
        local = eval_mse(model, x_eval, y_eval)
        torch.save(model.state_dict(), Path(a.result).with_suffix(".pt"))
        steps = dl.global_step
    Path(a.result).write_text(
        json.dumps(
            {
                "learner": a.learner,
                "local_eval_mse": local,
                "start_step": start,
                "global_step": steps,
                "incarnation": dl.incarnation,
            }
        )
    )


# -- the supervisor ------------------------------------------------------------------------------
def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ddiloco.runtime.cli", *args]


def _start_syncer(
    run: Path, a: argparse.Namespace, quorum: int, env: dict, extra: list[str]
) -> tuple[subprocess.Popen, object, str]:
    """A `ddiloco syncer` process for one run: (process, its log, its address)."""
    syncer_log = open(run / "syncer.log", "wb")
    syncer = subprocess.Popen(
        _cli(
            "syncer",
            "--port",
            "0",
            "--port-file",
            str(run / "port"),
            "--quorum",
            str(quorum),
            "--step-budget",
            str(a.learners * a.steps),
            "--heartbeat-timeout",
            "3",
            "--metrics-file",
            str(run / "syncer.jsonl"),
            "--outer-lr",
            str(a.outer_lr),
            "--log-level",
            "warning",
            *a.syncer_args.split(),
            *extra,
        ),
        env=env,
        stdout=syncer_log,
        stderr=subprocess.STDOUT,
    )
    while not (run / "port").is_file():
        if syncer.poll() is not None:
            raise RuntimeError((run / "syncer.log").read_text())
        time.sleep(0.05)
    return syncer, syncer_log, f"127.0.0.1:{(run / 'port').read_text()}"


def _fresh_dir(run: Path) -> None:
    run.mkdir(parents=True, exist_ok=True)
    for f in run.iterdir():
        if f.is_file():
            f.unlink()


ENV = {**os.environ, "DDILOCO_TOKEN": "bench-token", "PYTHONPATH": str(ROOT / "src")}


def one_run(name: str, a: argparse.Namespace, out: Path) -> dict:
    from ddiloco.runtime.export import state_dict_from_syncer

    run = out / name
    _fresh_dir(run)
    env = ENV
    quorum = a.learners if name == "sync" else 1
    kills = name == "kill"
    syncer, syncer_log, address = _start_syncer(run, a, quorum, env, [])
    procs: dict[int, subprocess.Popen] = {}
    logs = {m: open(run / f"learner_{m}.log", "ab") for m in range(a.learners)}

    def start(m: int) -> None:
        procs[m] = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                "--syncer",
                address,
                "--learner",
                str(m),
                "--result",
                str(run / f"learner_{m}.json"),
                *a.worker_args,
            ],
            env=env,
            stdout=logs[m],
            stderr=subprocess.STDOUT,
        )

    t0 = time.monotonic()
    for m in range(a.learners):
        start(m)
    rng = random.Random(a.seed)
    next_kill = t0 + a.kill_every * (0.75 + 0.5 * rng.random())
    restart_at: dict[int, float] = {}
    n_kills = 0
    while True:
        now = time.monotonic()
        for m, at in list(restart_at.items()):
            if now >= at:
                del restart_at[m]
                start(m)
        if kills and now >= next_kill:
            alive = [m for m, p in procs.items() if p.poll() is None and m not in restart_at]
            if alive:
                m = rng.choice(alive)
                procs[m].send_signal(signal.SIGKILL)
                procs[m].wait()
                (run / f"learner_{m}.json").unlink(missing_ok=True)
                (run / f"learner_{m}.pt").unlink(missing_ok=True)
                restart_at[m] = now + 1.0
                n_kills += 1
            next_kill = now + a.kill_every * (0.75 + 0.5 * rng.random())
        if not restart_at and all(p.poll() is not None for p in procs.values()):
            break
        if now - t0 > a.timeout_s:
            raise RuntimeError(f"{name}: learners still running after {a.timeout_s} s")
        time.sleep(0.1)
    wall = time.monotonic() - t0
    bad = {m: p.returncode for m, p in procs.items() if p.returncode != 0}
    if bad:
        raise RuntimeError(f"{name}: learners exited with {bad}; see {run}")
    time.sleep(1.0)  # the last merges of the leaving learners publish
    sd, meta = state_dict_from_syncer(address, token="bench-token")
    from ddiloco.runtime.learner.client import SyncerClient

    st = SyncerClient(address, "bench-token").status()
    syncer.send_signal(signal.SIGTERM)
    syncer.wait(30)
    syncer_log.close()
    teacher, x_eval, y_eval = teacher_and_eval(a.seed)
    model = mlp(a.seed)
    init_mse = eval_mse(model, x_eval, y_eval)
    model.load_state_dict(sd)
    global_mse = eval_mse(model, x_eval, y_eval)
    learners = [json.loads((run / f"learner_{m}.json").read_text()) for m in range(a.learners)]
    merges = [json.loads(x) for x in (run / "syncer.jsonl").read_text().splitlines()]
    sizes = [len(r["learners"]) for r in merges if r.get("kind") == "merge"]
    local = [r["local_eval_mse"] for r in learners]
    sds = [torch.load(run / f"learner_{m}.pt") for m in range(a.learners)]
    model.load_state_dict({n: sum(sd[n] for sd in sds) / len(sds) for n in sds[0]})
    avg_mse = eval_mse(model, x_eval, y_eval)  # the local models' parameters averaged
    res = {
        "run": name,
        "quorum": quorum,
        "kills": n_kills,
        "wall_s": round(wall, 1),
        "initial_eval_mse": round(init_mse, 5),
        "global_eval_mse": round(global_mse, 5),
        "local_eval_mse": [round(v, 5) for v in local],
        "mean_local_eval_mse": round(statistics.mean(local), 5),
        "global_over_mean_local": round(global_mse / statistics.mean(local), 4),
        "averaged_locals_eval_mse": round(avg_mse, 5),
        "merges": len(sizes),
        "learners_per_merge": round(statistics.mean(sizes), 3) if sizes else None,
        "steps_total": sum(r["global_step"] for r in learners),
        "samples_total": sum(r["global_step"] for r in learners) * a.batch,
        "syncer_steps_done": st.get("steps_done"),
        "versions": meta["versions"],
    }
    print(f"  {json.dumps(res)}", file=sys.stderr, flush=True)
    return res


def wild_run(clip: float, a: argparse.Namespace, out: Path) -> dict:
    """Issue 26's wild learner with the merge guard at ``clip`` (0: off); see the docstring."""
    from ddiloco.runtime.export import state_dict_from_syncer
    from ddiloco.runtime.learner.client import SyncerClient

    name = f"wild_clip{clip:g}"
    run = out / name
    _fresh_dir(run)
    syncer, syncer_log, address = _start_syncer(run, a, 1, ENV, ["--norm-clip", str(clip)])
    client = SyncerClient(address, "bench-token")
    teacher, x_eval, y_eval = teacher_and_eval(a.seed)
    model = mlp(a.seed)
    init_mse = eval_mse(model, x_eval, y_eval)
    budget = a.learners * a.steps
    procs: dict[int, subprocess.Popen] = {}
    logs = {m: open(run / f"learner_{m}.log", "ab") for m in range(a.learners)}

    def start(m: int) -> None:
        procs[m] = subprocess.Popen(
            [sys.executable, __file__, "--worker", "--syncer", address, "--learner", str(m)]
            + ["--result", str(run / f"learner_{m}.json"), *a.worker_args],
            env=ENV,
            stdout=logs[m],
            stderr=subprocess.STDOUT,
        )

    samples: list[dict] = []

    def sample(phase: str) -> dict | None:
        try:
            st = client.status()
            sd, _ = state_dict_from_syncer(address, token="bench-token")
        except Exception:  # no learner has joined yet
            return None
        model.load_state_dict(sd)
        r = {
            "t": round(time.monotonic() - t0, 2),
            "phase": phase,
            "steps_done": st.get("steps_done"),
            "eval_mse": round(eval_mse(model, x_eval, y_eval), 5),
            "clipped_pushes": (st.get("counters") or {}).get("clipped_pushes", 0),
        }
        samples.append(r)
        return r

    t0 = time.monotonic()
    for m in range(a.learners):
        start(m)
    phase, next_sample, next_poll = "before", t0, t0
    go = run / "wild_go"
    wild = ("--wild-restart", str(a.wild_steps), "--wild-lr", str(a.wild_lr))
    spare = subprocess.Popen(  # the bad restart, started ahead: it joins once `go` exists
        [sys.executable, __file__, "--worker", "--syncer", address, "--learner", "0"]
        + ["--result", str(run / "learner_0.json"), *a.worker_args, *wild]
        + ["--wait-for", str(go)],
        env=ENV,
        stdout=logs[0],
        stderr=subprocess.STDOUT,
    )
    kill = restart = wild_end = None
    while True:
        now = time.monotonic()
        if phase == "before" and now >= next_poll:
            next_poll = now + 0.2
            try:
                done = client.status().get("steps_done") or 0
            except Exception:
                done = 0
            if done >= a.wild_at * budget:
                kill = sample("before")
                procs[0].send_signal(signal.SIGKILL)
                procs[0].wait()
                (run / "learner_0.json").unlink(missing_ok=True)
                go.touch()
                procs[0] = spare
                restart, phase = time.monotonic() - t0, "wild"
        if phase == "wild" and (run / "learner_0.wild_done").is_file():
            wild_end, phase = sample("wild_end"), "after"
            next_sample = now + a.sample_every
        if now >= next_sample:
            sample(phase)
            next_sample = now + a.sample_every
        if phase != "before" and all(p.poll() is not None for p in procs.values()):
            break
        if now - t0 > a.timeout_s:
            raise RuntimeError(f"{name}: learners still running after {a.timeout_s} s")
        time.sleep(0.05)
    wall = time.monotonic() - t0
    bad = {m: p.returncode for m, p in procs.items() if p.returncode != 0}
    if bad:
        raise RuntimeError(f"{name}: learners exited with {bad}; see {run}")
    if wild_end is None:
        raise RuntimeError(f"{name}: the run ended before the wild steps did; see {run}")
    time.sleep(1.0)  # the last merges of the leaving learners publish
    final = sample("final")
    syncer.send_signal(signal.SIGTERM)
    syncer.wait(30)
    syncer_log.close()
    after = [r for r in samples if r["t"] >= kill["t"] and r["phase"] != "before"]
    worst = max(after, key=lambda r: r["eval_mse"])
    merges = [json.loads(x) for x in (run / "syncer.jsonl").read_text().splitlines()]
    sizes = [len(r["learners"]) for r in merges if r.get("kind") == "merge"]
    res = {
        "run": name,
        "norm_clip": clip,
        "initial_eval_mse": round(init_mse, 5),
        "before_restart": kill,
        "wild_restart_at_s": round(restart, 2),
        "at_wild_end": wild_end,
        "worst_after_restart": worst,
        "final": final,
        "clipped_pushes": final["clipped_pushes"],
        "merges": len(sizes),
        "learners_per_merge": round(statistics.mean(sizes), 3) if sizes else None,
        "wall_s": round(wall, 1),
        "samples": samples,
    }
    brief = {k: v for k, v in res.items() if k != "samples"}
    print(f"  {json.dumps(brief)}", file=sys.stderr, flush=True)
    return res


def wild_main(a: argparse.Namespace, cmd: str) -> None:
    out = Path(a.out)
    runs = [wild_run(float(c), a, out) for c in a.clips.split(",")]
    result = {
        "command": cmd,
        "task": {
            "model": f"MLP {D_IN}-{WIDTH}x{DEPTH}-1 (GELU)",
            "batch": a.batch,
            "lr": a.lr,
            "P": a.P,
            "H": a.H,
            "tau": 2,
            "quorum": 1,
            "outer_lr": a.outer_lr,
            "outer_momentum": 0.9,
            "learners": a.learners,
            "steps_per_learner": a.steps,
            "seed": a.seed,
            "wild": {
                "learner": 0,
                "at_fraction_of_budget": a.wild_at,
                "steps": a.wild_steps,
                "lr": a.wild_lr,
            },
        },
        "runs": runs,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "user_loop_wild.json").write_text(json.dumps(result, indent=1))
    lines = [
        "| norm_clip | before the restart | wild steps end | worst after | final "
        "| pushes clipped | learners per merge | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['norm_clip']:g}{' (off)' if not r['norm_clip'] else ''} "
            f"| {r['before_restart']['eval_mse']} | {r['at_wild_end']['eval_mse']} "
            f"| {r['worst_after_restart']['eval_mse']} (t {r['worst_after_restart']['t']} s) "
            f"| {r['final']['eval_mse']} | {r['clipped_pushes']} | {r['learners_per_merge']} "
            f"| {r['wall_s']} |"
        )
    print(f"command: {cmd}\n" + "\n".join(lines))
    print(f"JSON: {out / 'user_loop_wild.json'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--syncer", help=argparse.SUPPRESS)
    ap.add_argument("--learner", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--learners", "-M", type=int, default=4)
    ap.add_argument("--steps", type=int, default=400, help="inner steps per learner (budget / M)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("-P", type=int, default=4, dest="P")
    ap.add_argument("-H", type=int, default=20, dest="H")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--syncer-args", default="", help="more `ddiloco syncer` flags")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill-every", type=float, default=20.0)
    ap.add_argument("--runs", default="kill,sync,nokill")
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--out", default="runs/user_loop")
    ap.add_argument("--tag", default="", help="suffix of the result files")
    ap.add_argument("--wild", action="store_true", help="the wild-learner runs (issue 26)")
    ap.add_argument("--clips", default="0,2.5", help="--wild: syncer --norm-clip values")
    ap.add_argument("--wild-at", type=float, default=0.5, help="--wild: fraction of budget")
    ap.add_argument("--wild-steps", type=int, default=100)
    ap.add_argument("--wild-lr", type=float, default=1e-2)
    ap.add_argument("--sample-every", type=float, default=1.0, help="--wild: export every s")
    ap.add_argument("--seeded", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--wild-restart", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--wait-for", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.worker_args = [
        "--steps",
        str(a.steps),
        "--batch",
        str(a.batch),
        "--lr",
        str(a.lr),
        "-P",
        str(a.P),
        "-H",
        str(a.H),
        "--seed",
        str(a.seed),
        *(["--seeded"] if a.wild else []),
    ]
    if a.worker:
        worker(a)
        return
    cmd = "python bench/user_loop.py " + " ".join(sys.argv[1:])
    if a.wild:
        wild_main(a, cmd)
        return
    runs = [one_run(name, a, Path(a.out)) for name in a.runs.split(",")]
    n_params = sum(p.numel() for p in mlp(0).parameters())
    result = {
        "command": cmd,
        "task": {
            "model": f"MLP {D_IN}-{WIDTH}x{DEPTH}-1 (GELU)",
            "parameters": n_params,
            "batch": a.batch,
            "noise_std": NOISE,
            "lr": a.lr,
            "P": a.P,
            "H": a.H,
            "tau": 2,
            "outer_lr": a.outer_lr,
            "learners": a.learners,
            "steps_per_learner": a.steps,
        },
        "runs": runs,
    }
    by = {r["run"]: r for r in runs}
    if "kill" in by and "sync" in by:
        result["kill_global_vs_sync_global"] = round(
            by["kill"]["global_eval_mse"] / by["sync"]["global_eval_mse"] - 1, 4
        )
    tag = f"_{a.tag}" if a.tag else ""
    (ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
    (ROOT / "bench" / "results" / f"user_loop{tag}.json").write_text(json.dumps(result, indent=2))
    lines = [
        "| run | K | kills | learners per merge | samples | global eval MSE | mean local "
        "eval MSE | global / mean local | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['run']} | {r['quorum']} | {r['kills']} | {r['learners_per_merge']} | "
            f"{r['samples_total']:,} | {r['global_eval_mse']} | {r['mean_local_eval_mse']}"
            f" | {r['global_over_mean_local']} | {r['wall_s']} |"
        )
    if "kill_global_vs_sync_global" in result:
        lines.append(
            f"\nkill run's global model vs the synchronous run's: "
            f"{100 * result['kill_global_vs_sync_global']:+.2f}% eval MSE"
        )
    print(f"command: {cmd}\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
