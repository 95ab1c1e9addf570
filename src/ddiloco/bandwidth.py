"""Bandwidth planner: compute utilisation of DP, DiLoCo, Streaming DiLoCo and Decoupled
DiLoCo across D datacenters (torch-free).

Model (every assumption is a field or stated here):

* Each of D datacenters holds one replica (DP) or one learner (the DiLoCo family) and has
  one wide-area link of ``bandwidth_bps`` to the others; links are the only bottleneck
  (intra-datacenter traffic is free).
* A method communicates once per *period* of k inner steps of ``step_time_s`` each, moving
  ``bits`` over each datacenter's link, taking ``t_comm = bits / bandwidth + latency``.
  That transfer may run concurrently with ``overlap`` inner steps (0: blocking).
* Period time = max(k*T + max(0, t_comm - overlap*T), t_comm): a transfer that does not fit
  in its overlap stalls the learner, and a link that cannot carry one period's bits in one
  period is the bottleneck (transfers queue). Compute utilisation CU = k*T / period.

Per method (N parameters, D datacenters, ring factor r = 2(D-1)/D for an all-reduce):

* ``dp``: all-reduce of gradients every step (k = 1, overlap 0), bits = r * b_grad * N.
* ``diloco``: all-reduce of the whole outer gradient every H steps, blocking:
  k = H, overlap 0, bits = r * b_up * N.
* ``streaming``: P fragments, one all-reduced every H/P steps, overlapped for tau steps:
  k = H/P, overlap tau, bits = r * b_up * N/P.
* ``decoupled``: every H/P steps a learner pushes one fragment (b_up bits per parameter) to
  the syncer and pulls the merged one (b_down): k = H/P, overlap tau,
  bits = s * (b_up + b_down) * N/P.

The syncer's placement sets s. ``sharded`` (default): the syncer is split over the D
datacenters, so (D-1)/D of a learner's traffic crosses its link (s = (D-1)/D); the link
also carries its syncer shard's (the other learners' pushes in, their merges out), so the
bits above go each way, as an all-reduce's do. ``hub``: the
syncer runs in a datacenter of its own, every push and pull crosses the learner's link
(s = 1), and DiLoCo goes through it too (each learner pushes b_up * N and pulls b_down * N
every H steps, instead of an all-reduce).

Measured on real links (``docs/results/wan.md``) two more terms matter for small models:
``pulls_per_push`` (a learner may download intermediate merges of a fragment), and the
protocol's own traffic: ``push_overhead_bits`` per push and ``control_bps`` per second
(heartbeats, long polls). They default to the idealised 1, 0 and 0.

Bits per parameter may be fractional: a quantised codec's per-block scales count (int4 with
one fp32 scale per 64 elements: 4.5 bits; int8: 8.5).

Not modelled: compute/communication contention inside a step, stragglers, failures (see
``ddiloco.sim``), protocol overheads beyond ``latency_s``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = [
    "METHODS",
    "SYNCER_PLACEMENTS",
    "BandwidthConfig",
    "period",
    "utilisation",
    "min_bandwidth",
    "time_to_train",
    "step_time_from_flops",
    "with_method",
]

METHODS = ("dp", "diloco", "streaming", "decoupled")
SYNCER_PLACEMENTS = ("sharded", "hub")


@dataclass(kw_only=True, slots=True)
class BandwidthConfig:
    """One method, one model, one step time, D datacenters."""

    method: str = "decoupled"
    """``dp``, ``diloco``, ``streaming`` or ``decoupled``."""
    params: float = 5e9
    """N: model parameters."""
    step_time_s: float = 1.0
    """T: compute time of one inner step (same for every method)."""
    datacenters: int = 8
    """D: datacenters, one replica or learner each, >= 2."""
    grad_bits: float = 16
    """DP: bits per gradient element on the wire (bf16: 16)."""
    up_bits: float = 16
    """DiLoCo family: bits per parameter sent by a learner (bf16 16, int4 4.5 with scales)."""
    down_bits: float = 16
    """Decoupled (and DiLoCo through a hub syncer): bits per parameter of the merged
    parameters sent back."""
    fragments: int = 24
    """P: fragments (streaming, decoupled)."""
    inner_steps: int = 24
    """H: inner steps between two syncs of the same parameters (diloco, streaming)."""
    tau: int = 2
    """Overlap in inner steps (streaming, decoupled)."""
    latency_s: float = 0.0
    """Fixed cost added to each transfer (round trips, protocol)."""
    syncer: str = "sharded"
    """Syncer placement: ``sharded`` over the D datacenters, or ``hub`` (its own datacenter)."""
    pulls_per_push: float = 1.0
    """Decoupled: merged versions of a fragment a learner downloads per push. Above 1 when
    merges of the fragment that do not yet hold the learner's push are published while it
    waits (quorum K < M) and it fetches them too."""
    control_bps: float = 0.0
    """Syncer methods: traffic per second on a learner's link, both ways together, that does
    not scale with the model or the pushes (heartbeats, idle long polls), bits/s."""
    push_overhead_bits: float = 0.0
    """Syncer methods: bits per push beyond the payload, both ways together (request and
    reply headers, the long poll's notice, the fetch request, TCP/IP headers and
    acknowledgements)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if not self.params > 0:
            raise ValueError(f"params must be > 0, got {self.params}")
        if not self.step_time_s > 0:
            raise ValueError(f"step_time_s must be > 0, got {self.step_time_s}")
        if self.datacenters < 2:
            raise ValueError(f"datacenters must be >= 2 (one has no WAN), got {self.datacenters}")
        for name in ("grad_bits", "up_bits", "down_bits", "fragments", "inner_steps"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.syncer not in SYNCER_PLACEMENTS:
            raise ValueError(
                f"syncer must be one of {', '.join(SYNCER_PLACEMENTS)}; got {self.syncer!r}"
            )
        if self.tau < 0 or self.latency_s < 0:
            raise ValueError("tau and latency_s must be >= 0")
        if not self.pulls_per_push >= 1 or self.control_bps < 0 or self.push_overhead_bits < 0:
            raise ValueError("pulls_per_push must be >= 1; control_bps and push_overhead_bits >= 0")
        if self.method == "streaming" and self.inner_steps % self.fragments:
            raise ValueError(
                f"streaming needs H divisible by P (H = {self.inner_steps}, P = {self.fragments})"
            )


def period(cfg: BandwidthConfig) -> tuple[float, float, float]:
    """(k inner steps per communication, bits per link per communication, overlap steps)."""
    n, d = cfg.params, cfg.datacenters
    ring = 2 * (d - 1) / d
    if cfg.method == "dp":
        return 1.0, ring * cfg.grad_bits * n, 0.0
    hub = cfg.syncer == "hub"
    if cfg.method == "diloco":
        k = float(cfg.inner_steps)
        if not hub:
            return k, ring * cfg.up_bits * n, 0.0
        return (
            k,
            (
                (cfg.up_bits + cfg.down_bits) * n
                + cfg.push_overhead_bits
                + cfg.control_bps * k * cfg.step_time_s
            ),
            0.0,
        )
    if cfg.method == "streaming":
        return (
            cfg.inner_steps / cfg.fragments,
            ring * cfg.up_bits * n / cfg.fragments,
            float(cfg.tau),
        )
    share = 1.0 if hub else (d - 1) / d
    k = cfg.inner_steps / cfg.fragments
    payload = share * (cfg.up_bits + cfg.pulls_per_push * cfg.down_bits) * n / cfg.fragments
    return (
        k,
        payload + cfg.push_overhead_bits + cfg.control_bps * k * cfg.step_time_s,
        float(cfg.tau),
    )


def utilisation(cfg: BandwidthConfig, bandwidth_bps: float) -> float:
    """Compute utilisation at a per-datacenter link bandwidth (bits/s)."""
    if not bandwidth_bps > 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth_bps}")
    k, bits, overlap = period(cfg)
    T = cfg.step_time_s
    t_comm = bits / bandwidth_bps + cfg.latency_s
    busy = k * T
    return busy / max(busy + max(0.0, t_comm - overlap * T), t_comm)


