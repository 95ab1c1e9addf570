"""The launch-backend registry: the names the configuration and ``ddiloco launch`` accept,
one chaos check for every backend, and a job backend added by one registration."""

from __future__ import annotations

import dataclasses
import sys

import pytest
from runtime_helpers import tiny_config

from ddiloco import backends
from ddiloco.backends import BACKENDS, Backend, backend_names, get_backend
from ddiloco.cli import main as ddiloco_main
from ddiloco.config import RuntimeConfig, TrainConfig
from ddiloco.config.chaos import INJECTED_FAULTS, ChaosConfig
from ddiloco.runtime.launch.backends import check_runnable

pytestmark = pytest.mark.timeout(60)

# One value per launcher-injected fault that turns it on.
FAULT_VALUES = {
    "kill_mean_interval_s": 30.0,
    "stop_mean_interval_s": 10.0,
    "syncer_kill_at_s": (15.0,),
    "kill_at_step": ((0, 5),),
    "stop_at_step": ((0, 5, 1.0),),
    "syncer_kill_at_step": 5,
    "add_learner_at_step": (10,),
    "remove_learner_at_step": ((1, 10),),
    "link_cut": ((0, 5, 1.0),),
}


def test_the_registry_names_every_choice():
    assert backend_names("launcher") == ("local", "ray")
    assert backend_names("job") == ("slurm",)
    with pytest.raises(ValueError, match="runtime.launcher must be one of local, ray"):
        RuntimeConfig(launcher="k8s")
    with pytest.raises(
        ValueError, match="unknown launch backend 'slurm'; choose one of local, ray"
    ):
        get_backend("slurm", "launcher")
    with pytest.raises(ValueError, match="already registered"):
        backends.register_backend(BACKENDS["local"])
    assert get_backend("local").load().__name__ == "Launcher"
    assert get_backend("slurm").options_class().__name__ == "SlurmOptions"


def test_every_injected_fault_has_a_value_here():
    assert set(FAULT_VALUES) == set(INJECTED_FAULTS)
    assert set(INJECTED_FAULTS) < {f.name for f in dataclasses.fields(ChaosConfig)}
    for name, value in FAULT_VALUES.items():
        assert ChaosConfig(**{name: value}).injected_faults() == (name,)
    kept = ChaosConfig(slowdown={0: 1.5}, link_bandwidth_Bps=1e6, link_latency_s=0.05)
    assert kept.active and kept.injected_faults() == ()


@pytest.mark.parametrize("fault", INJECTED_FAULTS)
def test_one_chaos_check_for_every_backend(tmp_path, fault):
    """Each launcher-injected fault: run by the local launcher, refused in one line naming it
    by every other backend (with what to do instead); slow-downs and link limits by none."""
    cfg = tiny_config(tmp_path, learners=2, chaos=ChaosConfig(**{fault: FAULT_VALUES[fault]}))
    for name, b in BACKENDS.items():
        if b.injects_faults:
            assert check_runnable(cfg, name).engine == "processes"
            continue
        with pytest.raises(ValueError) as ei:
            check_runnable(cfg, name)
        msg = str(ei.value)
        assert "\n" not in msg
        assert msg.startswith(f"{b.title} does not inject the launcher's chaos ({fault}")
        assert "only the local launcher does" in msg and b.instead in msg
    kept = cfg.replace(chaos=ChaosConfig(slowdown={0: 1.5}, link_bandwidth_Bps=1e6))
    for name in BACKENDS:
        check_runnable(kept, name)


def test_world_failures_are_launcher_kills(tmp_path):
    cfg = tiny_config(tmp_path, mtbi_s=170.0, downtime_s=30.0)
    with pytest.raises(ValueError, match=r"Ray launcher does not .* \(kill_mean_interval_s;"):
        check_runnable(cfg, "ray")


def test_every_backend_refuses_what_processes_cannot_run(tmp_path):
    for name, b in BACKENDS.items():
        with pytest.raises(ValueError, match=f"^{b.title} runs Decoupled DiLoCo's syncer"):
            check_runnable(TrainConfig(method="diloco", out=str(tmp_path)), name)
        with pytest.raises(ValueError, match="the syncer sends merged fragments as one of"):
            check_runnable(tiny_config(tmp_path, down_codec="1bit"), name)


# -- a job backend added by one registration --------------------------------------------------
@dataclasses.dataclass(kw_only=True, slots=True)
class QueueOptions:
    """A stand-in scheduler's options."""

    queue: str = "default"
    """The queue the job waits in."""
    tags: tuple[str, ...] = ()
    """Tags, one per flag."""


CALLS: list[tuple] = []


def queue_job(cfg, opts: QueueOptions, *, submit_job: bool, test_only: bool) -> int:
    CALLS.append((cfg.learners, cfg.steps, opts, submit_job, test_only))
    return 0


def test_a_registered_job_backend_is_a_launch_backend(monkeypatch, capsys, tmp_path):
    fake = Backend(
        name="queue",
        kind="job",
        module=__name__,
        entry="queue_job",
        options="QueueOptions",
        title="the queue backend",
        help="a stand-in scheduler",
        flag_aliases={"queue": ("-q",)},
        repeatable={"tags": "TAG"},
    )
    assert sys.modules[__name__].QueueOptions is QueueOptions
    monkeypatch.setitem(BACKENDS, "queue", fake)
    CALLS.clear()
    argv = ["launch", "--backend", "queue", "-q", "gpu", "--tags", "a", "--tags", "b"]
    rc = ddiloco_main([*argv, "--submit", "-M", "3", "--steps", "7", "--out", str(tmp_path)])
    assert rc == 0
    assert CALLS == [(3, 7, QueueOptions(queue="gpu", tags=("a", "b")), True, False)]
    rc = ddiloco_main(["launch", "--out", str(tmp_path)])
    assert rc == 2
    assert "give --backend {slurm,queue}" in capsys.readouterr().err
