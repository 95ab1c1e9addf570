"""WAN regions on one Linux machine: network namespaces joined through a router namespace by
shaped veth pairs.

Layout (prefix ``P``, regions ``0..R-1``, optional hub region ``s``)::

    P0 [wan 10.N.0.2] ==veth== [r0 10.N.0.1]
    P1 [wan 10.N.1.2] ==veth== [r1 10.N.1.1]   Pr (router, ip_forward=1)
    ...
    Ps [wan 10.N.250.2] ==veth== [rs 10.N.250.1]   (only with ``hub=True``)

Each region's link is shaped in both directions with a token-bucket filter (``tc tbf``): the
region's egress (``wan`` inside the region: its uplink) and the router's egress towards the
region (``rI`` inside the router: its downlink). The kernel's counters of the router-side
veth give the bytes each link carried. Propagation delay is not added (``netem`` is not
available everywhere); see ``docs/results/wan.md`` for what that means for the comparison.

Every name that lives in the root namespace (the namespaces themselves) starts with the
prefix, so topologies with different prefixes coexist, and ``cleanup(prefix)`` removes the
leftovers of an earlier run with that prefix. ``Topology`` is a context manager; it also
tears down at interpreter exit and on SIGINT / SIGTERM.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass, field

__all__ = ["LinkSpec", "Topology", "TopologyError", "cleanup", "namespaces_available"]

HUB = "s"
"""Region name of the optional hub region (the syncer's own datacenter)."""


class TopologyError(RuntimeError):
    """A namespace, link or qdisc could not be created."""


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(args), capture_output=True, text=True, check=False)
    if check and p.returncode != 0:
        raise TopologyError(f"{' '.join(args)!r} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def namespaces_available() -> str | None:
    """None when this process can build a topology, else the reason it cannot."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return "not Linux"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (install iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    probe = f"ddprobe{os.getpid()}"
    p = _run("ip", "netns", "add", probe, check=False)
    if p.returncode != 0:
        return f"cannot create a network namespace: {p.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def cleanup(prefix: str) -> list[str]:
    """Delete every network namespace whose name starts with ``prefix`` (their veth pairs go
    with them). Returns the names deleted."""
    if not prefix:
        raise ValueError("cleanup needs a non-empty prefix")
    p = _run("ip", "-j", "netns", "list", check=False)
    names = [n["name"] for n in json.loads(p.stdout or "[]")] if p.returncode == 0 else []
    gone = [n for n in names if n.startswith(prefix)]
    for n in gone:
        _run("ip", "netns", "del", n, check=False)
    return gone


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One region's link to the router."""

    up_mbit: float | None
    """Uplink rate (region -> router), Mbit/s; None: unshaped."""
    down_mbit: float | None = None
    """Downlink rate (router -> region), Mbit/s; None: the uplink's."""
    queue_ms: float = 200.0
    """Longest a packet may wait in the shaper's queue (tbf ``latency``)."""

    def __post_init__(self) -> None:
        for name in ("up_mbit", "down_mbit"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"LinkSpec.{name} must be > 0 Mbit/s or None, got {v}")
        if not self.queue_ms > 0:
            raise ValueError(f"LinkSpec.queue_ms must be > 0, got {self.queue_ms}")


@dataclass(eq=False)
class Topology:
    """R regions (and optionally a hub region) around one router namespace.

    ``links[i]`` shapes region i; ``hub_link`` shapes the hub (None: unshaped)."""

    prefix: str
    links: list[LinkSpec]
    hub: bool = False
    hub_link: LinkSpec | None = None
    net: int = 77
    """Second octet of the 10.N.0.0/16 block the regions' /24s are cut from."""
    _up: bool = field(default=False, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        if not self.prefix or not self.prefix.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"prefix must be a short alphanumeric name, got {self.prefix!r}")
        if len(self.prefix) > 10:
            raise ValueError(f"prefix {self.prefix!r} too long (at most 10 characters)")
        if not 1 <= len(self.links) <= 200:
            raise ValueError(f"need 1..200 regions, got {len(self.links)}")
        if not 0 <= self.net <= 255:
            raise ValueError(f"net must be an octet, got {self.net}")

    # -- names --------------------------------------------------------------------------
    @property
    def regions(self) -> list[str]:
        """Region names: "0".."R-1", then "s" with a hub."""
        return [str(i) for i in range(len(self.links))] + ([HUB] if self.hub else [])

    def ns(self, region: str | int) -> str:
        """The network namespace of a region (or "r": the router)."""
        return f"{self.prefix}{region}"

    @property
    def router(self) -> str:
        return self.ns("r")

    def _octet(self, region: str | int) -> int:
        return 250 if str(region) == HUB else int(region)

    def ip(self, region: str | int) -> str:
        """The region's address."""
        return f"10.{self.net}.{self._octet(region)}.2"

    def router_dev(self, region: str | int) -> str:
        """The router-side veth of a region's link."""
        return f"r{region}"

    def exec_prefix(self, region: str | int) -> list[str]:
        """Command prefix that runs a program inside the region's namespace."""
        return ["ip", "netns", "exec", self.ns(region)]

    def _spec(self, region: str) -> LinkSpec | None:
        return self.hub_link if region == HUB else self.links[int(region)]

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> Topology:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> Topology:
        """Remove leftovers with this prefix, then build the topology."""
        cleanup(self.prefix)
        _install_teardown(self)
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        self._up = True
        return self

    def _build(self) -> None:
        r = self.router
        _run("ip", "netns", "add", r)
        _run("ip", "-n", r, "link", "set", "lo", "up")
        _run("ip", "netns", "exec", r, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for region in self.regions:
            ns, dev = self.ns(region), self.router_dev(region)
            o = self._octet(region)
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run(
                "ip",
                "link",
                "add",
                "wan",
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                dev,
                "netns",
                r,
            )
            _run("ip", "-n", ns, "addr", "add", f"10.{self.net}.{o}.2/24", "dev", "wan")
            _run("ip", "-n", r, "addr", "add", f"10.{self.net}.{o}.1/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", "wan", "up")
            _run("ip", "-n", r, "link", "set", dev, "up")
            _run("ip", "-n", ns, "route", "add", "default", "via", f"10.{self.net}.{o}.1")
            self.shape(region, self._spec(region))

    def shape(self, region: str | int, spec: LinkSpec | None) -> None:
        """(Re)shape a region's link; None removes the shaping."""
        region = str(region)
        for ns, dev, mbit in (
            (self.ns(region), "wan", spec and spec.up_mbit),
            (self.router, self.router_dev(region), spec and (spec.down_mbit or spec.up_mbit)),
        ):
            _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            if not mbit:
                continue
            rate_bps = mbit * 1e6
            # a bucket of ~4 ms at the rate, never under 4 full frames
            burst = max(6000, int(rate_bps / 8 * 0.004))
            _run(
                "tc",
                "-n",
                ns,
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{int(rate_bps)}bit",
                "burst",
                str(burst),
                "latency",
                f"{spec.queue_ms}ms",
            )

    def set_link(self, region: str | int, up: bool) -> None:
        """Cut (``up=False``) or restore a region's link at the router."""
        _run(
            "ip", "-n", self.router, "link", "set", self.router_dev(region), "up" if up else "down"
        )

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes and packets each region's link carried so far, seen from the router:
        ``up_bytes`` region -> router, ``down_bytes`` router -> region."""
        p = _run("ip", "-j", "-s", "-n", self.router, "link", "show")
        out = {}
        by_dev = {d["ifname"]: d for d in json.loads(p.stdout)}
        for region in self.regions:
            st = by_dev[self.router_dev(region)]["stats64"]
            out[region] = {
                "up_bytes": st["rx"]["bytes"],
                "down_bytes": st["tx"]["bytes"],
                "up_packets": st["rx"]["packets"],
                "down_packets": st["tx"]["packets"],
            }
        return out

    def down(self) -> None:
        """Delete every namespace of this topology (idempotent)."""
        with self._lock:
            cleanup(self.prefix)
            self._up = False
            _live.discard(self)


# -- teardown at exit and on signals ----------------------------------------------------------
_live: set[Topology] = set()
_installed = False


def _teardown_all(*_: object) -> None:
    for t in list(_live):
        t.down()


def _install_teardown(t: Topology) -> None:
    global _installed
    _live.add(t)
    if _installed:
        return
    _installed = True
    atexit.register(_teardown_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        prev = signal.getsignal(sig)

        def handler(signum, frame, prev=prev):
            _teardown_all()
            if callable(prev):
                prev(signum, frame)
            else:
                raise SystemExit(128 + signum)

        signal.signal(sig, handler)
