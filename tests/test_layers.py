"""The package's layers: every import between its parts runs the way ``LAYERS`` allows.

A part is a top-level module or package of ``src/ddiloco`` (``config``, ``kernel``,
``recipe``...), and each package of ``runtime/`` is a part of its own
(``runtime.transport``, ``runtime.syncer``...). ``LAYERS`` is the one declaration of the
arrows between parts: what each part may import. An import of another part that it does
not list fails the test, naming the file and line; so does a part that has no row. The
import graph is ``test_import_graph``'s (every kind of import, read with ``ast``).

The rules the table keeps:

- the algorithm (``algorithm``, with its C kernels) imports no engine, runtime or
  configuration: both engines and the runtime build on it;
- the event kernel (``kernel``) imports nothing: the simulator and the in-process engine
  both run on it;
- the configuration imports no syncer, learner or launcher: it reads the registries and
  the declared defaults of what it configures (the algorithm's, the data port's limits in
  ``runtime.transport``, the backend names in ``backends``);
- the transport imports no syncer, learner or launcher, and no configuration;
- observability (``runtime.observe``) takes callables: it imports no syncer and no
  launcher;
- the launchers start syncers and learners, never the other way.

Run as a script (``python tests/test_layers.py``), it draws the picture of the parts and
their arrows in ``docs/architecture.md`` from the import graph: ``docs/layers.txt`` (the
arrows) and ``docs/layers.svg`` (drawn from them). ``test_the_picture_is_the_code`` fails
when either no longer matches the code.
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
from test_import_graph import SRC, import_graph, modules

pytestmark = pytest.mark.timeout(60)

ROOT = SRC.parent
ARROWS_FILE = ROOT / "docs" / "layers.txt"
PICTURE_FILE = ROOT / "docs" / "layers.svg"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

LAYERS: dict[str, tuple[str, ...]] = {
    # the ground: parts that import nothing of the package
    "_kernels": (),
    "kernel": (),
    "backends": (),
    "flag_errors": (),
    "models": (),
    "data": (),
    "metrics": (),
    "rundir": (),
    "run_summary": (),
    "bandwidth": (),
    "wan": (),
    "report": (),
    # the pure algorithm: no sockets, threads or clocks
    "algorithm": ("_kernels",),
    # wire formats and channels; the model spec is built from the algorithm's fragmentation
    "runtime.transport": ("algorithm", "models"),
    # the run's configuration reads what it configures, never the runtime above it
    "config": (
        "algorithm",
        "backends",
        "data",
        "flag_errors",
        "metrics",
        "models",
        "runtime.transport",
    ),
    "recipe": ("algorithm", "config", "data", "models"),
    "runtime.chaos": ("config", "metrics"),
    # observability takes callables; the dashboard reaches a syncer as a client
    "runtime.observe": ("metrics", "runtime.learner", "runtime.transport"),
    "runtime.learner": (
        "algorithm",
        "config",
        "data",
        "metrics",
        "recipe",
        "runtime.chaos",
        "runtime.transport",
    ),
    "runtime.syncer": ("algorithm", "config", "metrics", "runtime.observe", "runtime.transport"),
    "runtime.export": (
        "config",
        "models",
        "recipe",
        "rundir",
        "runtime.learner",
        "runtime.syncer",
        "runtime.transport",
    ),
    "runtime.launch": (
        "algorithm",
        "backends",
        "config",
        "data",
        "flag_errors",
        "metrics",
        "recipe",
        "run_summary",
        "rundir",
        "runtime.chaos",
        "runtime.export",
        "runtime.learner",
        "runtime.observe",
        "runtime.syncer",
        "runtime.transport",
    ),
    "sim": ("algorithm", "bandwidth", "flag_errors", "kernel"),
    "engine": (
        "algorithm",
        "config",
        "data",
        "kernel",
        "metrics",
        "models",
        "recipe",
        "run_summary",
        "rundir",
        "runtime.export",
        "runtime.transport",
    ),
    # entry points and faces
    "integrations": ("runtime.learner",),
    "runtime": ("runtime.learner", "runtime.syncer"),
    "runtime.cli": (
        "config",
        "runtime.launch",
        "runtime.learner",
        "runtime.syncer",
        "runtime.transport",
    ),
    "ddiloco": ("config", "runtime.export", "runtime.learner"),
    "cli": (
        "backends",
        "config",
        "ddiloco",
        "engine",
        "metrics",
        "runtime.cli",
        "runtime.launch",
        "sim",
    ),
}
"""Part -> the parts it may import."""

NEVER = {
    ("algorithm", "engine"): "the algorithm is pure: both engines build on it",
    ("config", "runtime.launch"): "the configuration reads backend names from ddiloco.backends",
    ("config", "runtime.syncer"): "the syncer reads the configuration, not the other way",
    ("config", "runtime.learner"): "the learner reads the configuration, not the other way",
    ("runtime.transport", "config"): "the transport declares its own limits",
    ("runtime.observe", "runtime.launch"): "observability takes callables",
    ("runtime.observe", "runtime.syncer"): "observability takes callables",
    ("engine", "sim"): "the event kernel is ddiloco.kernel, owned by neither",
    ("runtime.syncer", "runtime.launch"): "launchers start syncers, never the other way",
    ("runtime.learner", "runtime.launch"): "launchers start learners, never the other way",
}
"""Arrows the table must never allow, and why."""


def part(module: str) -> str:
    """The part of a dotted module name: its top-level module or package under the root
    package, a package of ``runtime`` on its own."""
    names = module.split(".")[1:]
    if not names:
        return module
    if names[0] == "runtime" and len(names) > 1:
        return f"runtime.{names[1]}"
    return names[0]


def part_arrows(
    graph: dict[str, dict[str, int]], part_of: Callable[[str], str] = part
) -> dict[tuple[str, str], list[tuple[str, str, int]]]:
    """(part A, part B) -> every import of a module of A of one of B: (module, module, line)."""
    out: dict[tuple[str, str], list[tuple[str, str, int]]] = defaultdict(list)
    for a, edges in graph.items():
        for b, line in edges.items():
            if part_of(a) != part_of(b):
                out[part_of(a), part_of(b)].append((a, b, line))
    return dict(sorted(out.items()))


def violations(
    graph: dict[str, dict[str, int]],
    layers: dict[str, tuple[str, ...]],
    root: Path,
    part_of: Callable[[str], str] = part,
) -> list[str]:
    """One line per part without a row in ``layers`` and per import that its row does not
    allow, with the file and line."""
    mods = modules(root)
    out = [
        f"{p}: a part with no row in LAYERS (add one: what it may import)"
        for p in sorted({part_of(m) for m in graph} - set(layers))
    ]
    for (a, b), imports in part_arrows(graph, part_of).items():
        if a in layers and b not in layers[a]:
            for ma, mb, line in imports:
                where = f"{mods[ma].relative_to(root)}:{line}"
                out.append(f"{a} -> {b} is not in LAYERS: {ma} imports {mb}  ({where})")
    return out


def test_every_import_between_parts_is_declared():
    graph = import_graph(SRC)
    assert len(graph) > 50 and "ddiloco.kernel" in graph
    found = violations(graph, LAYERS, SRC)
    assert not found, "\n".join(found)


def test_the_table_is_layers():
    """Every part it names exists, it allows none of the arrows that must never be, and its
    arrows have no circle (so the parts stand on floors)."""
    parts = {part(m) for m in import_graph(SRC)}
    named = set(LAYERS) | {b for bs in LAYERS.values() for b in bs}
    assert named <= parts, f"parts in LAYERS that the package lacks: {sorted(named - parts)}"
    allowed = [f"{a} -> {b}: {why}" for (a, b), why in NEVER.items() if b in LAYERS[a]]
    assert not allowed, "\n".join(allowed)
    assert floors(LAYERS)  # raises on a circle


def test_a_wrong_way_import_is_named(tmp_path):
    """Negative control: an import the table does not allow is reported with its file and
    line, whichever kind of import it is; a part without a row is reported too."""
    pkg = tmp_path / "pkg"
    for d in ("low", "high"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "high" / "a.py").write_text("from pkg.low import b\n")
    (pkg / "low" / "b.py").write_text("X = 1\n\n\ndef f():\n    from pkg.high import a\n")
    (pkg / "extra.py").write_text("import pkg.low.b\n")
    table = {"pkg": (), "low": (), "high": ("low",)}
    found = violations(import_graph(tmp_path), table, tmp_path)
    assert found == [
        "extra: a part with no row in LAYERS (add one: what it may import)",
        "low -> high is not in LAYERS: pkg.low.b imports pkg.high.a  (pkg/low/b.py:5)",
    ]
    table["low"] = ("high",)
    with pytest.raises(ValueError, match="circle"):
        floors(table)


def test_the_page_order_is_checked():
    """Negative control: the architecture page's table out of order, or missing a part."""
    page = "x\n| part | what |\n|---|---|\n| `config/` | c |\n| `algorithm/` | a |\n\nrest"
    wrong = page_order(page, [("config", "algorithm")])
    assert "config/ imports algorithm/, listed after it" in wrong
    assert "the table names no kernel.py" in wrong


