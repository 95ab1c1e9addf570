"""The example scripts in ``examples/``: two learner processes each, against a real
``ddiloco syncer`` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from runtime_helpers import read_jsonl

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "script,package", [("hf_trainer.py", "transformers"), ("lightning_trainer.py", "lightning")]
)
def test_example_runs_two_learners(script, package, tmp_path, syncer_factory):
    pytest.importorskip(package, reason=f"{package} is not installed")
    syncer = syncer_factory()
    env = {
        **syncer.env,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[2] / "src"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(EXAMPLES / script),
                "--syncer",
                syncer.address,
                "--learner",
                str(m),
                "--steps",
                "40",
                *(["--out", str(tmp_path / "out")] if package == "transformers" else []),
            ],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for m in range(2)
    ]
    outs = [p.communicate(timeout=200) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    for r in reports:
        assert r["steps"] == 40 and r["installs"] > 0 and r["pushes_accepted"] > 0, r
        # the same fixed batch, scored by the initial model and by the trained one
        assert r["loss_after"] < 0.6 * r["loss_before"], r
    merged = {
        m
        for r in read_jsonl(tmp_path / "syncer.jsonl")
        if r["kind"] == "merge"
        for m in r["learners"]
    }
    assert merged == {0, 1}
