"""Target 5: bytes on the wire per inner step, measured on the in-process engine
(``ddiloco.engine.run``) for DP, DiLoCo, Streaming DiLoCo and Decoupled DiLoCo at each
codec; ratio to DP at fp32. Runs are tiny (bytes per step do not depend on length).

A quantised downlink changes what learners install, so the bench also trains Decoupled
(int4 up) with a bf16 and with an int8 downlink on the defaults (300 steps) and reports the
final eval losses side by side."""

from __future__ import annotations

import tempfile

from perf_common import row

from ddiloco.config import TrainConfig
from ddiloco.engine import run

METHODS = ("dp", "diloco", "streaming", "decoupled")
CODECS = ("fp32", "bf16", "int8", "int4")


def main(quick: bool = False) -> dict:
    steps, H, P, M = (24, 24, 8, 4)  # noqa: N806
    codecs = ("fp32", "int4") if quick else CODECS
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in METHODS:
            variants = [(c, "fp32") for c in codecs]
            if method == "decoupled":
                variants += [("int4", "bf16"), ("int4", "int8")]
            for codec, down in variants:
                key = f"{method}/{codec}" + ("" if down == "fp32" else f"+{down}-down")
                cfg = TrainConfig(
                    method=method,
                    codec=codec,
                    down_codec=down,
                    steps=steps,
                    H=H,
                    fragments=P,
                    learners=M,
                    eval_every=10_000,
                    eval_batches=1,
                    progress=False,
                    out=f"{tmp}/{key}".replace("+", "_"),
                )
                s = run(cfg)
                n = s["learners"] * s["steps"]
                out[key] = {
                    "up_per_learner_step": s["bytes_up"] / n,
                    "down_per_learner_step": s["bytes_down"] / n,
                    "total_per_learner_step": (s["bytes_up"] + s["bytes_down"]) / n,
                }
    dp = out["dp/fp32"]["total_per_learner_step"]
    dp_up = out["dp/fp32"]["up_per_learner_step"]
    for v in out.values():
        v["dp_fp32_over_this"] = dp / v["total_per_learner_step"]
        v["dp_fp32_over_this_up"] = dp_up / v["up_per_learner_step"]
    best = out["decoupled/int4"]["dp_fp32_over_this"]
    up = out["decoupled/int4"]["dp_fp32_over_this_up"]
    bf = out["decoupled/int4+bf16-down"]["dp_fp32_over_this"]
    i8 = out["decoupled/int4+int8-down"]["dp_fp32_over_this"]
    notes = "; ".join(
        f"{k}: {v['up_per_learner_step']:.0f} B up + "
        f"{v['down_per_learner_step']:.0f} B down/step, DP/x {v['dp_fp32_over_this']:.1f}"
        for k, v in out.items()
    )
    quality = {}
    if not quick:
        with tempfile.TemporaryDirectory() as tmp:
            for down in ("bf16", "int8"):
                s = run(
                    TrainConfig(
                        method="decoupled",
                        codec="int4",
                        down_codec=down,
                        steps=300,
                        progress=False,
                        out=f"{tmp}/{down}",
                    )
                )
                quality[down] = s["final_eval_loss"]
        rel = quality["int8"] / quality["bf16"] - 1
        notes += (
            f"; quality of the int8 downlink (learners install int8-quantised merged "
            f"fragments), decoupled int4 up, defaults at 300 steps: final eval loss "
            f"{quality['int8']:.4f} vs {quality['bf16']:.4f} with bf16 down ({rel:+.2%})"
        )
    return {
        "rows": [
            row(
                "5. bytes per inner step vs DP (decoupled, int4 up)",
                f"DP-fp32 / decoupled-int4: {i8:.0f}x with an int8 downlink, "
                f"{bf:.0f}x bf16 down, {best:.0f}x fp32 down; {up:.0f}x uplink only",
                ">= 100x (paper: ~1000x with int4)",
                i8 >= 100,
                notes,
                ratio=i8,
                ratio_fp32_down=best,
                ratio_up=up,
                ratio_bf16_down=bf,
            )
        ],
        "details": {
            "config": {
                "steps": steps,
                "H": H,
                "P": P,
                "M": M,
                "model": "gpt_tiny",
                "down_codec": "fp32",
            },
            "per_step": out,
            "downlink_quality_final_eval_loss": quality,
        },
    }


if __name__ == "__main__":
    import json

    print(json.dumps(main(quick=True), indent=1))