# -- the picture ------------------------------------------------------------------------


def floors(arrows: dict[str, tuple[str, ...]]) -> dict[str, int]:
    """Part -> its floor: 0 for a part that imports nothing, else one above the highest part
    it imports. A ValueError names a circle."""
    out: dict[str, int] = {}
    visiting: list[str] = []

    def floor(p: str) -> int:
        if p in out:
            return out[p]
        if p in visiting:
            raise ValueError(f"a circle: {' -> '.join(visiting[visiting.index(p) :] + [p])}")
        visiting.append(p)
        out[p] = 1 + max((floor(q) for q in arrows.get(p, ())), default=-1)
        visiting.pop()
        return out[p]

    for p in sorted(arrows):
        floor(p)
    return out


def code_arrows() -> list[tuple[str, str]]:
    """The arrows between parts that the code has today."""
    return list(part_arrows(import_graph(SRC)))


def arrows_text(arrows: list[tuple[str, str]]) -> str:
    head = (
        "# The arrows between the parts of src/ddiloco: A -> B where a module of A imports one\n"
        "# of B (tests/test_layers.py). Written with docs/layers.svg by\n"
        "# `python tests/test_layers.py`; the test fails when this list is not the code's.\n"
    )
    return head + "".join(f"{a} -> {b}\n" for a, b in arrows)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def label(p: str) -> str:
    """A part as its path under src/ddiloco: ``runtime/syncer/``, ``recipe.py``; the two
    package faces whose packages hold other parts as ``__init__.py`` and
    ``runtime/__init__.py``."""
    name = "ddiloco" if p == "ddiloco" else f"ddiloco.{p}"
    path = modules(SRC)[name].relative_to(SRC / "ddiloco")
    if path.name == "__init__.py" and p not in ("ddiloco", "runtime"):
        return f"{path.parent.as_posix()}/"
    return path.as_posix()


