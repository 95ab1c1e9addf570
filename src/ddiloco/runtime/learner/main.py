"""``ddiloco learner``: one learner process (or one torchrun island) training a built-in model
on the synthetic language against a syncer.

The run configuration is the shared ``TrainConfig`` (model, data, P, H, tau, codec...), read
from a JSON file and/or flags. Under ``torchrun`` (``WORLD_SIZE > 1``) the ranks form an
island: DDP inside (Gloo on CPU, NCCL on GPU), rank 0 talks to the syncer and broadcasts.
Each rank trains on ``cuda:LOCAL_RANK`` where CUDA is available (``device``), optionally
under bf16 autocast (``autocast``); the code is the same on the CPU.

A restarted learner resumes its step count and data position from ``progress.json`` in its
run directory and fetches the current global parameters before its first step.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

from ddiloco.config import TrainConfig
from ddiloco.config.sections import IslandLayout
from ddiloco.data import build_stream
from ddiloco.metrics.sinks import open_sinks, parse_sinks
from ddiloco.recipe import autocast as recipe_autocast
from ddiloco.recipe import data_config, new_model, new_optimizer, set_lr
from ddiloco.runtime.learner.client import LINK_CUT, LinkLimits
from ddiloco.runtime.learner.device import learner_device
from ddiloco.runtime.learner.hook import DecoupledLearner
from ddiloco.runtime.learner.layout import shard_model
from ddiloco.runtime.learner.shard_state import dcp_step, load_dcp, save_dcp

__all__ = ["run_learner", "learner_kwargs", "learner_slowdown"]

log = logging.getLogger("ddiloco.learner")


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


STATE_NAME = "learner_state.pt"
"""The learner's resumable state in its run directory: step and inner-optimizer state."""


def save_learner_state(path: Path, step: int, opt: torch.optim.Optimizer) -> None:
    """Write ``{"step", "optimizer"}`` atomically (temp file, rename): a SIGKILL leaves the
    previous state or the new one, never a torn file."""
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({"step": step, "optimizer": opt.state_dict()}, tmp)
    os.replace(tmp, path)


def load_learner_state(path: Path) -> dict | None:
    """The saved state, or None (none saved, or unreadable: the learner starts its optimizer
    afresh, with a warning)."""
    if not path.is_file():
        return None
    try:
        st = torch.load(path, map_location="cpu", weights_only=True)
        return st if isinstance(st, dict) and isinstance(st.get("step"), int) else None
    except Exception as e:  # noqa: BLE001 - a damaged file costs the moments, not the run
        log.warning("could not read %s (%s): the inner optimizer starts afresh", path, e)
        return None


def _resume_point(run_dir: str | None, learner: int, rank: int):
    """(run dir, progress path, state path, start step, saved state) of learner ``learner``."""
    out = Path(run_dir.replace("{learner}", str(learner))) if run_dir else None
    if out is not None and rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    progress_path = out / "progress.json" if out is not None else None
    state_path = out / STATE_NAME if out is not None else None
    start_step = 0
    if progress_path is not None and progress_path.is_file():
        start_step = int(json.loads(progress_path.read_text())["step"])
    saved = load_learner_state(state_path) if state_path is not None else None
    if saved is not None:  # written just before progress.json: it may be 10 steps ahead
        start_step = max(start_step, saved["step"])
    sharded_step = dcp_step(out)  # a sharded island's (``shard_state``), as learner_state.pt
    if sharded_step is not None:
        start_step = max(start_step, sharded_step)
    return out, progress_path, state_path, start_step, saved


def island_for(cfg: TrainConfig, learner: int | None, world: int) -> IslandLayout:
    """How learner ``learner``'s ``world`` ranks hold the model: its layout in the run file
    (``runtime.islands``, ``island_size``, ``island_sharding``), or, started with another
    number of ranks (an island restarted on fewer hosts), the same kind on the ranks it has
    (a sharded island resumes its checkpoint resharded; HSDP becomes FSDP where its
    replicas do not divide the ranks), with a warning."""
    layout = cfg.runtime.island(learner)
    if layout.size == world:
        return layout
    if world == 1:
        now = IslandLayout(1, "single")
    elif layout.sharding == "hsdp" and world % layout.replicas == 0 and world > layout.replicas:
        now = IslandLayout(world, "hsdp", layout.replicas)
    elif layout.sharding in ("fsdp", "hsdp"):
        now = IslandLayout(world, "fsdp")
    else:
        now = IslandLayout(world, "ddp")
    log.warning(
        "[learner %s] laid out as %s (runtime.islands, island_size, island_sharding) but "
        "started with %d rank(s): it runs as %s",
        learner,
        layout,
        world,
        now,
    )
    return now


