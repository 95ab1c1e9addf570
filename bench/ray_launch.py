"""The Ray launch backend against the built-in launcher, on the same run configuration.

Runs ``ddiloco train -M 3 --steps STEPS --seed SEED`` (defaults otherwise: gpt_tiny, the
synthetic language, P = 8, H = 24, tau = 2) four ways, each as its own ``ddiloco`` command:

- ``local``: the built-in launcher (processes on this host, fork server);
- ``ray-local``: ``--launcher ray`` without an address (the run starts a local Ray cluster);
- ``ray-2node``: ``--launcher ray --ray-address`` of a cluster of two Ray nodes on this
  machine (``ray start --head`` plus ``ray start --address``, 2 CPUs each);
- ``ray-2node-kills[...]``: the same, learner 1's Ray worker SIGKILLed from outside at each
  listed step, for each list of ``--kills`` (Ray restarts the actor; the learner resumes and
  rejoins under its own id).

Reported per run: wall time of the command, time from the command's start to the first inner
step of any learner, goodput, final eval loss, merges, and for the kills the time from each
SIGKILL to the restarted learner's first step.

Writes bench/results/ray_launch.json and docs/results/ray_launch.md.
Usage: python bench/ray_launch.py [--steps 800] [--seed 1] [--kills '150;150,450']
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

from ray_helpers import DDILOCO, train_with_kills, two_node_cluster  # noqa: E402

from ddiloco.metrics.sinks import read_jsonl  # noqa: E402


def _step_walls(out: Path) -> dict[int, list[float]]:
    walls = {}
    for d in sorted(out.glob("learner_*")):
        rows = read_jsonl(d / "metrics.jsonl") if (d / "metrics.jsonl").is_file() else []
        walls[int(d.name.split("_")[1])] = [r["wall"] for r in rows if r["kind"] == "step"]
    return walls


def _record(name: str, cmd: list[str], out: Path, t_launch: float, wall_s: float, rc: int) -> dict:
    s = json.loads((out / "summary.json").read_text())
    walls = _step_walls(out)
    first = min(w[0] for w in walls.values() if w)
    return {
        "name": name,
        "command": " ".join(cmd),
        "rc": rc,
        "ok": s["ok"],
        "wall_s": round(wall_s, 2),
        "first_step_s": round(first - t_launch, 2),
        "train_wall_s": s["train_wall_s"],
        "goodput": round(s["goodput"], 4),
        "final_eval_loss": round(s["final_eval_loss"], 4),
        "merges": s["merges"],
        "steps": {p["learner"]: p["steps"] for p in s["per_learner"]},
        "starts": {p["learner"]: p["starts"] for p in s["per_learner"]},
        "ray_nodes": (s.get("ray") or {}).get("nodes"),
        "ray_connect_s": (s.get("ray") or {}).get("connect_s"),
    }


def run_plain(name: str, args: list[str], out: Path, env: dict | None = None) -> dict:
    cmd = [str(DDILOCO), "train", "--out", str(out), *args]
    t = time.time()
    with open(f"{out}.log", "wb") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    return _record(name, cmd, out, t, time.time() - t, rc)


def run_ray(name: str, args: list[str], out: Path, env: dict, kill_at: tuple[int, ...]) -> dict:
    t = time.time()
    run = train_with_kills(out, args, env, kill_at_steps=kill_at, timeout_s=1200)
    cmd = [str(DDILOCO), "train", "--launcher", "ray", "--out", str(out), *args]
    rec = _record(name, cmd, out, t, run.wall_s, run.rc)
    if kill_at:
        walls = _step_walls(out)[1]
        rec["kills"] = [
            {
                "step": k["step"],
                "worker": k["cmdline"],
                "restart_to_step_s": round(min(w for w in walls if w > k["wall"]) - k["wall"], 2),
            }
            for k in run.kills
        ]
    return rec


def markdown(res: dict) -> str:
    rows = {r["name"]: r for r in res["runs"]}
    base = rows["local"]
    lines = [
        "# Ray launch backend against the built-in launcher",
        "",
        f"`python bench/ray_launch.py --steps {res['steps']} --seed {res['seed']} "
        f"--kills '{res['kills']}'` on {res['machine']}; "
        f"M = 3 learners x {res['steps']} steps, gpt_tiny, defaults otherwise.",
        "",
        "| run | wall (s) | first step (s) | train (s) | goodput | final eval loss | merges |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        lines.append(
            f"| {r['name']} | {r['wall_s']} | {r['first_step_s']} | {r['train_wall_s']} | "
            f"{r['goodput']:.3f} | {r['final_eval_loss']:.4f} | {r['merges']} |"
        )
    lines += ["", "Against `local`:", ""]
    for n, r in rows.items():
        if n != "local":
            lines.append(
                f"- {n}: wall {r['wall_s'] - base['wall_s']:+.1f} s "
                f"({r['wall_s'] / base['wall_s']:.2f}x), first step "
                f"{r['first_step_s'] - base['first_step_s']:+.1f} s"
            )
    for r in res["runs"]:
        for k in r.get("kills", []):
            lines.append(
                f"- {r['name']}: SIGKILL of `{k['worker']}` at step {k['step']}: the restarted "
                f"learner's first step {k['restart_to_step_s']} s later"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kills", default="150;150,450", help="kill lists, ';' between runs")
    ap.add_argument("--out", default="/tmp/ddiloco_ray_bench")
    a = ap.parse_args()
    kill_lists = [tuple(int(x) for x in k.split(",") if x) for k in a.kills.split(";")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    args = ["-M", "3", "--steps", str(a.steps), "--seed", str(a.seed), "--no-progress"]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    runs = [run_plain("local", args, out / "local", env)]
    print(runs[-1], flush=True)
    runs.append(run_plain("ray-local", ["--launcher", "ray", *args], out / "ray-local", env))
    print(runs[-1], flush=True)
    with two_node_cluster(cpus=2) as c:
        ray_args = ["--ray-address", c.address, *args]
        runs.append(run_ray("ray-2node", ray_args, out / "ray-2node", c.env, ()))
        print(runs[-1], flush=True)
        for kills in kill_lists:
            name = f"ray-2node-kills[{','.join(map(str, kills))}]"
            runs.append(run_ray(name, ray_args, out / f"kills{len(runs)}", c.env, kills))
            print(runs[-1], flush=True)
    load = os.getloadavg()
    res = {
        "steps": a.steps,
        "seed": a.seed,
        "kills": a.kills,
        "machine": f"{os.cpu_count()} cores shared with other jobs (load average "
        f"{load[0]:.1f} at the end)",
        "runs": runs,
    }
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "ray_launch.json").write_text(json.dumps(res, indent=2))
    (ROOT / "docs" / "results" / "ray_launch.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
