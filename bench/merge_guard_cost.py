"""What the merge guard (``sync.norm_clip``) costs the syncer per merge.

One fragment of N fp32 parameters (default 600,000: the largest fragment of gpt_small at
P = 24, 2.4 MB), one live learner, K = 1: every push is merged at once, alone (the
common case of the default run). Times ``SyncerState.submit`` (checks, outer gradient,
Nesterov step, finiteness) with the guard off and on, in alternating rounds; the median of
each. A guard far above every push's norm (1e9) measures the guard's work without clipping.

Usage: python bench/merge_guard_cost.py [--numel 600000] [--pushes 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ddiloco.algorithm.fragments import fragment_parameters
from ddiloco.algorithm.policy import PolicyConfig
from ddiloco.algorithm.syncer_state import Contribution, SyncerConfig, SyncerState


def per_merge_s(numel: int, pushes: int, clip: float) -> float:
    torch.manual_seed(0)
    init = {"w": torch.randn(numel)}
    frag = fragment_parameters([("w", numel, 4 * numel)], 1, "balanced", set())
    s = SyncerState(
        frag, init, SyncerConfig(policy=PolicyConfig(quorum=1, grace=False), norm_clip=clip)
    )
    s.join(0)
    steps = [torch.randn(numel) * 1e-3 for _ in range(8)]
    t = 0.0
    for i in range(pushes):
        params = [s.frags[0].theta[0] + steps[i % len(steps)]]
        c = Contribution(
            learner=0, fragment=0, params=params, c_steps=24, c_tokens=24 * 256,
            base_version=s.version(0), seq=i,
        )  # fmt: skip
        t0 = time.perf_counter()
        assert s.submit(c, float(i)).merged is not None
        t += time.perf_counter() - t0
    return t / pushes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=600_000)
    ap.add_argument("--pushes", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    res: dict[float, list[float]] = {0.0: [], 1e9: []}
    for _ in range(a.rounds):
        for clip in res:
            res[clip].append(per_merge_s(a.numel, a.pushes, clip))
    off, on = (statistics.median(res[c]) * 1e3 for c in (0.0, 1e9))
    print(f"per merge, {a.numel} parameters: guard off {off:.3f} ms, on {on:.3f} ms "
          f"(+{on - off:.3f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