def learner_kwargs(
    cfg: TrainConfig,
    learner: int | None,
    syncer: str,
    group=None,
    heartbeat_s: float | None = None,
) -> dict:
    """What ``DecoupledLearner`` gets for learner ``learner`` of the run ``cfg``: the sync
    section, the runtime's transport settings, and the run's chaos link limits."""
    from ddiloco.runtime.chaos import chaos_for_run

    chaos = chaos_for_run(cfg)
    link = LinkLimits(
        bandwidth_bytes_per_s=chaos.link_bandwidth_Bps, latency_s=chaos.link_latency_s
    )
    return dict(
        syncer=syncer,
        learner=learner,
        P=cfg.sync.fragments,
        H=cfg.sync.H,
        tau=cfg.sync.tau,
        strategy=cfg.sync.fragmentation,
        codec=cfg.sync.codec,
        alpha=cfg.sync.alpha,
        install=cfg.sync.install,
        schedule=cfg.sync.schedule,
        token_file=cfg.runtime.token_file,
        tls_ca=cfg.runtime.tls_ca,
        link=link,
        connect_timeout=timedelta(seconds=cfg.runtime.connect_timeout_s),
        heartbeat_interval=timedelta(
            seconds=cfg.runtime.heartbeat_interval_s if heartbeat_s is None else heartbeat_s
        ),
        process_group=group,
    )


def learner_slowdown(cfg: TrainConfig, learner: int) -> float:
    """Step-time factor (>= 1) of learner ``learner``: its world speed or the run's chaos."""
    from ddiloco.runtime.chaos import chaos_for_run

    return chaos_for_run(cfg).slowdown.get(learner, 1.0)


