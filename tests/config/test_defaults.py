"""Every library default equals the run configuration's.

Each default is declared once. The algorithm's and the transport's are declared in their
own dataclasses and read by the run configuration (``ddiloco.config``): the policy's
``PolicyConfig``, the outer optimizer's ``OuterNesterov``, the syncer state machine's
``SyncerConfig``, ``LearnerSync``, the data port's ``BulkLimits``. The rest are declared by
the configuration and read by the library's own entry points: ``DecoupledLearner``'s
keyword arguments, ``SyncerServerConfig``, the simulator's policy fields and the flags of
``ddiloco syncer`` and ``ddiloco learner``. The tests compare them all, whichever way. Each
comparison fails naming the library field and the configuration field that drifted apart;
the negative controls drift one value on purpose and check that it is named.
"""

from __future__ import annotations

import dataclasses
import inspect
from datetime import timedelta
from typing import Any

import pytest

from ddiloco.algorithm.learner_state import LearnerSync
from ddiloco.algorithm.merge import OuterNesterov
from ddiloco.algorithm.policy import PolicyConfig
from ddiloco.algorithm.syncer_state import SyncerConfig
from ddiloco.config import RuntimeConfig, SyncConfig, TrainConfig
from ddiloco.config.flags import parse_learner, parse_syncer
from ddiloco.runtime.learner.hook import DecoupledLearner
from ddiloco.runtime.learner.main import learner_kwargs
from ddiloco.runtime.syncer.run_config import syncer_server_config
from ddiloco.runtime.syncer.server import SyncerServerConfig
from ddiloco.runtime.transport.bulk import BulkLimits
from ddiloco.sim.systems import SimConfig

AUTO = {"P": "None: min(H, the model's tensors, 24), so that any model can be hooked"}
"""``DecoupledLearner`` arguments whose default is a rule rather than the configuration's
value, and why."""


def drift(library: str, values: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """One line per name whose library default differs from the configuration's."""
    return [
        f"{library}.{name} = {values[name]!r}, the configuration gives {config[name]!r}"
        for name in config
        if values[name] != config[name]
    ]


def signature_defaults(fn) -> dict[str, Any]:
    return {
        n: p.default
        for n, p in inspect.signature(fn).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def fields_of(obj) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def hook_drift(cfg: TrainConfig) -> list[str]:
    """``DecoupledLearner``'s defaults against what ``ddiloco learner`` passes it for ``cfg``
    (every argument the learner process sets from the configuration)."""
    given = learner_kwargs(cfg, None, "127.0.0.1:1")
    given.pop("syncer")
    defaults = signature_defaults(DecoupledLearner.__init__)
    defaults["link"] = defaults["link"] or _no_link()
    return drift("DecoupledLearner", defaults, {k: v for k, v in given.items() if k not in AUTO})


def _no_link():
    from ddiloco.runtime.learner.client import LinkLimits

    return LinkLimits()


def server_drift(cfg: TrainConfig) -> list[str]:
    """``SyncerServerConfig``'s defaults against what a bare ``ddiloco syncer`` builds from
    ``cfg`` (every field, those without a configuration field included). The state
    machine's config is compared with the [sync] table's own (``syncer_config()``): a bare
    syncer, which does not know the learners' codec, may resolve an unset history
    differently."""
    built = fields_of(syncer_server_config(cfg, token="t", from_file=False))
    built["syncer"] = cfg.sync.syncer_config()
    return drift("SyncerServerConfig", fields_of(SyncerServerConfig(token="t")), built)


def test_decoupled_learner_defaults_are_the_configuration():
    assert hook_drift(TrainConfig()) == []
    d = signature_defaults(DecoupledLearner.__init__)
    rt = RuntimeConfig()
    assert (
        d["heartbeat_interval"]
        == timedelta(seconds=rt.heartbeat_interval_s)
        == timedelta(milliseconds=250)
    )
    assert d["connect_timeout"] == timedelta(seconds=rt.connect_timeout_s)
    assert set(AUTO) <= set(d)  # the exceptions are arguments that exist


def test_syncer_server_defaults_are_the_configuration():
    assert server_drift(TrainConfig()) == []
    assert SyncerServerConfig(token="t").heartbeat_timeout_s == 3.0
    limits, rt = BulkLimits(), RuntimeConfig()
    assert (
        drift(
            "BulkLimits",
            fields_of(limits),
            {
                "handshake_timeout_s": rt.handshake_timeout_s,
                "max_connections": rt.max_connections,
                "max_connections_per_peer": rt.max_connections_per_peer,
                "workers": rt.data_workers,
            },
        )
        == []
    )


def test_algorithm_defaults_are_the_configuration():
    sync = SyncConfig()
    assert drift("SyncerConfig", fields_of(SyncerConfig()), fields_of(sync.syncer_config())) == []
    policy = {n: getattr(sync, n) for n in ("quorum", "grace", "gamma", "tau")}
    assert drift("PolicyConfig", fields_of(PolicyConfig()), policy) == []
    assert policy["gamma"] == 0.8
    outer = {"lr": sync.outer_lr, "momentum": sync.outer_momentum}
    assert drift("OuterNesterov", fields_of(OuterNesterov()), outer) == []
    assert outer == {"lr": 0.7, "momentum": 0.9}
    assert drift("SimConfig", fields_of(SimConfig()), policy) == []
    assert (
        drift(
            "LearnerSync",
            signature_defaults(LearnerSync.__init__),
            {"alpha": sync.alpha, "install": sync.install},
        )
        == []
    )


def test_command_line_defaults_are_the_configuration():
    syncer = parse_syncer([])
    assert drift("ddiloco syncer --sync", fields_of(syncer.sync), fields_of(SyncConfig())) == []
    assert (
        drift("ddiloco syncer --runtime", fields_of(syncer.runtime), fields_of(RuntimeConfig()))
        == []
    )
    learner = parse_learner(["--syncer", "127.0.0.1:1"])
    for sec in ("sync", "runtime", "data", "model", "optim", "world"):
        got, want = getattr(learner.run, sec), getattr(TrainConfig(), sec)
        assert drift(f"ddiloco learner --{sec}", fields_of(got), fields_of(want)) == []


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"heartbeat_interval_s": 0.5}, "DecoupledLearner.heartbeat_interval"),
        ({"codec": "int8"}, "DecoupledLearner.codec"),
        ({"tau": 3}, "DecoupledLearner.tau"),
    ],
)
def test_negative_control_a_drifted_hook_default_is_named(change, named):
    lines = hook_drift(TrainConfig().replace(**change))
    assert len(lines) == 1 and lines[0].startswith(named + " = "), lines


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"heartbeat_timeout_s": 5.0}, "SyncerServerConfig.heartbeat_timeout_s"),
        ({"down_codec": "int8"}, "SyncerServerConfig.downlink_codec"),
        ({"gamma": 0.5}, "SyncerServerConfig.syncer"),
        ({"handshake_timeout_s": 2.0}, "SyncerServerConfig.data_limits"),
    ],
)
def test_negative_control_a_drifted_syncer_default_is_named(change, named):
    lines = server_drift(TrainConfig().replace(**change))
    assert len(lines) == 1 and lines[0].startswith(named + " = "), lines
