"""Every configuration field reaches the component that uses it, in both engines.

For each field, a non-default value is set on the real command line and followed through
the real parse path: in process, to the objects the in-process engine builds from the
parsed config (the syncer state machine's config, the world, model, optimizer, data); with
processes, through the launcher's resolved ``config.toml`` and the syncer's and learner's
own command lines, to the ``SyncerServerConfig`` and the ``DecoupledLearner`` arguments,
model, optimizer and data of learner 1. The table must name every field: a new field
without a row fails here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

from ddiloco.algorithm.learner_state import DEFAULT_INSTALL, INSTALL_RULES
from ddiloco.cli import train_config_from_args
from ddiloco.config import FLAT, TrainConfig
from ddiloco.config.flags import flag_names, parse_learner, parse_syncer
from ddiloco.runtime.launch.run import launcher_class


@dataclass
class InProc:
    """What the in-process engine gets from a parsed ``ddiloco train`` command line."""

    cfg: Any
    syncer: Any
    world: Any
    data: Any
    model: Any
    opt: Any
    frag: Any


@dataclass
class Procs:
    """What the launcher, the syncer process and learner 1 get."""

    launcher: Any
    syncer_cmd: list
    learner_cmd: list
    server: Any
    run: Any
    learner: dict
    slowdown: float
    data: Any
    model: Any
    opt: Any


def inproc(argv: list[str]) -> InProc:
    from ddiloco.engine.common import World
    from ddiloco.engine.decoupled import syncer_config
    from ddiloco.recipe import data_config, fragmentation_for, new_model, new_optimizer

    cfg, _ = train_config_from_args(["--engine", "inproc", *argv])
    model = new_model(cfg)
    return InProc(
        cfg=cfg,
        syncer=syncer_config(cfg),
        world=World(cfg),
        data=data_config(cfg),
        model=model,
        opt=new_optimizer(cfg, model),
        frag=fragmentation_for(cfg, model),
    )


def processes(argv: list[str], out: Path) -> Procs:
    from ddiloco.recipe import data_config, new_model, new_optimizer
    from ddiloco.runtime.cli import syncer_from_args
    from ddiloco.runtime.launch.launcher import Launcher
    from ddiloco.runtime.learner.main import learner_kwargs, learner_slowdown

    cfg, _ = train_config_from_args(["--engine", "processes", "--out", str(out), *argv])
    la = Launcher(cfg)
    la.write_config()
    if cfg.runtime.shards > 1:  # the shards' ports, chosen when the run starts
        la.ports = list(range(20000, 20000 + cfg.runtime.shards))
    s_cmd, l_cmd = la._syncer_cmd(False), la._learner_cmd(1)
    sargs = parse_syncer(s_cmd[s_cmd.index("syncer") + 1 :])
    largs = parse_learner(l_cmd[l_cmd.index("learner") + 1 :])
    run = largs.run
    model = new_model(run)
    return Procs(
        launcher=la,
        syncer_cmd=s_cmd,
        learner_cmd=l_cmd,
        server=syncer_from_args(sargs),
        run=run,
        learner=learner_kwargs(run, largs.learner, largs.syncer),
        slowdown=learner_slowdown(run, largs.learner),
        data=data_config(run),
        model=model,
        opt=new_optimizer(run, model),
    )


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def lrs(cfg) -> list[float]:
    return [round(cfg.lr_at(s), 9) for s in (0, 10, 40, 300, 590)]


Probe = Callable[[Any], Any] | None
# field: (flag values, inproc probe, processes probe); a probe of None: the field has no
# meaning for that engine (said in its docstring)
ROWS: dict[str, tuple[list[str], Probe, Probe]] = {
    "method": (["dp"], lambda e: e.cfg.method, None),
    "engine": (["processes"], lambda e: e.cfg.engine, None),
    "learners": (
        ["3"],
        lambda e: len(e.world.step_rng),
        lambda p: (p.server.step_budget, p.run.learners),
    ),
    "steps": (
        ["50"],
        lambda e: (e.cfg.steps, lrs(e.cfg)),
        lambda p: (p.server.step_budget, lrs(p.run)),
    ),
    "seed": (
        ["7"],
        lambda e: float(next(e.model.parameters()).detach().flatten()[0]),
        lambda p: float(next(p.model.parameters()).detach().flatten()[0]),
    ),
    "out": (["OUT"], lambda e: e.cfg.out, lambda p: str(p.launcher.out)),
    "progress": (["false"], lambda e: e.cfg.progress, lambda p: p.launcher.cfg.progress),
    # model, data
    "model": (["moe_tiny"], lambda e: type(e.model).__name__, lambda p: type(p.model).__name__),
    "data": (["text:TEXT"], lambda e: e.data.kind, lambda p: p.data.kind),
    "batch_size": (["8"], lambda e: e.cfg.data.batch_size, lambda p: p.run.data.batch_size),
    "block_size": (["32"], lambda e: n_params(e.model), lambda p: n_params(p.model)),
    "sharding": (
        ["contiguous", "--data", "text:TEXT"],
        lambda e: e.data.sharding,
        lambda p: p.data.sharding,
    ),
    "shard_block": (
        ["512", "--data", "text:TEXT"],
        lambda e: e.data.shard_block,
        lambda p: p.data.shard_block,
    ),
    "vocab_size": (
        ["48"],
        lambda e: (e.data.markov.vocab_size, n_params(e.model)),
        lambda p: (p.data.markov.vocab_size, n_params(p.model)),
    ),
    # optimization
    "inner_optimizer": (["sgd"], lambda e: type(e.opt).__name__, lambda p: type(p.opt).__name__),
    "inner_lr": (
        ["0.01"],
        lambda e: (e.opt.defaults["lr"], lrs(e.cfg)),
        lambda p: (p.opt.defaults["lr"], lrs(p.run)),
    ),
    "weight_decay": (
        ["0.1"],
        lambda e: e.opt.defaults["weight_decay"],
        lambda p: p.opt.defaults["weight_decay"],
    ),
    "lr_schedule": (["constant"], lambda e: lrs(e.cfg), lambda p: lrs(p.run)),
    "warmup_steps": (["5"], lambda e: lrs(e.cfg), lambda p: lrs(p.run)),
    "min_lr_frac": (["0.5"], lambda e: lrs(e.cfg), lambda p: lrs(p.run)),
    "eval_every": (["50"], lambda e: e.cfg.optim.eval_every, None),
    "eval_batches": (
        ["3"],
        lambda e: e.cfg.optim.eval_batches,
        lambda p: p.launcher.cfg.optim.eval_batches,
    ),
    # sync algorithm
    "fragments": (["4"], lambda e: e.frag.P, lambda p: p.learner["P"]),
    "H": (["12"], lambda e: e.cfg.sync.H, lambda p: p.learner["H"]),
    "tau": (
        ["3"],
        lambda e: (e.cfg.sync.tau, e.syncer.policy.tau),
        lambda p: (p.learner["tau"], p.server.syncer.policy.tau),
    ),
    "quorum": (["2"], lambda e: e.syncer.policy.quorum, lambda p: p.server.syncer.policy.quorum),
    "grace": (["false"], lambda e: e.syncer.policy.grace, lambda p: p.server.syncer.policy.grace),
    "gamma": (["0.3"], lambda e: e.syncer.policy.gamma, lambda p: p.server.syncer.policy.gamma),
    "outer_lr": (["0.5"], lambda e: e.syncer.outer_lr, lambda p: p.server.syncer.outer_lr),
    "outer_momentum": (
        ["0.5"],
        lambda e: e.syncer.outer_momentum,
        lambda p: p.server.syncer.outer_momentum,
    ),
    "merge_rule": (
        ["average"],
        lambda e: e.syncer.merge_rule,
        lambda p: p.server.syncer.merge_rule,
    ),
    "alpha": (["0.5"], lambda e: e.cfg.sync.alpha, lambda p: p.learner["alpha"]),
    "install": (
        [next(r for r in INSTALL_RULES if r != DEFAULT_INSTALL)],
        lambda e: e.cfg.sync.install,
        lambda p: p.learner["install"],
    ),
    "codec": (["int4"], lambda e: e.world.up_codec.name, lambda p: p.learner["codec"]),
    "down_codec": (["int8"], lambda e: e.world.down_codec.name, lambda p: p.server.downlink_codec),
    "down_delta": (["true"], lambda e: e.cfg.sync.down_delta, lambda p: p.server.downlink_delta),
    "fragmentation": (
        ["per-tensor"],
        lambda e: [f.names for f in e.frag.fragments],
        lambda p: p.learner["strategy"],
    ),
    "schedule": (["steps"], lambda e: e.cfg.sync.schedule, lambda p: p.learner.get("schedule")),
    "scale_partial": (
        ["false"],
        lambda e: e.syncer.scale_partial,
        lambda p: p.server.syncer.scale_partial,
    ),
    "max_staleness": (
        ["4"],
        lambda e: e.syncer.max_staleness,
        lambda p: p.server.syncer.max_staleness,
    ),
    "final_merge": (
        ["nesterov"],
        lambda e: e.syncer.final_merge,
        lambda p: p.server.syncer.final_merge,
    ),
    "norm_clip": (
        ["4"],
        lambda e: e.syncer.norm_clip,
        lambda p: p.server.syncer.norm_clip,
    ),
    "staleness_discount": (
        ["0.5"],
        lambda e: e.syncer.staleness_discount,
        lambda p: p.server.syncer.staleness_discount,
    ),
    "anchor": (["base"], lambda e: e.syncer.anchor, lambda p: p.server.syncer.anchor),
    "history": (["3"], lambda e: e.syncer.history, lambda p: p.server.syncer.history),
    # world and chaos
    "step_time_s": (["2.0"], lambda e: e.world.step_s(0), None),
    "speeds": (["1,0.5,1,1"], lambda e: e.world.step_s(1), lambda p: p.slowdown),
    "step_noise": (["0.2"], lambda e: e.world.step_s(0), None),
    "mtbi_s": (
        ["50"],
        lambda e: e.world.next_failure_s(0, 0.0),
        lambda p: p.launcher.chaos.kill_mean_interval_s,
    ),
    "downtime_s": (
        ["7"],
        lambda e: e.cfg.world.downtime_s,
        lambda p: p.launcher.chaos.kill_downtime_s,
    ),
    "latency_s": (["0.2"], lambda e: e.world.transfer_s(1000), None),
    "bandwidth_Bps": (
        ["1e6"],
        lambda e: e.world.transfer_s(1000),
        lambda p: p.learner["link"].bandwidth_bytes_per_s,
    ),
    "merge_time_s": (["0.5"], lambda e: e.cfg.world.merge_time_s, None),
    "chaos": (["wan"], None, lambda p: (p.launcher.chaos.link_latency_s, p.learner["link"])),
    # runtime and transport
    "host": (["0.0.0.0"], None, lambda p: p.server.host),
    "port": (["12345"], None, lambda p: (p.launcher.port, p.server.port)),
    "bulk_port": (["-1"], None, lambda p: p.server.bulk_port),
    "http_port": (["0"], None, lambda p: (p.server.http_port, p.launcher.http_port is None)),
    "handshake_timeout_s": (["2"], None, lambda p: p.server.data_limits.handshake_timeout_s),
    "max_connections": (["9"], None, lambda p: p.server.data_limits.max_connections),
    "max_connections_per_peer": (
        ["3"],
        None,
        lambda p: p.server.data_limits.max_connections_per_peer,
    ),
    "data_workers": (["2"], None, lambda p: p.server.data_limits.workers),
    "token_file": (["TOKEN"], None, lambda p: p.server.token),
    "tls_cert": (["CERT", "--tls-key", "KEY"], None, lambda p: p.server.tls_cert),
    "tls_key": (["KEY", "--tls-cert", "CERT"], None, lambda p: p.server.tls_key),
    "tls_ca": (["CERT"], None, lambda p: p.learner["tls_ca"]),
    "heartbeat_timeout_s": (["9"], None, lambda p: p.server.heartbeat_timeout_s),
    "heartbeat_interval_s": (
        ["1"],
        None,
        lambda p: (p.learner["heartbeat_interval"], p.server.heartbeat_interval_s),
    ),
    "checkpoint_every": (["5"], None, lambda p: p.server.checkpoint_every),
    "max_push_bytes": (["1000"], None, lambda p: p.server.max_push_bytes),
    "step_budget": (["0"], None, lambda p: p.server.step_budget),
    "island_size": (["2"], None, lambda p: p.learner_cmd[:6]),
    "island_sharding": (
        ["fsdp", "--island-size", "2"],
        None,
        lambda p: (p.learner_cmd[:6], p.run.runtime.island(1).sharding),
    ),
    "island_replicas": (
        ["4", "--island-size", "8", "--island-sharding", "hsdp"],
        None,
        lambda p: str(p.run.runtime.island(1)),
    ),
    "islands": (
        ["single,fsdp:2,ddp:2,hsdp:2x2"],
        None,
        lambda p: (p.learner_cmd[:6], str(p.run.runtime.island(1))),
    ),
    "shards": (["2"], None, lambda p: p.server.shards),
    "connect_timeout_s": (["10"], None, lambda p: p.learner["connect_timeout"]),
    "launcher": (["ray"], None, lambda p: launcher_class(p.launcher.cfg).__name__),
    "ray_address": (
        ["10.0.0.1:6379", "--launcher", "ray"],
        None,
        lambda p: p.launcher.cfg.runtime.ray_address,
    ),
    "log_level": (["debug"], None, lambda p: p.run.runtime.log_level),
    "metrics_sinks": (
        ["jsonl,mlflow"],
        lambda e: e.cfg.runtime.metrics_sinks,
        lambda p: (p.server.metrics_sinks, p.run.runtime.metrics_sinks),
    ),
    "device": (["cpu"], None, lambda p: p.run.runtime.device),
    "autocast": (["bf16"], None, lambda p: p.run.runtime.autocast),
}
# fields that need another to be valid when set
COMPANIONS = {
    "mtbi_s": ["--downtime-s", "5"],
    "downtime_s": ["--mtbi-s", "50"],
    "down_delta": ["--down-codec", "int8"],
}


def test_the_table_names_every_field():
    top = [k for k in TrainConfig().to_dict() if k not in FLAT]
    assert set(ROWS) == set(top) | set(FLAT)


def _with_files(v: str, files: dict[str, Path]) -> str:
    """``v`` with a placeholder file name replaced, alone or after a kind (``text:TEXT``)."""
    kind, sep, rest = v.rpartition(":")
    if sep and rest in files:
        return f"{kind}:{files[rest]}"
    return str(files.get(v, v))


def _argv(name: str, tmp: Path, values: list[str], canonical: bool) -> list[str]:
    files = {
        "OUT": tmp / "out-changed",
        "TEXT": tmp / "corpus.txt",
        "TOKEN": tmp / "token",
        "CERT": tmp / "cert.pem",
        "KEY": tmp / "key.pem",
    }
    (tmp / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    (tmp / "token").write_text("secret-from-file\n")
    for f in ("cert.pem", "key.pem"):
        (tmp / f).write_text("pem")
    values = [_with_files(v, files) for v in values]
    if name in FLAT:
        sec, field = FLAT[name]
        flag = f"--{sec}.{field.replace('_', '-')}" if canonical else flag_names(name)[-1]
    else:
        flag = "-M" if name == "learners" and not canonical else f"--{name}"
    if values[0] in ("true", "false") and name not in ("progress",):
        flag_on = (
            flag
            if values[0] == "true"
            else flag.replace("--", "--no-", 1).replace("--no-sync.", "--sync.no-")
        )
        return [flag_on, *values[1:]] + COMPANIONS.get(name, [])
    if name == "progress":
        return ["--no-progress"]
    return [flag, *values] + COMPANIONS.get(name, [])


@pytest.fixture(scope="module")
def defaults(tmp_path_factory):
    """The in-process and processes objects of a command line that sets nothing."""
    mp = pytest.MonkeyPatch()
    mp.setenv("DDILOCO_TOKEN", "secret-from-env")
    yield inproc([]), processes([], tmp_path_factory.mktemp("defaults"))
    mp.undo()


@pytest.mark.parametrize("name", sorted(ROWS))
def test_a_non_default_value_reaches_its_component(name, defaults, tmp_path, monkeypatch):
    monkeypatch.setenv("DDILOCO_TOKEN", "secret-from-env")
    values, in_probe, proc_probe = ROWS[name]
    base_in, base_proc = defaults
    if in_probe is not None:
        changed = inproc(_argv(name, tmp_path, values, canonical=True))
        assert in_probe(changed) != in_probe(base_in), (
            f"{name} does not reach the in-process engine"
        )
    if proc_probe is not None:
        changed = processes(_argv(name, tmp_path, values, canonical=False), tmp_path / "run")
        assert proc_probe(changed) != proc_probe(base_proc), f"{name} does not reach the processes"
    assert in_probe is not None or proc_probe is not None
