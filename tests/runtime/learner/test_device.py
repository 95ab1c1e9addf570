"""Learners on a device: snapshots into pinned host buffers on a side stream, installs staged
on the device, bf16 autocast, islands whose model is on CUDA. The CUDA tests run where a
device is present and skip elsewhere, saying so; the CPU path of the same code is tested
everywhere."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import read_jsonl, tiny_config, tiny_model

from ddiloco.algorithm.fragments import fragment_model
from ddiloco.algorithm.learner_state import LearnerSync, host_snapshot
from ddiloco.algorithm.schedule import FragmentSchedule
from ddiloco.runtime.learner.device import DeviceCopier, learner_device

NO_CUDA = "no CUDA device here (torch.cuda.is_available() is False); runs on a GPU machine"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)


def _sync(model: torch.nn.Module, copier: DeviceCopier | None, alpha: float = 0.0):
    frag = fragment_model(model, 2)
    snap = copier.snapshot if copier is not None else host_snapshot
    sync = LearnerSync(
        dict(model.named_parameters()), frag, FragmentSchedule(2, 4, 1), alpha=alpha, snapshot=snap
    )
    params = {n: p.detach().cpu() for n, p in model.named_parameters()}
    sync.load_global(params, [0, 0])
    return sync


def _drive(model: torch.nn.Module, copier: DeviceCopier | None, alpha: float) -> tuple[list, dict]:
    """Eight steps of deterministic parameter changes; every push answered by a merged
    version (the snapshot + 1) installed at its install step. Returns the snapshots taken
    and the final parameters, on the CPU."""
    sync = _sync(model, copier, alpha)
    stage = copier.stage if copier is not None else (lambda ts: (list(ts), None))
    gen = torch.Generator().manual_seed(0)
    snaps, version = [], 0
    for _ in range(8):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen).to(p.device))
        for o in sync.after_step(tokens=16):
            if o.ready is not None:
                o.ready()
            snaps.append([t.clone() for t in o.params])
            version += 1
            sync.on_push_result(o.fragment, o.seq, True, version)
            staged, ready = stage([t + 1.0 for t in o.params])
            sync.receive(o.fragment, version, staged, ready)
        sync.install_due()
    return snaps, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def test_the_cpu_copier_is_the_plain_copy():
    model = tiny_model()
    ref_snaps, ref = _drive(tiny_model(), None, alpha=0.25)
    snaps, got = _drive(model, DeviceCopier("cpu"), alpha=0.25)
    assert len(snaps) == len(ref_snaps) > 0
    for a, b in zip(snaps, ref_snaps):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    src = [torch.ones(3)]
    bufs, ready = DeviceCopier("cpu").snapshot(src, None)
    assert ready is None and bufs[0].dtype == torch.float32 and bufs[0] is not src[0]


def test_device_choice_and_its_errors():
    if not torch.cuda.is_available():
        assert learner_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="no CUDA device"):
            learner_device("cuda")
    assert learner_device("cpu", local_rank=3) == torch.device("cpu")
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        learner_device("tpu")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[1].to("meta")
    with pytest.raises(ValueError, match="one device"):
        DeviceCopier.for_params(list(model.parameters()))


@cuda
def test_cuda_snapshot_install_and_alpha_mixing_match_the_cpu_reference():
    ref_snaps, ref = _drive(tiny_model(), None, alpha=0.25)
    copier = DeviceCopier("cuda")
    snaps, got = _drive(tiny_model().cuda(), copier, alpha=0.25)
    assert len(snaps) == len(ref_snaps) > 0
    for a, b in zip(snaps, ref_snaps):
        assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a, b))
    assert all(torch.allclose(got[n], ref[n], atol=1e-5) for n in ref)
    bufs, ready = copier.snapshot([torch.ones(4, device="cuda")], None)
    assert bufs[0].is_pinned() and ready is not None


def _train_cuda(syncer, autocast: bool, steps: int = 48) -> tuple[dict, float, float]:
    from ddiloco.data import DataConfig, build_stream
    from ddiloco.data.synthetic import MarkovConfig
    from ddiloco.runtime.learner.hook import DecoupledLearner

    torch.manual_seed(0)
    model = tiny_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = DataConfig(kind="synthetic", markov=MarkovConfig(vocab_size=64, seed=0))
    stream = build_stream(data, learner=0, n_learners=1, batch_size=8, block_size=32, seed=0)
    losses = []
    with DecoupledLearner(
        model,
        opt,
        syncer=syncer.address,
        learner=0,
        P=2,
        H=8,
        tau=2,
        tokens_per_step=8 * 32,
        token=syncer.token,
    ) as dl:
        for _ in range(steps):
            x, y = (t.cuda(non_blocking=True) for t in stream.next_batch())
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
        assert all(p.is_cuda for p in model.parameters())
    return dl.report(), sum(losses[:5]) / 5, sum(losses[-5:]) / 5


@cuda
@pytest.mark.timeout(120)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_a_cuda_learner_trains_against_a_cpu_syncer(syncer_factory, autocast):
    rep, first, last = _train_cuda(syncer_factory(), autocast)
    assert rep["pushes_accepted"] >= 8 and rep["installs"] >= 6, rep
    assert rep["ledger"]["merged"] > 30, rep["ledger"]
    assert last < first - 0.3, (first, last)


@cuda
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_two_rank_gloo_island_with_its_model_on_cuda(tmp_path, monkeypatch):
    from ddiloco.runtime.launch.launcher import Launcher

    monkeypatch.setenv("DDILOCO_ISLAND_BACKEND", "gloo")  # one GPU, shared by both ranks
    run = tmp_path / "run"
    cfg = tiny_config(run, learners=1, steps=60, device="cuda", island_size=2)
    with Launcher(cfg) as la:
        s = la.run()
    assert s["ok"], s
    final = read_jsonl(run / "learner_0" / "metrics.jsonl")[-1]["report"]
    assert final["island_size"] == 2 and final["island_max_param_diff"] == 0.0
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"an NCCL island needs 2 GPUs; {torch.cuda.device_count()} here",
)
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_two_rank_nccl_island(tmp_path, monkeypatch):
    from ddiloco.runtime.launch.launcher import Launcher

    monkeypatch.delenv("DDILOCO_ISLAND_BACKEND", raising=False)
    run = tmp_path / "run"
    cfg = tiny_config(run, learners=1, steps=60, device="cuda", island_size=2)
    with Launcher(cfg) as la:
        s = la.run()
    assert s["ok"], s
    final = read_jsonl(run / "learner_0" / "metrics.jsonl")[-1]["report"]
    assert final["island_size"] == 2 and final["island_max_param_diff"] == 0.0
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"an NCCL FSDP island needs 2 GPUs; {torch.cuda.device_count()} here",
)
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sharding", ["fsdp", "hsdp"])
def test_a_two_rank_nccl_sharded_island(tmp_path, monkeypatch, sharding):
    """The shard-native island on GPUs: FSDP2 over NCCL, each rank pushing and installing
    its own shards (HSDP: a 2 x 1 mesh, the replicas taking turns by fragment)."""
    from ddiloco.runtime.launch.launcher import Launcher

    if sharding == "hsdp" and torch.cuda.device_count() < 4:
        pytest.skip(f"an NCCL HSDP island of 2 x 2 needs 4 GPUs; {torch.cuda.device_count()} here")
    ranks = 4 if sharding == "hsdp" else 2
    monkeypatch.delenv("DDILOCO_ISLAND_BACKEND", raising=False)
    run = tmp_path / "run"
    cfg = tiny_config(
        run, learners=1, steps=60, device="cuda", island_size=ranks, island_sharding=sharding
    )
    with Launcher(cfg) as la:
        s = la.run()
    assert s["ok"], s
    final = read_jsonl(run / "learner_0" / "metrics.jsonl")[-1]["report"]
    assert final["island_size"] == ranks
    assert final["pushes_accepted"] > 0 and final["installs"] > 0, final
    assert s["per_learner"][0]["ledger_balance_error"] < 1e-6
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5
