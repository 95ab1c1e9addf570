"""The warning a learner gives when merged fragments come back later than tau: its advice
is valid for the interface that took the settings (``tau=`` for the Python API, ``--tau``
for the command line) and never a tau the configuration refuses (tau must be below H)."""

from __future__ import annotations

import inspect
import logging
import re
from types import SimpleNamespace

import pytest

from ddiloco.config.flags import parse_learner
from ddiloco.config.sections import SyncConfig
from ddiloco.runtime.learner.hook import DecoupledLearner, late_install_advice
from ddiloco.runtime.learner.island import InstallWatch

pytestmark = pytest.mark.timeout(60)


def _keywords(text: str) -> dict[str, object]:
    return {k: eval(v) for k, v in re.findall(r"\b(tau|H|P|codec)=('[^']*'|\d+)", text)}


@pytest.mark.parametrize(
    ("delay", "H", "P", "codec"),
    [(73.2, 24, 24, "bf16"), (30.0, 24, 1, "int4"), (4.2, 24, 24, "bf16"), (9.5, 8, 4, "fp32")],
)
def test_advice_is_valid_for_the_python_api(delay, H, P, codec):  # noqa: N803
    text = late_install_advice(delay, H=H, P=P, codec=codec)
    assert "--" not in text.replace("--down-codec", "") and " -H" not in text, text
    kw = _keywords(text)
    assert kw, text
    accepted = inspect.signature(DecoupledLearner.__init__).parameters
    assert set(kw) <= set(accepted), text
    # every suggested setting is one the configuration takes, with the rest as they are
    tau = kw.get("tau")
    if tau is not None and tau >= H:
        assert kw["H"] > tau, text  # a larger tau only ever comes with a larger H
    SyncConfig(
        H=int(kw.get("H", H)), tau=int(kw.get("tau", 2)), fragments=int(kw.get("P", min(P, 2)))
    )
    if delay < H - 1:
        assert text == f"A tau of {int(delay) + 1} covers the link (tau={int(delay) + 1})."
    else:
        assert f"tau must be below H = {H}" in text, text


@pytest.mark.parametrize(("delay", "H", "P"), [(73.2, 24, 24), (30.0, 24, 1), (4.2, 24, 24)])
def test_advice_is_valid_for_the_command_line(delay, H, P):  # noqa: N803
    text = late_install_advice(delay, H=H, P=P, codec="bf16", flags=True)
    assert not re.search(r"\b(tau|H|P|codec)=", text), text
    flags = re.findall(r"(--tau|-H|-P|--codec) (\w+)", text)
    assert flags, text
    given = dict(flags)
    argv = ["--syncer", "127.0.0.1:1"]
    if "--tau" in given:  # a tau comes with the H it needs, if any
        argv += ["--tau", given["--tau"], "-H", given.get("-H", str(H))]
    if "-P" in given:
        argv += ["-P", given["-P"], "-H", given.get("-H", str(H))]
    if "--codec" in given:
        argv += ["--codec", given["--codec"]]
    parse_learner(argv)  # the flags, with the values advised, are a valid command line


def _fake_watch(settings_as: str, delay: float, H: int = 24, tau: int = 2):  # noqa: N803
    sync = SimpleNamespace(
        installs=24,
        install_delay_steps=24 * delay,
        mean_install_delay_steps=delay,
        step=300,
        install="rebase",
    )
    ctx = SimpleNamespace(
        sync=sync,
        stats=SimpleNamespace(install_delay_steps=0.0),
        fragmentation=SimpleNamespace(P=24),
        schedule=SimpleNamespace(tau=tau, H=H),
        learner=0,
        codec=SimpleNamespace(name="bf16"),
        settings_as=settings_as,
    )
    return InstallWatch(ctx)  # type: ignore[arg-type]


@pytest.mark.parametrize("settings_as", ["keywords", "flags"])
def test_the_learner_warns_in_its_interfaces_names(settings_as, caplog):
    watch = _fake_watch(settings_as, delay=73.2)
    with caplog.at_level(logging.WARNING, logger="ddiloco.learner"):
        watch.installed()
    (msg,) = [r.getMessage() for r in caplog.records]
    assert msg.startswith(
        "[learner 0 step 300] merged fragments come back 73.2 steps after their push on "
        "average, later than tau = 2"
    )
    assert "tau must be below H = 24" in msg
    if settings_as == "keywords":
        assert "(H=75 or more, with tau=74)" in msg and "--tau" not in msg
    else:
        assert "(-H 75 or more, with --tau 74)" in msg and "tau=" not in msg
    # once per process
    watch.installed()
    assert len(caplog.records) == 1