GROUPS = [
    ("the algorithm and the event kernel", "#d9ead3", ("algorithm", "_kernels", "kernel")),
    ("the real runtime", "#cfe2f3", ("runtime",)),
    ("configuration", "#fce5cd", ("config", "backends", "flag_errors")),
    ("engines and the simulator", "#ead1dc", ("engine", "sim", "recipe")),
    ("entry points", "#eeeeee", ("cli", "ddiloco", "integrations")),
]


def _colour(p: str) -> str:
    for _, colour, members in GROUPS:
        if p in members or any(p.startswith(m + ".") for m in members):
            return colour
    return "#ffffff"


def draw(arrows: list[tuple[str, str]], path: Path) -> None:
    """The parts on their floors (ground at the bottom) and every arrow, as an SVG whose
    metadata holds the digest of ``arrows_text(arrows)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

    out: dict[str, list[str]] = defaultdict(list)
    for a, b in arrows:
        out[a].append(b)
    parts = sorted({p for ab in arrows for p in ab} | set(LAYERS))
    level = floors({p: tuple(out[p]) for p in parts})
    rows: dict[int, list[str]] = defaultdict(list)
    for p in parts:
        rows[level[p]].append(p)
    # order each floor by the mean place of what its parts import and are imported by
    # (a few barycentre sweeps), so that arrows cross less
    place = {p: float(i) for r in rows.values() for i, p in enumerate(sorted(r))}
    into: dict[str, list[str]] = defaultdict(list)
    for a, b in arrows:
        into[b].append(a)
    for _ in range(8):
        for f in sorted(rows):
            for p in rows[f]:
                near = out[p] + into[p]
                if near:
                    place[p] = sum(place[q] for q in near) / len(near)
            rows[f].sort(key=lambda p: (place[p], p))
            width = len(rows[f])
            for i, p in enumerate(rows[f]):
                place[p] = i - (width - 1) / 2
    slot, rise, box_w, box_h = 2.0, 1.6, 1.75, 0.6  # in data units
    width = slot * max(len(r) for r in rows.values())
    xy = {}
    for f, r in rows.items():
        for i, p in enumerate(r):
            xy[p] = ((i + 0.5) * width / len(r), rise * f)
    matplotlib.rcParams.update({"svg.hashsalt": "ddiloco-layers", "svg.fonttype": "none"})
    fig, ax = plt.subplots(figsize=(0.7 * width + 1.5, 0.75 * rise * len(rows) + 1.2))
    for a, b in arrows:
        (xa, ya), (xb, yb) = xy[a], xy[b]
        ax.add_patch(
            FancyArrowPatch(
                (xa, ya - box_h / 2),
                (xb, yb + box_h / 2),
                arrowstyle="-|>",
                mutation_scale=9,
                linewidth=0.7,
                color="#5b6f82",
                alpha=0.45,
                connectionstyle="arc3,rad=0.06",
                shrinkA=0,
                shrinkB=1,
            )
        )
    for p, (x, y) in xy.items():
        ax.add_patch(
            FancyBboxPatch(
                (x - box_w / 2, y - box_h / 2),
                box_w,
                box_h,
                boxstyle="round,pad=0.02,rounding_size=0.12",
                facecolor=_colour(p),
                edgecolor="#34495e",
                linewidth=0.9,
                zorder=3,
            )
        )
        ax.text(x, y, label(p), ha="center", va="center", fontsize=8.5, zorder=4)
    for f in sorted(rows):
        ax.text(-0.2, rise * f, f"floor {f}", ha="right", va="center", fontsize=7, color="#777")
    ax.legend(
        handles=[
            Patch(facecolor=c, edgecolor="#34495e", label=n)
            for n, c, _ in [*GROUPS, ("models, data, metrics and the rest", "#ffffff", ())]
        ],
        loc="upper right",
        fontsize=7.5,
        frameon=False,
    )
    ax.set_xlim(-1.2, width + 0.1)
    ax.set_ylim(-0.6, rise * max(rows) + 0.6)
    ax.axis("off")
    ax.set_title(
        f"src/ddiloco: {len(parts)} parts and the {len(arrows)} arrows between them "
        "(A -> B: A imports B; a part stands above all it imports)",
        fontsize=10,
    )
    fig.tight_layout()
    meta = {"Date": None, "Description": f"arrows {_digest(arrows_text(arrows))}"}
    fig.savefig(path, format="svg", metadata=meta)
    plt.close(fig)


def test_the_picture_is_the_code():
    """docs/layers.txt lists the code's arrows, docs/layers.svg was drawn from that list,
    and docs/architecture.md shows the picture and names every part."""
    text = arrows_text(code_arrows())
    redraw = "run `python tests/test_layers.py` and commit docs/layers.txt and docs/layers.svg"
    assert ARROWS_FILE.read_text() == text, f"docs/layers.txt is not the code's: {redraw}"
    digest = re.search(r"arrows ([0-9a-f]{16})", PICTURE_FILE.read_text())
    assert digest and digest.group(1) == _digest(text), f"docs/layers.svg is stale: {redraw}"
    page = ARCHITECTURE.read_text()
    assert "](layers.svg)" in page
    assert page_order(page, code_arrows()) == []


def page_order(page: str, arrows: list[tuple[str, str]]) -> list[str]:
    """What is wrong with the first table of docs/architecture.md, which lists every part
    (first column) from the ground up: a part it does not name, or an arrow to a part listed
    after the importer."""
    by_label = {label(p): p for p in LAYERS}
    table = page.split("\n| part |", 1)[1].split("\n\n", 1)[0]
    order: list[str] = []
    for row in table.splitlines()[2:]:
        order += [by_label[x] for x in re.findall(r"`([^`]+)`", row.split("|")[1]) if x in by_label]
    where = {p: i for i, p in enumerate(order)}
    wrong = [f"the table names no {label(p)}" for p in sorted(LAYERS) if p not in where]
    wrong += [
        f"{label(a)} imports {label(b)}, listed after it"
        for a, b in arrows
        if a in where and b in where and where[b] > where[a]
    ]
    return wrong


def main() -> int:
    arrows = code_arrows()
    ARROWS_FILE.write_text(arrows_text(arrows))
    draw(arrows, PICTURE_FILE)
    print(f"wrote {ARROWS_FILE} and {PICTURE_FILE}: {len(arrows)} arrows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
