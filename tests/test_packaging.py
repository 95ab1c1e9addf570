"""The wheel, installed with no extras into a fresh virtual environment, runs the main job
and the simulator (``.ci/wheel_smoke.sh``): no import on a default path can hide behind a
test extra."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_wheel_runs_without_extras() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the wheel is built from the tracked files)")
    r = subprocess.run(
        ["bash", str(ROOT / ".ci" / "wheel_smoke.sh")], capture_output=True, text=True, timeout=580
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "wheel smoke: ok" in r.stdout
    assert "goodput" in r.stdout  # the simulator's report


@pytest.mark.timeout(30)
def test_the_readme_names_every_dependency_and_extra() -> None:
    """README's install paragraph lists what ``pip install`` brings: every dependency of
    pyproject.toml, every package of the ``[test]`` extra, and every extra by name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    readme = (ROOT / "README.md").read_text()
    text = readme[readme.index("Python >= 3.10. Dependencies:") :].split("\n\n", 1)[0]

    def name(requirement: str) -> str:
        return re.split(r"[<>=;\[ ]", requirement, maxsplit=1)[0]

    wanted = [name(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    missing = [n for n in wanted if n not in text]
    missing += [f"[{x}]" for x in project["optional-dependencies"] if f"`[{x}]`" not in text]
    assert not missing, f"README.md's install paragraph does not name {missing}"


@pytest.mark.timeout(120)
def test_the_build_configuration_is_read_without_deprecation_warnings(tmp_path) -> None:
    """setuptools reads pyproject.toml and setup.py (as ``pip install`` and ``make train``
    do on a fresh clone) without a deprecation warning, e.g. for a license given as a
    TOML table."""
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    r = subprocess.run(
        [sys.executable, "-W", "always", "setup.py", "--name"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "ddiloco"
    assert "Deprecat" not in r.stdout + r.stderr, r.stderr
