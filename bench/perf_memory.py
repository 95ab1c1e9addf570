"""Target 4: syncer memory is O(model) + O(M x fragment), not O(M x model).

A ``SyncerServer`` process holds a ~100M-parameter model (gpt_100m shapes, P = 24); M
synthetic learners (threads here) join and push fp32 fragments on the Decoupled schedule:
in slot i every learner sends fragment i mod P (in whatever order the threads get there),
then fetches it, for a few cycles through the fragments, quorum K = M // 2 (so a
round stays open until half the learners have arrived). The syncer's peak RSS (VmHWM) is
read from /proc after the pushes, for M = 4 and M = 16 in the same run. The growth from
M = 4 to M = 16, divided by 12 learners, is the memory per extra learner: O(fragment) means
about one fragment (or less), O(model) would mean one model.

The syncer process makes glibc serve all threads from one heap
(``ddiloco.runtime.syncer.allocator.tune_malloc``): without it, multi-megabyte push buffers freed by many
connection threads stay in per-thread heaps and the peak grows like M x model even though
the live data does not.

What it does not cover: learners far out of phase (e.g. a step-driven schedule after
restarts) with a quorum K > 1 keep rounds of many fragments open at once; pending
contributions are held per learner (a newer push supersedes an older one), so that case
grows towards O(M x model) until the rounds close."""

from __future__ import annotations

import threading

from perf_common import (
    SyncerProc,
    SyntheticLearner,
    fragment_payloads,
    meta_model,
    proc_status_bytes,
    row,
    spec_of,
)


def _run(M: int, spec: dict, init: bytes, payloads: list[bytes], rounds: int) -> dict:  # noqa: N803
    P = spec["P"]  # noqa: N806
    with SyncerProc(threads=1, quorum=max(1, M // 2), grace=False) as sy:
        base = proc_status_bytes(sy.pid, "VmRSS")
        learners = [SyntheticLearner(sy.address, m, spec) for m in range(M)]
        for lr in learners:
            lr.join(init)
        after_init = proc_status_bytes(sy.pid, "VmRSS")

        slot = threading.Barrier(M)

        def work(m: int) -> None:
            lr = learners[m]
            for i in range(rounds * P):
                p = i % P
                slot.wait()  # the slot of fragment p: every learner sends it now
                lr.push(p, payloads[p])
                lr.fetch([p])

        ts = [threading.Thread(target=work, args=(m,)) for m in range(M)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for lr in learners:
            lr.close()
        hwm = proc_status_bytes(sy.pid, "VmHWM")
    return {
        "M": M,
        "rss_start": base,
        "rss_after_init": after_init,
        "peak_rss": hwm,
        "pushes": M * rounds * P,
    }


def main(quick: bool = False) -> dict:
    P = 24  # noqa: N806
    model = meta_model("gpt_small" if quick else "gpt_100m")
    spec = spec_of(model, P)
    init, payloads = fragment_payloads(spec)
    model_bytes = len(init)
    frag_bytes = max(len(p) for p in payloads)
    rounds = 2
    r4 = _run(4, spec, init, payloads, rounds)
    r16 = _run(16, spec, init, payloads, rounds)
    per_learner = (r16["peak_rss"] - r4["peak_rss"]) / 12
    over = (r16["peak_rss"] - r16["rss_start"]) / model_bytes
    met = per_learner <= 2 * frag_bytes
    return {
        "rows": [
            row(
                "4. syncer memory, M=16, ~100M params" if not quick else "4. syncer memory (quick)",
                f"peak {r16['peak_rss'] / 2**30:.2f} GiB = start + {over:.1f} x model; "
                f"+{per_learner / 2**20:.1f} MiB per extra learner (fragment {frag_bytes / 2**20:.1f} MiB, "
                f"model {model_bytes / 2**20:.0f} MiB)",
                "per extra learner <= 2 x fragment (O(M x fragment), not O(M x model))",
                met,
                f"M=4 peak {r4['peak_rss'] / 2**30:.2f} GiB; M=16 peak {r16['peak_rss'] / 2**30:.2f} "
                f"GiB; each learner pushed every fragment {rounds}x on the schedule (one fragment "
                f"per slot, all learners), K=M/2",
                per_learner_bytes=per_learner,
                model_multiple=over,
            )
        ],
        "details": {"model_bytes": model_bytes, "fragment_bytes": frag_bytes, "M4": r4, "M16": r16},
    }


if __name__ == "__main__":
    import json

    print(json.dumps(main(quick=True), indent=1))
