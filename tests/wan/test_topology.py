"""The WAN harness's topology: real network namespaces, veth pairs and tbf shapers.

Skips only where namespaces cannot be created (not root, no iproute2)."""

from __future__ import annotations

import os
import subprocess

import pytest

from ddiloco.wan import LinkSpec, Topology, bulk_transfer, cleanup, namespaces_available

REASON = namespaces_available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")


def _netns() -> set[str]:
    out = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=False
    ).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _prefix(tag: str) -> str:
    return f"t{tag}{os.getpid() % 100000}"


@pytest.mark.slow
def test_two_regions_shaped_rate_and_teardown():
    rate = 30.0
    prefix = _prefix("a")
    topo = Topology(prefix, [LinkSpec(rate), LinkSpec(rate)])
    with topo:
        assert {f"{prefix}0", f"{prefix}1", f"{prefix}r"} <= _netns()
        r = bulk_transfer(topo, 0, 1, seconds=3.0, port=5301)
        # TCP goodput and the link's own byte counter, both within 15% of the set rate
        assert abs(r["goodput_mbit"] - rate) / rate < 0.15, r
        assert abs(r["link_mbit"] - rate) / rate < 0.15, r
        c = topo.counters()
        assert c["0"]["up_bytes"] >= r["bytes"] and c["1"]["down_bytes"] >= r["bytes"]
    assert not any(n.startswith(prefix) for n in _netns())


def test_rebuild_removes_leftovers_and_cut_link_blocks():
    prefix = _prefix("b")
    stale = Topology(prefix, [LinkSpec(None)])
    stale.up()  # left behind on purpose, as by a crashed run
    topo = Topology(prefix, [LinkSpec(None), LinkSpec(None)], hub=True)
    with topo:
        assert {f"{prefix}0", f"{prefix}1", f"{prefix}s", f"{prefix}r"} <= _netns()
        probe = [
            *topo.exec_prefix(0),
            "python3",
            "-c",
            "import socket,sys; socket.create_connection((sys.argv[1], 9), timeout=1)",
            topo.ip("s"),
        ]
        # reachable: refused (nothing listens on port 9), not timed out
        p = subprocess.run(probe, capture_output=True, text=True, timeout=30, check=False)
        assert "ConnectionRefused" in p.stderr
        topo.set_link("s", up=False)
        p = subprocess.run(probe, capture_output=True, text=True, timeout=30, check=False)
        assert "ConnectionRefused" not in p.stderr and p.returncode != 0
        topo.set_link("s", up=True)
        p = subprocess.run(probe, capture_output=True, text=True, timeout=30, check=False)
        assert "ConnectionRefused" in p.stderr
    assert cleanup(prefix) == []


def test_bad_specs_are_rejected():
    with pytest.raises(ValueError, match="up_mbit"):
        LinkSpec(0)
    with pytest.raises(ValueError, match="prefix"):
        Topology("bad name", [LinkSpec(1)])
    with pytest.raises(ValueError, match="regions"):
        Topology("ok", [])
