"""Step time of the GPT presets on this CPU, fp32 against bf16 autocast (issue 27, item 2).

    python bench/real_text/step_time.py --vocab-size 4096 --block-size 128 --batch-size 16

One inner step as a learner takes it (forward, backward, AdamW step) on random tokens at
the real-text vocabulary, each preset at the same batch and context; the median of
``--steps`` steps after ``--warmup``, in CPU seconds of this process (``process_time``), so
that other jobs on the machine slow the run down but not the figure, on ``--threads``
torch threads (1 by default: CPU time then is a step's time on one idle core). It prints,
per preset and precision, CPU seconds per step, tokens per CPU second, and how many inner
steps per learner M learners get in ``--budget-min`` minutes of ``--cores`` idle cores when
they run one after another (the in-process engine's way; the real runtime's M processes
share the same cores), which assumes the work spreads over the cores without loss.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT / "src") not in sys.path:
    sys.path.append(str(ROOT / "src"))


def step_time(
    preset: str,
    *,
    vocab_size: int,
    block_size: int,
    batch_size: int,
    bf16: bool,
    steps: int,
    warmup: int,
) -> tuple[float, int]:
    """(median CPU seconds per inner step, parameters) of ``preset``."""
    import torch

    from ddiloco.models import build_model

    torch.manual_seed(0)
    model = build_model(preset, vocab_size=vocab_size, block_size=block_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    x = torch.randint(0, vocab_size, (batch_size, block_size))
    y = torch.randint(0, vocab_size, (batch_size, block_size))
    times = []
    for i in range(warmup + steps):
        t0 = time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.process_time() - t0)
    return statistics.median(times), sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="gpt_tiny,gpt_small,gpt_100m,gpt_125m")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--learners", type=int, default=4, help="M, for the budget column")
    ap.add_argument("--budget-min", type=float, default=35.0)
    ap.add_argument("--cores", type=int, default=2, help="idle cores, for the budget column")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)

    tokens = args.batch_size * args.block_size
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
        f"{os.getloadavg()[0]:.1f}; batch {args.batch_size} x {args.block_size} tokens, "
        f"vocabulary {args.vocab_size}"
    )
    print(
        "| preset | parameters | fp32 CPU s/step | bf16 CPU s/step | bf16 speed-up "
        f"| bf16 tokens per CPU s | steps per learner in {args.budget_min:g} min of "
        f"{args.cores} cores (M = {args.learners}, bf16) |"
    )
    print("|---|---|---|---|---|---|---|")
    for preset in args.presets.split(","):
        kw = dict(
            vocab_size=args.vocab_size,
            block_size=args.block_size,
            batch_size=args.batch_size,
            steps=args.steps,
            warmup=args.warmup,
        )
        fp32, n = step_time(preset, bf16=False, **kw)  # type: ignore[arg-type]
        bf16, _ = step_time(preset, bf16=True, **kw)  # type: ignore[arg-type]
        per_learner = args.budget_min * 60 * args.cores / bf16 / args.learners
        print(
            f"| {preset} | {n / 1e6:.2f}M | {fp32:.3f} | {bf16:.3f} | {fp32 / bf16:.2f}x "
            f"| {tokens / bf16:,.0f} | {per_learner:,.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
