"""Learners wrapped differently train one model: ``examples/torchrun_learner.py`` as a
plain process and as torchrun islands (DDP, FSDP2, HSDP) against one real syncer process.
The syncer knows every tensor by its name in the unwrapped module, whatever the layout."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from runtime_helpers import read_jsonl

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "torchrun_learner.py"


def start_learner(
    syncer, m: int, wrap: str, ranks: int, tmp: Path, steps: int, *extra: str
) -> subprocess.Popen:
    """Learner m of the example: one process (``ranks == 1``) or a torchrun island."""
    head = [sys.executable]
    if ranks > 1:
        head += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    cmd = [*head, str(EXAMPLE), "--syncer", syncer.address, "--learner", str(m)]
    cmd += ["--wrap", wrap, "--steps", str(steps), *extra]
    env = {**syncer.env, "OMP_NUM_THREADS": "1"}
    src = str(Path(__file__).resolve().parents[3] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])
    return subprocess.Popen(
        cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(procs: list[subprocess.Popen], timeout_s: float) -> list[list[dict]]:
    """Each learner's reports (the JSON lines it printed, by rank), once all have exited."""
    outs = [p.communicate(timeout=timeout_s) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        # the first lines name the failure (a rank's traceback); the last, torchrun's summary
        assert p.returncode == 0, err if len(err) < 8000 else f"{err[:4000]}\n...\n{err[-4000:]}"
    reports = [[json.loads(x) for x in out.splitlines() if x.startswith("{")] for out, _ in outs]
    return [sorted(r, key=lambda x: x["rank"]) for r in reports]


def merged_learners(syncer) -> set[int]:
    return {
        m for r in read_jsonl(syncer.tmp / "syncer.jsonl") if r["kind"] == "merge"
        for m in r["learners"]
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_ddp_wrapped_island_trains_beside_a_plain_learner(syncer_factory, tmp_path):
    """``module.`` in front of every name (DDP) is no other model: both learners join, and
    the hook finds the island's process group in the DDP wrapper itself."""
    s = syncer_factory()
    procs = [
        start_learner(s, 0, "plain", 1, tmp_path, 40),
        start_learner(s, 1, "ddp", 2, tmp_path, 40),
    ]
    plain, ddp = finish(procs, 200)
    assert len(ddp) == 2 and {r["rank"] for r in ddp} == {0, 1}
    for r in [*plain, ddp[0]]:
        assert r["steps"] == 40 and r["installs"] > 0 and r["pushes_accepted"] > 0, r
        assert r["last_loss"] < 0.8 * r["first_loss"], r
    assert ddp[1]["pushes"] == 0  # rank 0 of a DDP island talks to the syncer for it
    assert merged_learners(s) == {0, 1}
    joins = [r for r in read_jsonl(s.tmp / "syncer.jsonl") if r["kind"] == "join"]
    assert sorted(r["learner"] for r in joins) == [0, 1]  # one join per learner, no E_SPEC


def test_wrappers_are_unwrapped_to_the_users_module():
    import torch

    from ddiloco.runtime.learner.layout import island_group, unwrap_model

    inner = torch.nn.Sequential(torch.nn.Linear(2, 2))
    dp = torch.nn.DataParallel(inner)
    assert [n for n, _ in dp.named_parameters()] == ["module.0.weight", "module.0.bias"]
    assert unwrap_model(dp) is inner
    assert unwrap_model(torch.compile(dp)) is inner  # compile's _orig_mod, then DP's module
    assert unwrap_model(inner) is inner
    assert island_group(inner) is None and island_group(dp) is None


def _wait_initialised(syncer, timeout_s: float = 60.0) -> None:
    import time

    from ddiloco.runtime.learner.client import SyncerClient

    c = SyncerClient(syncer.address, syncer.token)
    deadline = time.monotonic() + timeout_s
    try:
        while not c.status().get("initialised"):
            assert time.monotonic() < deadline, "the syncer got no initial model"
            time.sleep(0.2)
    finally:
        c.close()


def _model_numel() -> int:
    from ddiloco.models import build_model

    return sum(
        t.numel() for t in build_model("gpt_tiny", vocab_size=64, block_size=32).parameters()
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_an_fsdp_island_pushes_and_installs_its_shards_beside_a_plain_learner(
    syncer_factory, tmp_path, codec
):
    """Each rank of an FSDP2 island pushes its own shard of every fragment (about the
    fragment's bytes / R each, no gather) and installs only its shard of every merged one.
    int8 pushes are deltas: each rank's against its own installed shard."""
    s = syncer_factory()
    extra = ("--codec", codec)
    procs = [start_learner(s, 0, "plain", 1, tmp_path, 150, *extra)]
    _wait_initialised(s)  # the island's uplink is then its pushes alone
    procs.append(start_learner(s, 1, "fsdp", 2, tmp_path, 60, *extra))
    plain, fsdp = finish(procs, 260)
    assert [r["rank"] for r in fsdp] == [0, 1]
    for r in [*plain, *fsdp]:
        assert r["installs"] > 0 and r["pushes_accepted"] > 0 and r["loaded_global"], r
    for r in fsdp:
        # the island starts from the global model the plain learner has been training (its
        # first loss was 0.086 in one run, by when its start-up ended), so its loss is held
        # to the task's scale: an untrained model scores ln 64 = 4.16, a wrong install more
        assert r["steps"] == 60 and r["last_loss"] < math.log(64) / 4, r
    # every rank pushes every fragment's shard: about a whole fragment over R
    from ddiloco.algorithm.codecs import get_codec

    whole = get_codec(codec).nbytes(_model_numel()) / 4  # P = 4
    per_push = [r["bytes_sent"] / r["pushes"] for r in fsdp]
    for b in per_push:
        assert 0.35 * whole < b < 0.65 * whole, (per_push, whole)
    assert fsdp[0]["pushes"] == fsdp[1]["pushes"]
    assert fsdp[0]["rank_bytes_sent"] == [r["bytes_sent"] for r in fsdp]
    assert merged_learners(s) == {0, 1}
    joins = [r for r in read_jsonl(s.tmp / "syncer.jsonl") if r["kind"] == "join"]
    assert sorted(r["learner"] for r in joins) == [0, 1]  # rank 0 joins for the island


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_hsdp_island_initialises_the_syncer_and_its_replicas_stay_identical(
    syncer_factory, tmp_path
):
    """A 2 x 2 HSDP island (two replicas of two shards) uploads the initial model from its
    ranks' shards, pushes each shard once (the replicas take turns by fragment) and
    installs the same values in both replicas; a plain learner trains beside it."""
    s = syncer_factory()
    procs = [start_learner(s, 1, "hsdp", 4, tmp_path, 60)]
    _wait_initialised(s, 120)
    procs.append(start_learner(s, 0, "plain", 1, tmp_path, 60))
    hsdp, plain = finish(procs, 260)
    inits = [r for r in read_jsonl(s.tmp / "syncer.jsonl") if r["kind"] == "init"]
    assert len(inits) == 1 and inits[0]["learner"] == 1
    assert [r["rank"] for r in hsdp] == [0, 1, 2, 3]
    for r in hsdp:
        assert r["steps"] == 60 and r["pushes_accepted"] > 0 and r["loaded_global"], r
    # the mesh is [[0, 1], [2, 3]]: ranks 0 and 2 hold one shard, 1 and 3 the other
    for a, b in ((0, 2), (1, 3)):
        assert hsdp[a]["local_sum"] == hsdp[b]["local_sum"]
        # the replicas take turns: each pushes its shard of every other fragment
        assert hsdp[a]["pushes"] > 0 and abs(hsdp[a]["pushes"] - hsdp[b]["pushes"]) <= 2
    assert plain[0]["installs"] > 0
    assert merged_learners(s) == {0, 1}