def min_bandwidth(cfg: BandwidthConfig, target_cu: float) -> float:
    """Smallest link bandwidth (bits/s) with utilisation >= ``target_cu``; inf if latency
    alone rules it out."""
    if not 0 < target_cu <= 1:
        raise ValueError(f"target utilisation must be in (0, 1], got {target_cu}")
    k, bits, overlap = period(cfg)
    T = cfg.step_time_s
    # both terms of the period must stay within k*T/target
    budget = k * T / target_cu
    stall_ok = budget - k * T + overlap * T  # t_comm <= this
    t_max = min(stall_ok, budget) - cfg.latency_s
    if t_max <= 0:
        return math.inf
    return bits / t_max


def time_to_train(
    cfg: BandwidthConfig, bandwidth_bps: float, tokens: float, tokens_per_step: float
) -> float:
    """Wall-clock seconds to process ``tokens`` (all datacenters together) at this bandwidth."""
    if not (tokens > 0 and tokens_per_step > 0):
        raise ValueError("tokens and tokens_per_step must be > 0")
    steps = tokens / tokens_per_step
    return steps * cfg.step_time_s / utilisation(cfg, bandwidth_bps)


def step_time_from_flops(
    params: float, tokens_per_step: float, chips: int, flops_per_chip: float, mfu: float = 0.4
) -> float:
    """Step time of a dense transformer: 6 * N * tokens / (chips * peak FLOP/s * MFU)."""
    if min(params, tokens_per_step, chips, flops_per_chip) <= 0 or not 0 < mfu <= 1:
        raise ValueError("params, tokens_per_step, chips, flops_per_chip > 0 and 0 < mfu <= 1")
    return 6.0 * params * tokens_per_step / (chips * flops_per_chip * mfu)


def with_method(cfg: BandwidthConfig, method: str) -> BandwidthConfig:
    """The same setting for another method."""
    return replace(cfg, method=method)
