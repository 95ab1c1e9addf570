"""Every ```python block of README.md and docs/ runs as written, in a fresh directory.

A block may be preceded by an HTML comment, invisible in the rendered page:

- ``<!-- snippet: skip (REASON) -->``: not run; REASON says why (a live syncer, a GPU, the
  reader's own objects), and must be given;
- ``<!-- snippet: setup `CMD` `CMD` ... -->``: each shell command CMD runs first, in the
  same directory (``ddiloco`` and ``python`` are this interpreter's), to make what the block
  reads (a run directory, a data file).

Each block runs in its own process, so that nothing one defines or imports reaches another.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_MARK = re.compile(r"<!--\s*snippet:\s*(skip|setup)\b(.*)-->\Z", re.S)
TIMEOUT_S = 40


def snippets(text: str) -> list[tuple[int, str, str | None, str]]:
    """(line, kind, argument, code) of every python block: kind ``run``, ``skip`` (the
    argument: its reason) or ``setup`` (the argument: the commands' text)."""
    out = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip(" \t\n")
        # the comment that ends right before the block, if any
        mark = _MARK.match(before[before.rfind("<!--") :]) if before.endswith("-->") else None
        if mark is None:
            out.append((line, "run", None, m.group(1)))
        else:
            out.append((line, mark.group(1), mark.group(2).strip(), m.group(1)))
    return out


def _cases():
    for page in PAGES:
        for line, kind, arg, code in snippets(page.read_text(encoding="utf-8")):
            name = f"{page.relative_to(ROOT)}:{line}"
            marks = [pytest.mark.skip(reason=f"{name}: {arg}")] if kind == "skip" else []
            yield pytest.param(name, kind, arg, code, id=name, marks=marks)


CASES = list(_cases())


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    bin_dir = Path(sys.executable).parent
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["MPLBACKEND"] = "Agg"
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.timeout(2 * TIMEOUT_S + 10)
@pytest.mark.parametrize(("name", "kind", "arg", "code"), CASES)
def test_snippet_runs(name, kind, arg, code, tmp_path):
    env = _env(tmp_path)
    if kind == "setup":
        for cmd in re.findall(r"`([^`]+)`", arg or ""):
            r = subprocess.run(
                cmd,
                shell=True,
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
            )
            assert r.returncode == 0, f"{name}: setup `{cmd}` failed:\n{r.stdout}{r.stderr}"
    script = tmp_path / "snippet.py"
    script.write_text(code, encoding="utf-8")
    r = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert r.returncode == 0, f"{name} failed:\n{code}\n--- output ---\n{r.stdout}{r.stderr}"


@pytest.mark.timeout(30)
def test_every_snippet_is_run_or_skipped_for_a_reason():
    assert len(CASES) >= 5, "no python blocks found: the fence pattern no longer matches"
    for page in PAGES:
        for line, kind, arg, _ in snippets(page.read_text(encoding="utf-8")):
            where = f"{page.relative_to(ROOT)}:{line}"
            if kind == "skip":
                assert re.fullmatch(r"\(.+\)", arg or ""), f"{where}: a skip gives its (reason)"
            if kind == "setup":
                assert re.findall(r"`([^`]+)`", arg or ""), f"{where}: a setup gives `commands`"


@pytest.mark.timeout(10)
def test_markers_are_read():
    text = (
        "a\n<!-- snippet: skip (needs a GPU) -->\n```python\nx = 1\n```\n\n"
        "```python\ny = 2\n```\n<!-- snippet: setup `touch f` -->\n\n```python\nz\n```\n"
    )
    got = [(kind, arg) for _, kind, arg, _ in snippets(text)]
    assert got == [("skip", "(needs a GPU)"), ("run", None), ("setup", "`touch f`")]
