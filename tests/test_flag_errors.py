"""A command line that tyro cannot parse is one line on stderr and exit status 2, for every
command whose flags tyro generates (not tyro's multi-line box)."""

from __future__ import annotations

import pytest

from ddiloco.cli import main
from ddiloco.flag_errors import _reason

pytestmark = pytest.mark.timeout(60)

CASES = [
    # (argv, the error line after "ddiloco CMD: error: ")
    (["simulate", "--system", "dp", "--chips", "abc"], "--chips: expected an integer, got 'abc'"),
    (
        ["simulate", "--system", "dp", "--chips", "1e6", "--hours", "x"],
        "--hours: expected a number",
    ),
    (["simulate", "--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["simulate", "--system", "tpu"], "--system: invalid choice 'tpu'; choose one of "),
    (["bandwidth", "--datacenters", "many"], "--datacenters: expected an integer, got 'many'"),
    (["bandwidth", "--datacenters"], "--datacenters: expected a value"),
    (["bandwidth", "--tau", "1.5x"], "--tau: expected an integer, got '1.5x'"),
    (["launch", "--backend", "pbs"], "--backend: invalid choice 'pbs'; choose one of slurm"),
    (
        ["launch", "--backend", "slurm", "--nodes-per-island", "x"],
        "--nodes-per-island: expected an integer, got 'x'",
    ),
    (["train", "--steps", "many"], "--steps: expected an integer, got 'many'"),
    (["syncer", "--port", "x"], "--port/--runtime.port: expected an integer, got 'x'"),
]


@pytest.mark.parametrize("argv,line", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_an_unparsable_command_line_is_one_line_and_exit_2(argv, line, capsys):
    assert _status(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"ddiloco {argv[0]}: error: {line}"), err
    assert "╭" not in err


def _status(argv: list[str]) -> int | str | None:
    """The exit status of ``ddiloco ARGV``: returned, or raised as SystemExit."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_the_reason_of_a_union_names_the_types_other_than_none():
    message = (
        "no type matching {None}|INT could be instantiated from ['abc'].\n\nGot errors:  \n"
        "- <class 'NoneType'>: ['abc'] does not match choices ('None',)\n"
        "- <class 'int'>: invalid literal for int() with base 10: 'abc'"
    )
    assert _reason(message) == "expected an integer, got 'abc'"
    assert _reason("could not convert string to float: 'x'") == "expected a number, got 'x'"
    assert _reason("something else\nand more") == "something else; and more"


@pytest.mark.parametrize(
    "argv,line",
    [
        (["train", "--stepz", "10"], "unrecognized arguments: --stepz 10 (did you mean --steps?)"),
        (["simulate", "--chipz=3"], "unrecognized arguments: --chipz=3 (did you mean --chips?)"),
        (
            ["train", "--sync.tua", "2", "--lerners", "3"],
            "unrecognized arguments: --sync.tua 2 --lerners 3 (did you mean --sync.tau or "
            "--learners?)",
        ),
        (["train", "--bogus", "1"], "unrecognized arguments: --bogus 1"),  # nothing close
    ],
)
def test_an_unknown_flag_is_told_the_closest_one(argv, line, capsys):
    assert _status(argv) == 2
    assert capsys.readouterr().err == f"ddiloco {argv[0]}: error: {line}\n"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["train", "syncer", "simulate"])
def test_help_breaks_each_options_text_only_where_the_next_word_does_not_fit(command):
    """At 80 columns every line of an option's help is as full as the next word allows: no
    break where the docstring's source line ended."""
    import os
    import re
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "80", "TERM": "dumb"}
    out = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli", command, "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=100,
    ).stdout
    rows = [ln[2:-2] for ln in out.splitlines() if ln.startswith("│ ") and ln.endswith(" │")]
    assert len(rows) > 20, out
    bad = []
    for a, b in zip(rows, rows[1:]):
        at = len(b) - len(b.lstrip())  # where the option's text starts: 6, or 21 beside flags
        if at < 6 or not b.strip() or len(a) <= at or a[at] == " ":
            continue  # not a continuation of text above, or nothing above it in that column
        if not (a.startswith(" " * at) or a[at - 2 : at] == "  "):
            continue  # a flag line whose text starts below it
        words = b.split()
        if re.match(r"([-*]|\d+[.)])\s", b.strip()):
            continue  # a list item
        if len(a.rstrip()) - at + 1 + len(words[0]) <= len(b) - at:
            bad.append((a.strip(), b.strip()))
    assert bad == [], bad[:5]
