"""The ``[text]`` extra: the tokenizer's package alone, all that ``ddiloco prepare`` and the
real-text recipe need; without it both say so in one line and name it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
# runs argv[1:] as a script, or the ddiloco command, with the tokenizers package missing
WITHOUT_TOKENIZERS = (
    "import runpy, sys\n"
    "sys.modules['tokenizers'] = None  # import tokenizers raises ImportError\n"
    "sys.argv = sys.argv[1:]\n"
    "if sys.argv[0] == 'ddiloco':\n"
    "    from ddiloco.cli import main\n"
    "    sys.exit(main(sys.argv[1:]))\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def _without_tokenizers(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_TOKENIZERS, *argv],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=cwd,
    )


@pytest.mark.timeout(120)
def test_the_real_text_recipe_without_the_tokenizer_says_so_in_one_line(tmp_path):
    r = _without_tokenizers(
        str(ROOT / "bench" / "real_text" / "prepare.py"),
        "--books",
        str(ROOT / "bench" / "real_text" / "sample"),
        "--out",
        str(tmp_path / "kjv"),
        "--vocab-size",
        "512",
        cwd=tmp_path,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr == (
        "prepare.py: error: ddiloco prepare needs the 'tokenizers' package: "
        "pip install 'ddiloco[text]'\n"
    )


@pytest.mark.timeout(120)
def test_ddiloco_prepare_without_the_tokenizer_names_the_text_extra(tmp_path):
    (tmp_path / "corpus.txt").write_text("in the beginning\n")
    r = _without_tokenizers(
        "ddiloco", "prepare", "corpus.txt", "--tokenizer", "tok.json", "--out", "out", cwd=tmp_path
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr == (
        "ddiloco prepare: error: ddiloco prepare needs the 'tokenizers' package: "
        "pip install 'ddiloco[text]'\n"
    )


@pytest.mark.timeout(30)
def test_the_text_extra_is_the_tokenizer_and_hf_and_make_test_install_it():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]

    def closure(extra: str) -> set[str]:
        """The extra's packages, the extras it names (ddiloco[a,b]) expanded."""
        out: set[str] = set()
        for r in extras[extra]:
            m = re.fullmatch(r"ddiloco\[([\w,]+)\]", r)
            if m:
                out |= set().union(*(closure(x) for x in m.group(1).split(",")))
            else:
                out.add(re.split(r"[<>=;\[ ]", r, maxsplit=1)[0])
        return out

    assert closure("text") == {"tokenizers"}
    assert "tokenizers" in closure("hf") and "ddiloco[text]" in extras["hf"]
    make = (ROOT / "Makefile").read_text()
    installed = re.search(r"pip install -q -e '\.\[([\w,]+)\]'", make)
    assert installed, "the Makefile's editable install is not where this test looks"
    assert "tokenizers" in set().union(*(closure(x) for x in installed.group(1).split(",")))
