"""Target 6: learner tokens/s on a ~125M GPT (gpt_125m preset) on one CUDA device, bf16
autocast, with and without Decoupled DiLoCo synchronisation against a local syncer
(P = H = 24, tau = 2, bf16 codec), in the same run. Without CUDA it writes a
"skipped: no CUDA device" entry and exits 0.

Usage: python bench/gpu_throughput.py [--steps N] [--batch B] [--block T]
Writes bench/results/gpu_throughput.json (and returns the row for run_all)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from perf_common import ROOT, SyncerProc, row  # noqa: E402

OUT = ROOT / "bench" / "results" / "gpu_throughput.json"


def measure(steps: int = 48, batch: int = 8, block: int = 1024) -> dict:
    from ddiloco.models import build_model
    from ddiloco.runtime.learner.hook import DecoupledLearner
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    model = build_model("gpt_125m").to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    V = model.cfg.vocab_size  # noqa: N806
    x = torch.randint(0, V, (batch, block), device=dev)
    y = torch.randint(0, V, (batch, block), device=dev)
    tokens = batch * block

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        opt.step()

    def block_tokens_per_s(dl=None) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            train_step()
            if dl is not None:
                dl.step(tokens)  # snapshot of the fragment due: device -> host copy
        torch.cuda.synchronize()
        return steps * tokens / (time.perf_counter() - t)

    for _ in range(5):
        train_step()
    res = {"off": [], "on": []}
    with SyncerProc(threads=4) as sy, DecoupledLearner(
            model, syncer=sy.address, learner=0, P=24, H=24, tau=2, codec="bf16",
            token="perf-bench-token") as dl:
        for rep in range(2):
            for mode in (("off", "on") if rep == 0 else ("on", "off")):
                while not dl._sendq.empty():
                    time.sleep(0.01)
                res[mode].append(block_tokens_per_s(dl if mode == "on" else None))
        stats = dict(dl.stats)
    on, off = max(res["on"]), max(res["off"])
    return {"device": torch.cuda.get_device_name(0), "steps_per_block": steps, "batch": batch,
            "block": block, "tokens_per_s_on": on, "tokens_per_s_off": off,
            "ratio": on / off, "blocks": res, "stats": stats}


def main(quick: bool = False) -> dict:
    if not torch.cuda.is_available():
        out = {"skipped": "skipped: no CUDA device"}
        r = row("6. GPU: gpt_125m tokens/s with / without sync (bf16 autocast)",
                "skipped: no CUDA device", ">= 97% (as target 1)", None,
                "run `python bench/gpu_throughput.py` on a CUDA machine")
    else:
        out = measure(steps=12 if quick else 48)
        r = row("6. GPU: gpt_125m tokens/s with / without sync (bf16 autocast)",
                f"{out['ratio']:.1%} ({out['tokens_per_s_on']:.0f} vs "
                f"{out['tokens_per_s_off']:.0f} tokens/s) on {out['device']}",
                ">= 97% (as target 1)", out["ratio"] >= 0.97, "", ratio=out["ratio"])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=1))
    return {"rows": [r], "details": out}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    print(json.dumps(main(ap.parse_args().quick), indent=1))
