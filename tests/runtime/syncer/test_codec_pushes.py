"""Codecs against real ``ddiloco syncer`` processes on 127.0.0.1: an fp8 delta push is
reconstructed on the published version it names (the same merge as the parameters it
stands for, sent in fp32), the syncer sends fp8 fetches, and the public hook trains with
fp8 pushes. A syncer keeps the past versions that delta pushes name whenever it cannot know
the learners' codec."""

from __future__ import annotations

import time

import pytest
import torch
from runtime_helpers import init_syncer, push_header, tiny_model

from ddiloco.algorithm.codecs import get_codec
from ddiloco.config import TrainConfig
from ddiloco.runtime.learner.client import SyncerClient
from ddiloco.runtime.learner.hook import DecoupledLearner
from ddiloco.runtime.transport.spec import fragmentation_from_spec


@pytest.mark.timeout(90)
def test_an_fp8_delta_push_merges_like_the_parameters_it_stands_for(syncer_factory, tmp_path):
    fp8, fp32 = get_codec("fp8"), get_codec("fp32")
    merged = {}
    for kind in ("fp32", "fp8-delta"):
        s = syncer_factory(dir=tmp_path / kind)
        try:
            client = SyncerClient(s.address, s.token)
            spec, inc = init_syncer(client, tiny_model())
            frag = fragmentation_from_spec(spec)
            base = client.fetch([0])[0][1]
            g = torch.Generator().manual_seed(0)
            step = [torch.randn(t.numel(), generator=g) * 1e-3 for t in base]
            if kind == "fp32":  # what the delta decodes to, added to the published version
                moved = [b.view(-1) + fp8.roundtrip(d) for b, d in zip(base, step)]
                data = b"".join(fp32.encode(t) for t in moved)
                h = push_header(frag, 0, data, inc, seq=1)
            else:
                data = b"".join(fp8.encode(d) for d in step)
                assert len(data) == sum(fp8.nbytes(n) for n in frag.fragments[0].numels)
                h = push_header(frag, 0, data, inc, seq=1, codec="fp8", delta=True)
            r = client.push(h, data)
            assert r["status"] == "accepted" and r["target_version"] == 1, r
            version, tensors, _ = client.fetch([0], exact=True)[0]
            assert version == 1
            merged[kind] = tensors
            client.close()
        finally:
            s.close()
    for a, b in zip(merged["fp32"], merged["fp8-delta"]):
        assert torch.equal(a, b)


@pytest.mark.timeout(60)
def test_fp8_downlink(syncer_factory):
    s = syncer_factory("--downlink-codec", "fp8")
    client = SyncerClient(s.address, s.token)
    model = tiny_model()
    spec, _ = init_syncer(client, model)
    exact = {n: p.detach().float().view(-1) for n, p in model.named_parameters()}
    codec = get_codec("fp8")
    for f in fragmentation_from_spec(spec).fragments:
        version, tensors, nbytes = client.fetch([f.index])[f.index]
        assert version == 0 and nbytes == sum(codec.nbytes(k) for k in f.numels)
        for name, t in zip(f.names, tensors):
            assert torch.equal(t, codec.roundtrip(exact[name]))
    client.close()


@pytest.mark.timeout(60)
def test_the_hook_trains_with_fp8_pushes(syncer_factory):
    s = syncer_factory()
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    with DecoupledLearner(
        model,
        opt,
        syncer=s.address,
        learner=0,
        P=2,
        H=4,
        tau=1,
        schedule="steps",
        codec="fp8",
        tokens_per_step=64,
        token=s.token,
    ) as dl:
        for _ in range(24):
            _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            time.sleep(0.05)  # a step of real length, so merged fragments can come back in tau
            opt.step()
            opt.zero_grad()
    rep = dl.report()
    assert rep["pushes_accepted"] >= 10 and rep["installs"] >= 8, rep
    st = SyncerClient(s.address, s.token).status()
    assert st["merges"] >= 10 and st["learners"]["0"]["state"] == "left"


def test_a_syncer_keeps_past_versions_unless_the_run_file_says_no_push_is_a_delta():
    from ddiloco.runtime.syncer.run_config import syncer_server_config

    def history(from_file: bool, **kw) -> int:
        cfg = TrainConfig(max_staleness=5, **kw)
        return syncer_server_config(cfg, token="t", from_file=from_file).syncer.history

    # flags only: the learners push with their own codec, any of which may send deltas
    assert history(False) == history(False, codec="fp32") == 5
    assert history(False, history=2) == 2
    # a run file that learners read too: the codec's own ``delta`` decides
    assert history(True, codec="bf16") == history(True, codec="fp32") == 0
    assert history(True, codec="fp8") == history(True, codec="int4") == 5