def run_learner(
    cfg: TrainConfig,
    *,
    syncer: str,
    learner: int | None = None,
    run_dir: str | None = None,
    metrics_dir: str | None = None,
    heartbeat_s: float | None = None,
    resume_optimizer: bool = True,
    wait_for_merge: bool = False,
) -> dict:
    """Train ``cfg.steps`` inner steps (in total over restarts), or, when the syncer holds a
    global step budget, until the syncer says it is spent; returns the final report.

    With ``run_dir``, every 10 steps the learner saves its step and inner-optimizer state
    (``learner_state.pt``) and its progress; a restarted learner resumes its step count, data
    position and (unless ``resume_optimizer`` is False) its optimizer state (AdamW moments).
    ``wait_for_merge``: after each push, wait until its merge is installed (synchronous
    DiLoCo with ``fragments=1, tau=0`` and a syncer quorum of M).

    Rank 0 writes its rows to ``run_dir/metrics.jsonl`` and to the other sinks of
    ``cfg.runtime.metrics_sinks`` under ``metrics_dir`` (default ``run_dir``) as writer
    ``learner_M``.

    ``learner`` None: the syncer assigns an id when the learner joins; ``run_dir`` may then
    name it as ``{learner}`` (e.g. ``runs/x/learner_{learner}``)."""
    world, rank, group = (
        int(os.environ.get("WORLD_SIZE", "1")),
        int(os.environ.get("RANK", "0")),
        None,
    )
    backend = os.environ.get("DDILOCO_ISLAND_BACKEND") or (
        "nccl" if cfg.runtime.device != "cpu" and torch.cuda.is_available() else "gloo"
    )
    device = learner_device(
        cfg.runtime.device,
        int(os.environ.get("LOCAL_RANK", "0")),
        exclusive=world > 1 and backend == "nccl",
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group(backend, timeout=timedelta(minutes=5))
        group = dist.group.WORLD
    torch.set_num_threads(1)
    layout = island_for(cfg, learner, world)
    sharded = layout.sharding in ("fsdp", "hsdp")
    resume = _resume_point(run_dir, learner, rank) if learner is not None else None
    data = data_config(cfg)
    model = new_model(cfg).to(device)
    train_model = model
    if sharded:  # FSDP2 (HSDP: a 2-D mesh): each rank holds and syncs its own shards
        shard_model(model, layout.replicas, device.type)
    elif group is not None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = new_optimizer(cfg, model)
    resumed_optimizer = False

    def resume_opt(out: Path | None, saved: dict | None, start_step: int) -> bool:
        if not resume_optimizer:
            return False
        if dcp_step(out) == start_step and out is not None:
            # a sharded island's checkpoint, whatever number of ranks wrote it (every rank
            # of this island loads: all read the same directory, so all take this branch)
            return load_dcp(out, model, opt) == start_step
        if saved is not None and saved["step"] == start_step and not sharded:
            opt.load_state_dict(saved["optimizer"])  # moved to the parameters' device
            return True
        return False

    if resume is not None:
        resumed_optimizer = resume_opt(resume[0], resume[4], resume[3])
    autocast = recipe_autocast(cfg, device.type)
    images = data.task == "image"
    tokens = cfg.data.batch_size * (1 if images else cfg.data.block_size) * world
    dl = DecoupledLearner(model, **learner_kwargs(cfg, learner, syncer, group, heartbeat_s))
    dl.settings_as = "flags"  # its warnings name the command line's flags
    leave, joined = threading.Event(), threading.Event()

    def on_sigterm(*_) -> None:
        if not joined.is_set():  # still waiting for the syncer: nothing to leave yet
            raise SystemExit(128 + signal.SIGTERM)
        leave.set()

    if world == 1 and threading.current_thread() is threading.main_thread():
        # SIGTERM: leave the run gracefully (finish the step, flush the pushes, Leave), as a
        # member of an elastic run does when its capacity is taken back; before the learner
        # has joined, stop waiting for the syncer and exit
        signal.signal(signal.SIGTERM, on_sigterm)
        # SIGUSR1 / SIGUSR2: cut / restore the link to the syncer (chaos ``link_cut``)
        signal.signal(signal.SIGUSR1, lambda *_: LINK_CUT.cut())
        signal.signal(signal.SIGUSR2, lambda *_: LINK_CUT.restore())
    t_start = time.time()
    with dl:
        joined.set()
        if resume is None:  # the syncer's choice of id is known now
            learner = dl.learner
            resume = _resume_point(run_dir, learner, rank)
            resumed_optimizer = resume_opt(resume[0], resume[4], resume[3])
        out, progress_path, state_path, start_step, _ = resume
        slowdown = learner_slowdown(cfg, learner)  # its world speed, once its id is known
        # every rank of every learner its own stream: learner m's ranks follow the ranks of
        # the learners before it (islands of different sizes included); an elastic run may
        # have more learners than configured: ids beyond M get streams of their own too
        sizes = [cfg.runtime.island(k).size for k in range(max(cfg.learners, learner + 1))]
        stream = build_stream(
            data,
            learner=sum(sizes[:learner]) + rank,
            n_learners=sum(sizes),
            batch_size=cfg.data.batch_size,
            block_size=cfg.data.block_size,
            seed=cfg.seed,
        )
        stream.load_state_dict({**stream.state_dict(), "position": start_step})
        metrics = (
            open_sinks(
                ("jsonl", *parse_sinks(cfg.runtime.metrics_sinks)),
                metrics_dir or out,
                name=f"learner_{learner}",
                jsonl_path=out / "metrics.jsonl",
            )
            if out is not None and rank == 0
            else None
        )
        if metrics:
            metrics.write(
                {
                    "kind": "learner_start",
                    "learner": learner,
                    "wall": time.time(),
                    "step": start_step,
                    "incarnation": dl.incarnation,
                    "resumed_optimizer": resumed_optimizer,
                    "startup_s": round(time.time() - t_start, 3),
                    "pid": os.getpid(),
                }
            )
        # with a global step budget at the syncer, learners run until it is spent (one that
        # lost time to a failure is made up for by the others); else each runs cfg.steps
        limit = dl.step_budget or cfg.steps
        step = start_step
        compute_ema = None
        while step < limit and not dl.should_stop and not leave.is_set():
            t0 = time.perf_counter()
            x, y = stream.next_batch()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with autocast:
                _, loss = train_model(x, y)
            loss.backward()
            set_lr(opt, cfg.lr_at(step))  # the same inner schedule as the in-process engine
            opt.step()
            if slowdown > 1.0 and step - start_step >= 2:
                # a slower device: its steps take `slowdown` x the typical compute time (an
                # EMA, so that an OS hiccup in one step is not stretched by the same factor,
                # and a step frozen by SIGSTOP counts at most 4x the typical one; the first
                # two steps of a process, its warm-up, are left out)
                dt = time.perf_counter() - t0
                if compute_ema is not None:
                    dt = min(dt, 4.0 * compute_ema)
                compute_ema = dt if compute_ema is None else 0.9 * compute_ema + 0.1 * dt
                time.sleep((slowdown - 1.0) * compute_ema)
            installed = dl.step(tokens)
            if wait_for_merge:
                installed += dl.wait_installs()
            lv = loss.item()
            step += 1
            dl.extra_report.update(loss=lv, global_step=step, total_steps=cfg.steps)
            if metrics:
                metrics.write(
                    {
                        "kind": "step",
                        "learner": learner,
                        "step": step,
                        "wall": time.time(),
                        "loss": round(lv, 5),
                        "installed": {p: dl.sync.frags[p].base_version for p in installed},
                    }
                )
            if step % 10 == 0 or step == limit or dl.should_stop or leave.is_set():
                if sharded and out is not None:  # every rank its shards (a collective)
                    save_dcp(out, step, model, opt)
                if metrics:
                    metrics.flush()
                    if not sharded:
                        save_learner_state(state_path, step, opt)
                    _write_json_atomic(progress_path, {"step": step})
    report = dl.report()
    report["island_layout"] = str(layout)
    if group is not None:
        report["island_size"] = world
    if group is not None and not sharded:  # every rank of the island holds the same model
        import torch.distributed as dist

        with torch.no_grad():
            diff = torch.zeros((), device=device)
            for t in model.parameters():
                ref = t.detach().clone()
                dist.broadcast(ref, src=0, group=group)
                diff = torch.maximum(diff, (ref - t.detach()).abs().max())
            dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
        report["island_max_param_diff"] = float(diff)
    if metrics:
        metrics.write(
            {"kind": "learner_end", "learner": learner, "wall": time.time(), "report": report}
        )
        metrics.close()
        _write_json_atomic(out / "final.json", report)
    if group is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    return report
