"""``tests/`` mirrors ``src/ddiloco``: every test directory is a package of the source tree,
and every module under ``tests/`` has a basename of its own (pytest imports them by
basename, rootdir-relative, so two ``test_cli.py`` in different directories cannot both be
collected)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src" / "ddiloco"


def _dirs(root: Path) -> set[Path]:
    return {
        p.relative_to(root)
        for p in root.rglob("*")
        if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))
    }


def test_every_test_directory_is_a_source_package():
    strays = sorted(str(d) for d in _dirs(TESTS) - _dirs(SRC))
    assert not strays, f"test directories with no package of that path under src/ddiloco: {strays}"


def test_module_basenames_are_unique():
    by_name: dict[str, list[str]] = defaultdict(list)
    for p in TESTS.rglob("*.py"):
        if p.name != "conftest.py" and "__pycache__" not in p.parts:
            by_name[p.name].append(str(p.relative_to(TESTS)))
    clashes = {n: sorted(ps) for n, ps in by_name.items() if len(ps) > 1}
    assert not clashes, f"rename one of each (pytest imports tests by basename): {clashes}"
