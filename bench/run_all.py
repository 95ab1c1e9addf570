"""Run every performance bench and write the results.

    python bench/run_all.py [--quick] [--only codecs,bytes,...]

Benches (each ``bench/perf_<name>.py`` with ``main(quick) -> {"rows", "details"}``):
learner (target 1), syncer (2), codecs (3), memory (4), bytes (5),
``bench/gpu_throughput.py`` (6, skipped without CUDA) and ``bench/syncer_roofline.py`` (7,
the syncer's fragment merge as a multiple of its roofline: a reference, no threshold). Writes
bench/results/performance.json and docs/results/performance.md (``--quick`` writes
bench/results/performance_quick.json and no markdown unless ``--md`` is given)."""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
ROOT = HERE.parent
BENCHES = {
    "learner": "perf_learner",
    "syncer": "perf_syncer",
    "codecs": "perf_codecs",
    "memory": "perf_memory",
    "bytes": "perf_bytes",
    "gpu": "gpu_throughput",
    "roofline": "syncer_roofline",
}


def _fmt_met(m, threshold: str = "") -> str:
    if m is None and threshold.startswith("-"):
        return "-"  # a reference figure, no threshold
    return {True: "yes", False: "**no**", None: "skipped"}[m]


def write_markdown(res: dict, path: Path) -> None:
    lines = [
        "# Performance",
        "",
        f"Measured by `{res['command']}` in {res['wall_s'] / 60:.1f} min on "
        f"{res['machine']}. Every ratio compares figures measured in the same run "
        "(the machine is shared; absolute numbers move between runs).",
        "",
        "| target | measured | threshold | met? |",
        "|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['target']} | {r['measured']} | {r['threshold']} | "
            f"{_fmt_met(r['met'], r['threshold'])} |"
        )
    lines += ["", "## Notes per target", ""]
    for r in res["rows"]:
        if r["notes"]:
            lines.append(f"- **{r['target']}**: {r['notes']}")
    for name, err in res["errors"].items():
        lines.append(f"- bench `{name}` failed: `{err}`")
    profiles = sorted((ROOT / "docs" / "results" / "profiles").glob("*.txt"))
    if profiles:
        lines += ["", "## Profiles", ""]
        lines += [f"- [`{p.name}`](profiles/{p.name})" for p in profiles]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n" + _other_sections(path))


_GENERATED = ("## Notes per target", "## Profiles")


def _other_sections(path: Path) -> str:
    """The ``## `` sections of ``path`` that ``write_markdown`` does not write (figures of
    other benches, each with its command), to be kept after the ones it writes."""
    if not path.is_file():
        return ""
    parts = path.read_text().split("\n## ")[1:]
    kept = ["## " + p.rstrip("\n") for p in parts if not ("## " + p).startswith(_GENERATED)]
    return "".join("\n" + k + "\n" for k in kept)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny settings (about 2 minutes)")
    ap.add_argument("--only", default="", help=f"comma list of {','.join(BENCHES)}")
    ap.add_argument("--md", action="store_true", help="write the markdown even with --quick")
    ap.add_argument("--out", default=None, help="JSON output path")
    a = ap.parse_args(argv)
    names = [n for n in a.only.split(",") if n] or list(BENCHES)
    unknown = set(names) - set(BENCHES)
    if unknown:
        ap.error(f"unknown bench(es) {sorted(unknown)}; choose from {list(BENCHES)}")
    t0 = time.perf_counter()
    rows, details, errors, walls = [], {}, {}, {}
    for n in names:
        t = time.perf_counter()
        print(f"[perf] {n} ...", file=sys.stderr, flush=True)
        try:
            r = importlib.import_module(BENCHES[n]).main(quick=a.quick)
            rows += r["rows"]
            details[n] = r["details"]
        except Exception as e:  # noqa: BLE001 - report and go on with the other benches
            traceback.print_exc()
            errors[n] = f"{type(e).__name__}: {e}"
        walls[n] = time.perf_counter() - t
        print(f"[perf] {n}: {walls[n]:.0f} s", file=sys.stderr, flush=True)
    rows.sort(key=lambda r: r["target"])
    cmd = (
        "python bench/run_all.py"
        + (" --quick" if a.quick else "")
        + (f" --only {a.only}" if a.only else "")
    )
    import os

    res = {
        "command": cmd,
        "wall_s": time.perf_counter() - t0,
        "bench_wall_s": walls,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), "
        f"Python {platform.python_version()}",
        "rows": rows,
        "details": details,
        "errors": errors,
    }
    out = (
        Path(a.out)
        if a.out
        else ROOT
        / "bench"
        / "results"
        / ("performance_quick.json" if a.quick else "performance.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str))
    if not a.quick or a.md:
        write_markdown(res, ROOT / "docs" / "results" / "performance.md")
    for r in rows:
        print(
            f"{_fmt_met(r['met'], r['threshold']):8s} {r['target']}: {r['measured']}",
            file=sys.stderr,
        )
    return res


if __name__ == "__main__":
    main()
