"""``ddiloco launch --backend slurm``: one sbatch script for a run across Slurm nodes.

The script runs the syncer (its S shards) on the job's first node and each learner m as a
torchrun island (``runtime.island_size`` ranks, DDP inside) on nodes of its own::

    node 0                   syncer shards 0..S-1 (gRPC PORT+k, data port BULK_PORT+k)
    nodes 1..K               island 0 = learner 0 (srun torchrun, c10d rendezvous on node 1)
    nodes K+1..2K            island 1 = learner 1
    ...

Every process reads the run's ``config.toml`` (written beside the script, on a filesystem
every node sees) and the shared secret from the token file it names. The script restarts
what dies: a syncer shard resumes from its checkpoint, an island that exits with an error
is started again with the same learner id and resumes from its run directory (inside an
island, torchrun's ``--max-restarts`` restarts its ranks first). When every island is done
the script records the syncer's status, stops the shards (SIGTERM: a final checkpoint) and
writes ``summary.json``.

``python -m ddiloco.runtime.launch.slurm {status,summarise} OUT`` are the script's last two
steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template

__all__ = [
    "SlurmOptions",
    "SlurmJob",
    "render_sbatch",
    "write_slurm_job",
    "submit",
    "launch",
    "summarise",
    "main",
]


@dataclass(kw_only=True, slots=True)
class SlurmOptions:
    """Where and how the job runs. What runs (model, M = islands, island size, shards,
    ports, token) is the run's ``TrainConfig``."""

    nodes_per_island: int = 1
    """Nodes of each island; its ``runtime.island_size`` ranks are split evenly across them
    (island_size / nodes_per_island per node)."""
    single_node: bool = False
    """Run the syncer and every island on one node (a workstation or a one-node cluster);
    else the syncer has a node of its own and each island its own nodes."""
    partition: str | None = None
    """sbatch --partition."""
    time_limit: str | None = None
    """sbatch --time, e.g. 02:00:00."""
    account: str | None = None
    """sbatch --account."""
    gpus_per_node: int | None = None
    """sbatch --gpus-per-node (the islands' ranks then train on cuda:LOCAL_RANK)."""
    job_name: str = "ddiloco"
    """sbatch --job-name."""
    sbatch_args: tuple[str, ...] = ()
    """More sbatch options, one per #SBATCH line (e.g. --qos=high, --exclusive)."""
    python: str = sys.executable
    """The Python (absolute path) with ddiloco installed, the same path on every node."""
    rdzv_port: int = 29400
    """Island m's c10d rendezvous listens on its first node at rdzv_port + m."""
    syncer_restarts: int = 100
    """Times the script restarts a syncer shard that exits (resuming from its checkpoint)."""
    island_restarts: int = 3
    """Times the script starts an island again after it exits with an error."""
    torchrun_restarts: int = 0
    """torchrun --max-restarts: restarts of an island's ranks inside one start."""
    restart_delay_s: float = 1.0
    """Seconds before a restart."""

    def __post_init__(self) -> None:
        if self.nodes_per_island < 1:
            raise ValueError(f"nodes_per_island must be >= 1, got {self.nodes_per_island}")
        for name in ("syncer_restarts", "island_restarts", "torchrun_restarts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not (self.restart_delay_s >= 0 and math.isfinite(self.restart_delay_s)):
            raise ValueError(f"restart_delay_s must be >= 0, got {self.restart_delay_s}")
        if self.single_node and self.nodes_per_island != 1:
            raise ValueError(
                f"single_node puts every island on one node: nodes_per_island must be 1, "
                f"got {self.nodes_per_island}"
            )
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if not 1 <= self.rdzv_port <= 65535:
            raise ValueError(f"rdzv_port must be in [1, 65535], got {self.rdzv_port}")
        for name in ("partition", "time_limit", "account", "job_name"):
            v = getattr(self, name)
            if v is not None and not re.fullmatch(r"[A-Za-z0-9_.:,+\-]+", v):
                raise ValueError(
                    f"{name} {v!r}: use letters, digits and _.:,+- only (no spaces or quotes)"
                )
        for a in self.sbatch_args:
            if not a.startswith("-") or "\n" in a or "\r" in a:
                raise ValueError(
                    f"sbatch option {a!r}: give one option per entry, starting with - "
                    f"(e.g. --qos=high)"
                )
        if not os.path.isabs(self.python):
            raise ValueError(
                f"python {self.python!r} must be an absolute path (the same on every node)"
            )


@dataclass(frozen=True, slots=True)
class SlurmJob:
    """What ``write_slurm_job`` wrote."""

    script: Path
    config: Path
    token_file: Path
    nodes: int

    def submit_command(self) -> str:
        return f"sbatch {shlex.quote(str(self.script))}"


def _check_config(cfg) -> None:
    from ddiloco.runtime.launch.backends import check_runnable

    check_runnable(cfg, "slurm")


DEFAULT_PORT = 50051
"""Shard 0's gRPC port where ``runtime.port`` is 0 (a job needs one known in advance)."""


def _ports(cfg) -> tuple[int, int]:
    """(first gRPC port, first data port or -1) of the shards."""
    S = cfg.runtime.shards  # noqa: N806
    port = cfg.runtime.port or DEFAULT_PORT
    bulk = cfg.runtime.bulk_port
    if bulk == 0:
        bulk = port + S
    for name, first in (("runtime.port", port), ("runtime.bulk_port", bulk)):
        if first != -1 and first + S - 1 > 65535:
            raise ValueError(f"{name} {first} + {S} shards runs past port 65535")
    if bulk != -1 and not (bulk + S <= port or port + S <= bulk):
        raise ValueError(
            f"the shards' gRPC ports {port}..{port + S - 1} and data ports "
            f"{bulk}..{bulk + S - 1} overlap"
        )
    return port, bulk


HEADER = Template("""\
#!/bin/bash
# Decoupled DiLoCo on Slurm, written by `ddiloco launch --backend slurm`: the syncer
# ($shards shard(s)) on the first node, $islands torchrun island(s) of $island_size rank(s).
# Submit with: sbatch $script
#SBATCH --job-name=$job_name
#SBATCH --nodes=$nodes
#SBATCH --ntasks-per-node=1
#SBATCH --output=$log_pattern
${sbatch_lines}
OUT=$out
PYTHON=$python
# learners M, one island each (learner id = island index), and the ranks of an island on
# each of its nodes; SINGLE_NODE=1: the syncer and every island share the first node
ISLANDS=$islands
NODES_PER_ISLAND=$nodes_per_island
PROCS_PER_NODE=$procs_per_node
SINGLE_NODE=$single_node
# shard k: gRPC port PORT + k, data port BULK_PORT + k (-1: off); shard 0's dashboard and
# /metrics on HTTP_PORT (empty: off); island m: c10d rendezvous on its first node at
# RDZV_PORT + m
SHARDS=$shards
PORT=$port
BULK_PORT=$bulk_port
HTTP_PORT=$http_port
RDZV_PORT=$rdzv_port
SYNCER_RESTARTS=$syncer_restarts
ISLAND_RESTARTS=$island_restarts
TORCHRUN_RESTARTS=$torchrun_restarts
RESTART_DELAY_S=$restart_delay_s
""")

BODY = r"""
set -u
CONFIG="$OUT/config.toml"
mkdir -p "$OUT/logs"
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
NEED=$(( SINGLE_NODE ? 1 : 1 + ISLANDS * NODES_PER_ISLAND ))
if (( ${#NODES[@]} < NEED )); then
  echo "ddiloco: this layout needs $NEED nodes; job $SLURM_JOB_ID has ${#NODES[@]}" >&2
  exit 2
fi
SYNCER_HOST=${NODES[0]}
SHARD_LIST=""
for ((k = 0; k < SHARDS; k++)); do SHARD_LIST+="${SHARD_LIST:+,}$SYNCER_HOST:$((PORT + k))"; done
STOP="$OUT/logs/stop.$SLURM_JOB_ID"
rm -f "$STOP"
echo "ddiloco: job $SLURM_JOB_ID on ${NODES[*]}: syncer $SHARD_LIST"

shard_name() { if (( SHARDS > 1 )); then echo "syncer_$1"; else echo syncer; fi; }

# syncer shard k, on the first node; restarted (resuming from its checkpoint) until STOP
syncer() {
  local k=$1 tries=0 rc name ckpt="$OUT/checkpoint" bulk=-1 args=() resume
  name=$(shard_name "$k")
  if (( SHARDS > 1 )); then ckpt="$OUT/checkpoint/shard_$k"; args+=(--shards "$SHARD_LIST" --shard "$k"); fi
  if (( k == 0 )) && [[ -n $HTTP_PORT ]]; then args+=(--http-port "$HTTP_PORT"); fi
  if (( BULK_PORT >= 0 )); then bulk=$((BULK_PORT + k)); fi
  while [[ ! -e $STOP ]]; do
    resume=()
    if compgen -G "$ckpt/syncer.json*" > /dev/null || [[ -f $ckpt/syncer.pt ]]; then
      resume=(--resume)
    fi
    srun --overlap --nodes=1 --ntasks=1 --relative=0 --kill-on-bad-exit=0 --job-name="$name" \
      "$PYTHON" -m ddiloco.runtime.cli syncer --config "$CONFIG" --host 0.0.0.0 \
      --port $((PORT + k)) --bulk-port "$bulk" --checkpoint-dir "$ckpt" \
      --metrics-file "$OUT/$name.metrics.jsonl" --metrics-dir "$OUT" "${args[@]}" "${resume[@]}" \
      >> "$OUT/logs/$name.log" 2>&1
    rc=$?
    if [[ -e $STOP ]]; then break; fi
    if (( tries++ >= SYNCER_RESTARTS )); then
      echo "ddiloco: $name exited ($rc), no restarts left" >&2; break
    fi
    echo "ddiloco: $name exited ($rc): restart $tries, resuming from its checkpoint" >&2
    sleep "$RESTART_DELAY_S"
  done
}

# island m = learner m: srun torchrun on its own nodes; started again after an error exit
island() {
  local m=$1 tries=0 rc first
  first=$(( SINGLE_NODE ? 0 : 1 + m * NODES_PER_ISLAND ))
  while true; do
    srun --overlap --nodes="$NODES_PER_ISLAND" --ntasks="$NODES_PER_ISLAND" \
      --ntasks-per-node=1 --relative="$first" --kill-on-bad-exit=0 --job-name="learner_$m" \
      "$PYTHON" -m torch.distributed.run --nnodes="$NODES_PER_ISLAND" \
      --nproc-per-node="$PROCS_PER_NODE" --max-restarts="$TORCHRUN_RESTARTS" \
      --rdzv-backend=c10d --rdzv-endpoint="${NODES[first]}:$((RDZV_PORT + m))" \
      --rdzv-id="$SLURM_JOB_ID-learner-$m" \
      -m ddiloco.runtime.cli learner --syncer "$SYNCER_HOST:$PORT" --learner "$m" \
      --config "$CONFIG" --run-dir "$OUT/learner_$m" --metrics-dir "$OUT" \
      >> "$OUT/logs/learner_$m.log" 2>&1
    rc=$?
    if (( rc == 0 )); then break; fi
    if (( tries++ >= ISLAND_RESTARTS )); then
      echo "ddiloco: learner_$m exited ($rc), no restarts left" >&2; break
    fi
    echo "ddiloco: learner_$m exited ($rc): start $((tries + 1)), resuming its progress" >&2
    sleep "$RESTART_DELAY_S"
  done
  echo "$rc" > "$OUT/logs/learner_$m.rc"
}

SYNCER_PIDS=() ISLAND_PIDS=()
for ((k = 0; k < SHARDS; k++)); do syncer "$k" & SYNCER_PIDS+=($!); done
for ((m = 0; m < ISLANDS; m++)); do island "$m" & ISLAND_PIDS+=($!); done
wait "${ISLAND_PIDS[@]}"

# every island is done: record the syncer's status, stop the shards (SIGTERM: a final
# checkpoint) and write summary.json
"$PYTHON" -m ddiloco.runtime.launch.slurm status "$OUT" --syncer "$SYNCER_HOST:$PORT"
touch "$STOP"
for ((k = 0; k < SHARDS; k++)); do
  name=$(shard_name "$k")
  for step in $(squeue -h -s -j "$SLURM_JOB_ID" -o "%i %j" | awk -v n="$name" '$2 == n {print $1}'); do
    scancel --signal=TERM "$step"
  done
done
wait "${SYNCER_PIDS[@]}"
"$PYTHON" -m ddiloco.runtime.launch.slurm summarise "$OUT"
"""


def _q(v: object) -> str:
    return shlex.quote(str(v))


def render_sbatch(cfg, opts: SlurmOptions, out: Path) -> tuple[str, int]:
    """(the sbatch script, nodes it asks for) of run ``cfg`` written to directory ``out``."""
    _check_config(cfg)
    if any(c.isspace() for c in str(out)):  # #SBATCH --output cannot be quoted
        raise ValueError(f"the run directory {str(out)!r} must not contain spaces for sbatch")
    rt = cfg.runtime
    if rt.island_size % opts.nodes_per_island:
        raise ValueError(
            f"runtime.island_size {rt.island_size} does not split evenly over "
            f"nodes_per_island {opts.nodes_per_island}"
        )
    port, bulk = _ports(cfg)
    M = cfg.learners  # noqa: N806
    if opts.rdzv_port + M - 1 > 65535:
        raise ValueError(f"rdzv_port {opts.rdzv_port} + {M} islands runs past port 65535")
    nodes = 1 if opts.single_node else 1 + M * opts.nodes_per_island
    lines = []
    for flag, v in (
        ("--partition", opts.partition),
        ("--time", opts.time_limit),
        ("--account", opts.account),
        ("--gpus-per-node", opts.gpus_per_node),
    ):
        if v is not None:
            lines.append(f"#SBATCH {flag}={v}")
    lines += [f"#SBATCH {a}" for a in opts.sbatch_args]
    script = out / "ddiloco.sbatch"
    header = HEADER.substitute(
        shards=rt.shards,
        islands=M,
        island_size=rt.island_size,
        script=_q(script),
        job_name=opts.job_name,
        nodes=nodes,
        log_pattern=out / "slurm-%j.out",
        sbatch_lines="".join(f"{line}\n" for line in lines),
        out=_q(out),
        python=_q(opts.python),
        nodes_per_island=opts.nodes_per_island,
        procs_per_node=rt.island_size // opts.nodes_per_island,
        single_node=int(opts.single_node),
        port=port,
        bulk_port=bulk,
        http_port="" if rt.http_port is None else rt.http_port,
        rdzv_port=opts.rdzv_port,
        syncer_restarts=opts.syncer_restarts,
        island_restarts=opts.island_restarts,
        torchrun_restarts=opts.torchrun_restarts,
        restart_delay_s=f"{opts.restart_delay_s:g}",
    )
    return header + BODY, nodes


def write_slurm_job(cfg, opts: SlurmOptions | None = None) -> SlurmJob:
    """Write ``ddiloco.sbatch``, the run's ``config.toml`` and (unless the run names one
    in ``runtime.token_file``) a new token file to ``cfg.out`` (made absolute)."""
    from ddiloco.config import dump_config
    from ddiloco.runtime.transport.auth import new_token

    opts = opts or SlurmOptions()
    _check_config(cfg)
    out = Path(cfg.out).resolve()
    token = Path(cfg.runtime.token_file).resolve() if cfg.runtime.token_file else None
    if token is not None and not token.is_file():
        raise ValueError(f"runtime.token_file {token} does not exist")
    cfg = cfg.replace(
        out=str(out),
        engine="processes",
        progress=False,
        host="0.0.0.0",  # the shards bind every interface
        token_file=str(token or out / "token"),
    )
    text, nodes = render_sbatch(cfg, opts, out)
    # shard 0 alone serves the dashboard: the script gives it --http-port
    cfg = cfg.replace(http_port=None)
    out.mkdir(parents=True, exist_ok=True)
    if token is None:
        token = out / "token"
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(new_token() + "\n")
    config = dump_config(cfg, out)
    script = out / "ddiloco.sbatch"
    script.write_text(text)
    script.chmod(0o755)
    return SlurmJob(script=script, config=config, token_file=token, nodes=nodes)


def submit(job: SlurmJob, *, test_only: bool = False, env: dict | None = None) -> str:
    """``sbatch`` the job; its answer (``Submitted batch job N``, or with ``test_only``
    where and when it would start)."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise RuntimeError("sbatch is not on PATH: submit from a Slurm login node")
    cmd = [sbatch, *(["--test-only"] if test_only else []), str(job.script)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return (r.stdout + r.stderr).strip()


# -- the job's last steps: status and summary ------------------------------------------------
STATUS_FILE = "status.json"
"""The syncer's status once every island is done, written by the job before it stops the
shards."""
TAIL_STEPS = 10
"""The per-learner summary's ``tail_loss`` is the median loss of a learner's last TAIL_STEPS
steps."""


def launch(cfg, opts: SlurmOptions, *, submit_job: bool = False, test_only: bool = False) -> int:
    """``ddiloco launch --backend slurm``: write the job of ``cfg``, say what was written,
    and ask sbatch whether it would run it (``test_only``) or submit it (``submit_job``)."""
    job = write_slurm_job(cfg, opts)
    layout = (
        "one node"
        if opts.single_node
        else f"{job.nodes} nodes: the syncer on the first, {cfg.learners} island(s) x "
        f"{opts.nodes_per_island} node(s)"
    )
    print(f"wrote {job.script} ({layout}), {job.config.name} and the token {job.token_file}")
    if test_only:
        print(submit(job, test_only=True))
    if submit_job:
        print(submit(job))
    elif not test_only:
        print(f"submit with: {job.submit_command()}")
    return 0


def write_status(out: str | os.PathLike, syncer: str, timeout_s: float = 30.0) -> dict:
    """Fetch the syncer's status (every shard's, through shard 0) into ``out/status.json``."""
    from ddiloco.config import load_config
    from ddiloco.runtime.launch.status import fetch_status

    out = Path(out)
    cfg = load_config(out)
    st = fetch_status(
        syncer,
        token_file=cfg.runtime.token_file,
        tls_ca=cfg.runtime.tls_ca,
        timeout_s=timeout_s,
    )
    tmp = out / f".{STATUS_FILE}.tmp"
    tmp.write_text(json.dumps(st, indent=2))
    os.replace(tmp, out / STATUS_FILE)
    return st


def _final_model(out: Path, cfg) -> dict | None:
    """The global model of the shards' final checkpoints (fragment p from shard p % S), or
    None where a checkpoint is missing or unreadable."""
    from ddiloco.runtime.export import ExportError, assemble_state_dict
    from ddiloco.runtime.syncer.checkpoint import CHECKPOINT_NAME, load_checkpoint
    from ddiloco.runtime.transport.spec import check_spec

    S = cfg.runtime.shards  # noqa: N806
    dirs = [out / "checkpoint"] if S == 1 else [out / "checkpoint" / f"shard_{k}" for k in range(S)]
    try:
        # lazily: only theta is read, fragment by fragment (each file verified)
        cks = [load_checkpoint(d / CHECKPOINT_NAME, lazy=True) for d in dirs]
        spec = cks[0]["spec"]
        check_spec(spec)
        thetas = [ck["state"]["theta"] for ck in cks]
        return assemble_state_dict(spec, [thetas[p % S][p] for p in range(len(thetas[0]))])
    except (ExportError, OSError, KeyError, TypeError, ValueError) as e:
        print(f"ddiloco: no final model from {dirs}: {e}", file=sys.stderr)
        return None


def summarise(out: str | os.PathLike) -> dict:
    """``summary.json`` of a finished Slurm run in ``out``: the islands' exit codes and
    steps, the syncer's merges and goodput (``status.json``), the initial and final eval
    loss of the global model (the shards' final checkpoints). ``ok``: every island exited
    0, the status was recorded and the final model evaluated."""
    import torch

    from ddiloco.config import load_config
    from ddiloco.metrics.sinks import read_jsonl
    from ddiloco.recipe import eval_setup, evaluate, new_model
    from ddiloco.run_summary import RunSummary
    from ddiloco.runtime.observe.accounting import goodput_so_far

    out = Path(out)
    cfg = load_config(out)
    st_path = out / STATUS_FILE
    st = json.loads(st_path.read_text()) if st_path.is_file() else None
    torch.set_num_threads(1)
    _, _, floor, evals = eval_setup(cfg)
    model = new_model(cfg)
    from ddiloco.runtime.export import write_model_record

    write_model_record(cfg, out)
    init_loss = evaluate(model, evals)
    final_loss = None
    final_params = _final_model(out, cfg)
    if final_params is not None:
        model.load_state_dict(final_params)
        final_loss = evaluate(model, evals)
    per_learner = []
    for m in range(cfg.learners):
        rc_path = out / "logs" / f"learner_{m}.rc"
        rc = int(rc_path.read_text()) if rc_path.is_file() else None
        final_path = out / f"learner_{m}" / "final.json"
        final = json.loads(final_path.read_text()) if final_path.is_file() else {}
        metrics = out / f"learner_{m}" / "metrics.jsonl"
        rows = read_jsonl(metrics) if metrics.is_file() else []
        losses = [r["loss"] for r in rows if r.get("kind") == "step"]
        starts = [r for r in rows if r.get("kind") == "learner_start"]
        per_learner.append(
            {
                "learner": m,
                "exit_code": rc,
                "starts": len(starts),
                "steps": final.get("global_step"),
                "island_size": final.get("island_size", 1),
                "island_max_param_diff": final.get("island_max_param_diff"),
                "first_loss": losses[0] if losses else None,
                "last_loss": losses[-1] if losses else None,
                # one batch's loss is noisy (a spike right after an install is common), so
                # the median of the last TAIL_STEPS is the learner's loss at the end
                "tail_loss": statistics.median(losses[-TAIL_STEPS:]) if losses else None,
            }
        )
    st = st or {}
    summary = {
        "ok": (
            bool(st)
            and final_loss is not None
            and math.isfinite(final_loss)
            and all(pl["exit_code"] == 0 for pl in per_learner)
        ),
        "backend": "slurm",
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "method": "decoupled",
        "engine": "processes",
        "learners": cfg.learners,
        "tokens": None,
        "install": cfg.sync.install,
        "data": cfg.data.source,
        "model": cfg.model.name,
        "island_size": cfg.runtime.island_size,
        "shards": cfg.runtime.shards,
        "steps": cfg.steps,
        "initial_eval_loss": init_loss,
        "final_eval_loss": final_loss,
        "entropy_floor": floor,
        "merges": st.get("merges"),
        "versions": st.get("versions"),
        "goodput": goodput_so_far(st) if st else None,
        "run_s": st.get("run_s"),
        "membership": st.get("membership"),
        "rejections": st.get("rejections", {}),
        "syncer_counters": st.get("counters", {}),
        "per_learner": per_learner,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.to_dict().items()},
    }
    return RunSummary.from_dict(summary).write(out)


def _loss(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ddiloco.runtime.launch.slurm",
        description="The last steps of a ddiloco Slurm job (run by its sbatch script).",
    )
    sub = p.add_subparsers(dest="step", required=True)
    s = sub.add_parser("status", help="record the syncer's status in OUT/status.json")
    s.add_argument("out")
    s.add_argument("--syncer", required=True, help="HOST:PORT of shard 0")
    s = sub.add_parser("summarise", help="write OUT/summary.json")
    s.add_argument("out")
    args = p.parse_args(argv)
    if args.step == "status":
        try:
            write_status(args.out, args.syncer)
        except Exception as e:  # noqa: BLE001 - the summary then says the status is missing
            print(f"ddiloco: could not fetch the syncer's status: {e}", file=sys.stderr)
            return 1
        return 0
    summary = summarise(args.out)
    codes = [pl["exit_code"] for pl in summary["per_learner"]]
    print(
        f"ddiloco: {'done' if summary['ok'] else 'FAILED'}: eval loss "
        f"{summary['initial_eval_loss']:.4f} -> {_loss(summary['final_eval_loss'])}, merges "
        f"{summary['merges']}, learners' exit codes {codes}, summary in "
        f"{Path(args.out) / 'summary.json'}"
    )
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
