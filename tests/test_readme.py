"""README.md as a new user reads it: its documentation pages are links, every one of them,
and the commands of its user-loop section start what the section's code talks to."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    head = f"\n## {title}\n"
    assert head in README, title
    return README.split(head, 1)[1].split("\n## ", 1)[0]


@pytest.mark.timeout(30)
def test_the_readme_links_every_documentation_page():
    links = re.findall(r"\]\((docs/[^)\s]+)\)", README)
    assert links
    assert [t for t in links if not (ROOT / t).exists()] == []
    pages = sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md") if p.name != "index.md")
    listed = _section("Documentation")
    assert [p for p in pages if f"]({p})" not in listed] == []
    # a page of the documentation is named by a link, never as code text
    assert re.findall(r"`docs/[^`]*\.md`", README) == []


@pytest.mark.timeout(90)
def test_the_user_loop_section_starts_a_local_syncer(tmp_path):
    from ddiloco.runtime.learner.client import SyncerClient

    section = _section("Use it in your own training loop")
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    lines = [ln for b in blocks for ln in b.splitlines() if ln.startswith("ddiloco syncer ")]
    assert len(lines) == 1, blocks
    argv = shlex.split(lines[0])[1:]
    port = argv[argv.index("--port") + 1]
    assert f'syncer="127.0.0.1:{port}"' in section  # what the learners are told to pass
    assert "export DDILOCO_TOKEN=" in "".join(blocks)
    # the same command, on a free port, its checkpoints under tmp_path
    argv[argv.index("--port") + 1] = "0"
    argv[argv.index("--checkpoint-dir") + 1] = str(tmp_path / "ck")
    env = {**os.environ, "DDILOCO_TOKEN": "readme-token"}
    cmd = [sys.executable, "-m", "ddiloco.cli", *argv, "--port-file", str(tmp_path / "port")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "port").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        client = SyncerClient(f"127.0.0.1:{(tmp_path / 'port').read_text()}", "readme-token")
        try:
            st = client.status()
        finally:
            client.close()
        assert st["step_budget"] == int(argv[argv.index("--step-budget") + 1])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
