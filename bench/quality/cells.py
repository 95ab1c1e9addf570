"""The quality study's explicit base configuration and its cells (sections a-h).

Every field of the base config is spelled out here, so the study does not change when
``TrainConfig`` defaults change. A cell is a named set of overrides on the base, run for a
list of seeds; identical configurations in different sections run once and are shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The study's base: M = 4 learners on the built-in synthetic language, gpt_tiny, equal
# tokens for every method. The DiLoCo-family settings are not the paper's defaults (H = 24,
# tau = 2, outer Nesterov 0.7 / 0.9): on this tiny, short CPU task those are far from DP, so
# the base syncs each fragment every H = 8 steps with tau = 1 and plain outer steps
# (lr 1, no momentum), the best of a small pilot; (a) also runs the paper's defaults.
# V = 16 and 32-token sequences keep the whole study within the CPU budget.
BASE: dict = dict(
    method="decoupled",
    engine="inproc",
    learners=4,
    steps=400,
    model="gpt_tiny",
    data="synthetic",
    batch_size=16,
    block_size=32,
    vocab_size=16,
    inner_optimizer="adamw",
    inner_lr=1e-2,
    weight_decay=0.0,
    lr_schedule="cosine",
    warmup_steps=30,
    min_lr_frac=0.1,
    eval_every=50,
    eval_batches=8,
    fragments=4,
    H=8,
    tau=1,
    quorum=1,
    grace=True,
    gamma=0.5,
    outer_lr=1.0,
    outer_momentum=0.0,
    merge_rule="rda",
    alpha=0.0,
    codec="bf16",
    down_codec="fp32",
    fragmentation="balanced",
    max_staleness=16,
    anchor="current",
    step_time_s=1.0,
    speeds=(),
    step_noise=0.0,
    mtbi_s=0.0,
    downtime_s=0.0,
    latency_s=0.05,
    bandwidth_Bps=0.0,
    merge_time_s=0.01,
)

# Learner failures: mean up-time 170 s, down 30 s per failure (step = 1 s): each learner
# is down ~15% of the time (the engine's "failures" preset, spelled out).
FAILURES = dict(mtbi_s=170.0, downtime_s=30.0)
# Heterogeneous speeds: half the learners 18% slower, 10% step-time noise (the "hetero"
# preset for M = 4, spelled out).
HETERO = dict(speeds=(1.0, 1.0, 1 / 1.18, 1 / 1.18), step_noise=0.1)

# The paper's (and TrainConfig's) DiLoCo-family defaults, for comparison in (a).
PAPER_DEFAULTS = dict(fragments=8, H=24, tau=2, outer_lr=0.7, outer_momentum=0.9)

# (f): P = 3 for the layer-based strategies (gpt_tiny has 6 layers: with P = 6 per-layer
# and strided coincide); per-tensor gives one fragment per tensor (29), so H = 30 for all.
FRAG_H = 30
FRAG_P = 3

# (a): the per-learner batch multiplier of the batch-scaling pair
BATCH_SCALE = 4

SECTIONS = {
    "a": "Methods at equal tokens, no failures",
    "b": "Learner failures (each learner down ~15% of the time)",
    "c": "Heterogeneous speeds: quorum K = M vs K = 1 vs K = 1 + grace",
    "d": "RDA vs plain averaging at M = 8 and M = 16",
    "e": "Codecs of what learners send",
    "f": "Fragmentation strategies and peak bytes per step",
    "g": "MoE vs dense",
    "h": "Vision (vit_digits on 8x8 digits)",
}


@dataclass(slots=True)
class Cell:
    section: str
    name: str
    overrides: dict
    seeds: list[int]
    extra: dict = field(default_factory=dict)


def cells(quick: bool = False) -> list[Cell]:
    """The study's cells; ``quick`` shrinks every run to a smoke test."""
    two = [0] if quick else [0, 1]
    one = [0]
    M = BASE["learners"]  # noqa: N806
    steps = BASE["steps"]
    out: list[Cell] = []
    add = lambda s, n, o, seeds, **x: out.append(Cell(s, n, o, seeds, x))  # noqa: E731

    # a) every method at equal tokens (local: one learner alone, a quarter of the tokens)
    for m in ("local", "dp", "diloco", "streaming", "decoupled"):
        add("a", m, dict(method=m), two if m in ("dp", "decoupled") else one)
    add("a", "decoupled, paper defaults", dict(PAPER_DEFAULTS, method="decoupled"), one)
    # ... and the same pair with 4x the batch per learner step (the gap's trend with batch)
    for m in ("dp", "decoupled"):
        add(
            "a",
            f"{m}, batch x{BATCH_SCALE}",
            dict(method=m, batch_size=BASE["batch_size"] * BATCH_SCALE),
            two,
            batch_scale=BATCH_SCALE,
        )
    # b) failures (a synchronous method's loss does not change with failures, only its time)
    for m in ("dp", "diloco", "streaming"):
        add("b", f"{m}+failures", dict(method=m, **FAILURES), one)
    add("b", "decoupled+failures", dict(method="decoupled", **FAILURES), two)
    add(
        "b",
        f"decoupled+failures, batch x{BATCH_SCALE}",
        dict(method="decoupled", batch_size=BASE["batch_size"] * BATCH_SCALE, **FAILURES),
        two,
        batch_scale=BATCH_SCALE,
    )
    # c) heterogeneous speeds
    add("c", "K=M", dict(HETERO, quorum=M, grace=False), one)
    add("c", "K=1", dict(HETERO, quorum=1, grace=False), one)
    add("c", "K=1+grace", dict(HETERO, quorum=1, grace=True), one)
    # d) merge rule at M = 8 and 16, equal total tokens (fewer steps per learner)
    for m in (8, 16):
        for rule in ("rda", "average"):
            add(
                "d",
                f"M={m} {rule}",
                dict(learners=m, steps=steps * M // m, merge_rule=rule),
                two if m == 8 else one,
                M=m,
                rule=rule,
            )
    # e) codecs (bf16 is the base decoupled run of (a))
    for c in ("bf16", "int4", "int2", "1bit"):
        add("e", c, dict(codec=c), one if c == "1bit" else two, codec=c)
    # ... int2 with one scale per 4096 elements instead of 64 (coarse scales)
    add("e", "int2/4096", dict(codec="int2/4096"), two, codec="int2/4096")
    # ... and at the paper's DiLoCo-family defaults (bf16 there is (a)'s paper-defaults run)
    for c in ("bf16", "int2", "1bit", "int2/4096"):
        add(
            "e",
            f"{c}, paper defaults",
            dict(PAPER_DEFAULTS, method="decoupled", codec=c),
            one,
            codec=c,
            paper_defaults=True,
        )
    # f) fragmentation
    for s in ("balanced", "per-layer", "strided", "per-tensor"):
        P = 29 if s == "per-tensor" else FRAG_P  # noqa: N806
        add("f", s, dict(fragmentation=s, fragments=P, H=FRAG_H), one, strategy=s)
    # g) MoE vs dense (the dense pair is (a)'s)
    for model in ("gpt_tiny", "moe_tiny"):
        for m in ("dp", "decoupled"):
            add(
                "g",
                f"{model} {m}",
                dict(model=model, method=m),
                one if model != "gpt_tiny" else two,
                model=model,
            )
    # h) vision
    vis = dict(model="vit_digits", data="digits", eval_batches=22)
    add("h", "dp", dict(vis, method="dp"), two)
    add("h", "decoupled", dict(vis, method="decoupled"), two)
    add("h", "decoupled+failures", dict(vis, method="decoupled", **FAILURES), one)
    return out


QUICK = dict(
    steps=12,
    batch_size=4,
    block_size=16,
    eval_every=6,
    eval_batches=2,
    warmup_steps=2,
    H=8,
    fragments=4,
)


def base_config(quick: bool = False) -> dict:
    b = dict(BASE)
    if quick:
        b.update(QUICK)
    return b


def resolve(cell: Cell, quick: bool = False) -> dict:
    """The full TrainConfig fields of a cell (without seed/out/progress)."""
    cfg = base_config(quick)
    ov = dict(cell.overrides)
    if quick:
        if cell.section == "d":  # keep equal tokens but at least one sync period
            ov["steps"] = max(cfg["H"], QUICK["steps"] * BASE["learners"] // ov["learners"])
        if cell.section == "h":
            ov["eval_batches"] = 4
    cfg.update(ov)
    if quick and cell.section == "d":
        cfg["steps"] = ov["steps"]
    cfg["speeds"] = tuple(cfg["speeds"])
    return cfg
