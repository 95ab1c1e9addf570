"""The user-loop path: ``DecoupledLearner`` in a plain training loop against a real syncer
process. The global model comes back into the user's model, a restarted learner carries its
step count, a mismatched model is refused naming what differs, and the README's examples run
as written."""

from __future__ import annotations

import itertools
import json
import re
import signal
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import runtime_helpers
import torch
from runtime_helpers import init_syncer, read_jsonl, tiny_model

from ddiloco.runtime.export import state_dict_from_syncer
from ddiloco.runtime.learner.client import SyncerClient, SyncerError
from ddiloco.runtime.learner.hook import DecoupledLearner

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a busy 2-core machine torch's thread pool makes a tiny
    model's step 30x slower (0.7 s instead of 20 ms)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, 64, (4, 17), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def _equal_to(sd: dict, model: torch.nn.Module) -> bool:
    return all(torch.equal(sd[n], t.detach()) for n, t in model.named_parameters())


def _learner0(model, opt, s, **kw) -> DecoupledLearner:
    """Learner 0 of syncer ``s`` with the small schedule these tests use (P = 2, H = 4)."""
    return DecoupledLearner(
        model,
        opt,
        syncer=s.address,
        learner=0,
        P=2,
        H=4,
        tau=1,
        tokens_per_step=64,
        token=s.token,
        **kw,
    )


@pytest.mark.timeout(90)
def test_the_global_model_comes_into_the_users_model(syncer_factory):
    s = syncer_factory()
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with _learner0(model, opt, s, load_global_on_exit=True) as dl:
        for i, (x, y) in enumerate(_batches(40)):
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.02)
            if i == 20:
                sd = dl.global_state_dict()  # a copy; the user's model is not touched
                assert not _equal_to(sd, model)
                versions = dl.load_global()  # install it and train on from it
                after = dl.global_state_dict()
                # the global model of just before or just after (a merge may fall between)
                assert _equal_to(sd, model) or _equal_to(after, model)
                assert [f.base_version for f in dl.sync.frags] == versions
    assert dl.loaded_global_on_exit
    live, meta = state_dict_from_syncer(s.address, token=s.token)
    assert sum(meta["versions"]) > 0
    assert _equal_to(live, model)  # at exit the model holds the syncer's global model
    st = SyncerClient(s.address, s.token).status()
    assert st["learners"]["0"]["report"]["global_step"] == 40


@pytest.mark.timeout(90)
def test_the_slot_clock_is_the_step_time_not_the_start_up(syncer_factory):
    """The syncer starts the time-driven schedule's slot clock from the step times the
    learners report; a learner's start-up (its caller's set-up after ``start`` and the first
    forward/backward) is no step: a slot length measured from it would hold until the
    next re-timing (seconds) and send every fragment that many times slower."""
    s = syncer_factory()
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    walls = []
    with _learner0(model, opt, s, heartbeat_interval=timedelta(milliseconds=50)):
        time.sleep(1.0)  # the caller's set-up: its data, its logging...
        end = time.monotonic() + 3.0
        for x, y in itertools.cycle(_batches(8)):
            model(x, y)[1].backward()
            time.sleep(0.02)
            opt.step()
            opt.zero_grad()
            walls.append(time.monotonic())
            if walls[-1] > end:
                break
    step_s = statistics.median(b - a for a, b in zip(walls, walls[1:]))
    clocks = [r["slot_s"] for r in read_jsonl(s.tmp / "syncer.jsonl") if r["kind"] == "clock"]
    assert clocks, "the syncer announced no slot clock"
    # the first slot length is the step time (a step here is 20-40 ms; the start-up is 1 s)
    assert clocks[0] < 2 * step_s, (clocks, step_s)


_LOOP = """
import json, sys, time, torch
torch.set_num_threads(1)
from datetime import timedelta
sys.path.insert(0, {tests!r})
from runtime_helpers import tiny_model
from ddiloco.runtime.learner.hook import DecoupledLearner
model = tiny_model(); opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
x = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
with DecoupledLearner(model, opt, syncer={address!r}, learner=1, P=2, H=4, tau=1,
                      tokens_per_step=64, heartbeat_interval=timedelta(milliseconds=100)) as dl:
    print(json.dumps({{"start": dl.global_step}}), flush=True)
    for _ in range({steps}):
        model(x[:, :-1], x[:, 1:])[1].backward(); opt.step(); opt.zero_grad()
        time.sleep(0.03)
        print(json.dumps({{"step": dl.global_step}}), flush=True)
"""


def _user_loop(address: str, token: str, steps: int) -> subprocess.Popen:
    harness = Path(runtime_helpers.__file__).parent  # where the child imports tiny_model from
    code = _LOOP.format(tests=str(harness), address=address, steps=steps)
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        env={**__import__("os").environ, "DDILOCO_TOKEN": token},
    )


@pytest.mark.timeout(120)
def test_a_sigkilled_user_loop_learner_restarts_with_its_step_count(syncer_factory):
    """No ``extra_report`` in the loop: the syncer's record of learner 1 carries its count."""
    s = syncer_factory()
    first = _user_loop(s.address, s.token, 100000)
    last = 0
    for line in first.stdout:
        rec = json.loads(line)
        assert rec.get("start", 0) == 0
        last = rec.get("step", last)
        if last >= 30:
            break
    time.sleep(0.3)  # a few more steps and heartbeats, then a real SIGKILL
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    seen = SyncerClient(s.address, s.token).status()["learners"]["1"]["report"]["global_step"]
    assert seen >= 30
    second = _user_loop(s.address, s.token, 5)
    out, _ = second.communicate(timeout=90)
    assert second.returncode == 0
    recs = [json.loads(x) for x in out.splitlines()]
    assert recs[0]["start"] == seen  # the count of the killed process, as last reported
    assert recs[-1]["step"] == seen + 5
    st = SyncerClient(s.address, s.token).status()["learners"]["1"]
    assert st["report"]["global_step"] == seen + 5 and st["incarnation"] == 2


@pytest.mark.timeout(60)
def test_a_mismatched_model_is_refused_naming_what_differs(syncer_factory):
    s = syncer_factory()
    client = SyncerClient(s.address, s.token)
    init_syncer(client, tiny_model(), P=2)
    client.close()

    def join(model, **kw):
        dl = DecoupledLearner(
            model,
            syncer=s.address,
            learner=5,
            token=s.token,
            connect_timeout=timedelta(seconds=5),
            **{"P": 2, **kw},
        )
        with pytest.raises(SyncerError) as ei:
            dl.start()
        dl.client.close()
        msg = str(ei.value)
        assert "E_SPEC" in msg, msg
        return msg

    assert "P (fragments): syncer 2, learner 3" in join(tiny_model(), P=3)
    assert "fragmentation strategy: syncer 'balanced', learner 'strided'" in join(
        tiny_model(), strategy="strided"
    )
    from ddiloco.models import build_model

    torch.manual_seed(0)
    wider = build_model("gpt_tiny", n_layer=1, n_embd=48, n_head=2)
    msg = join(wider)
    assert (
        "tensor shapes differ" in msg and "tok_emb.weight: syncer [64, 32], learner [64, 48]" in msg
    )
    msg = join(tiny_model().double())
    assert "tensor dtypes differ" in msg and "syncer float32, learner float64" in msg
    torch.manual_seed(0)
    deeper = build_model("gpt_tiny", n_layer=2, n_embd=32, n_head=2)
    msg = join(deeper)
    assert "number of tensors: syncer 17" in msg and "tensors only the learner has" in msg


# -- the documentation's examples, run as written -------------------------------------------
def _doc_blocks(path: Path) -> list[str]:
    text = path.read_text()
    return [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "DecoupledLearner(" in b]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("doc", ["README.md", "docs/runtime.md"])
def test_the_documented_user_loop_examples_run(doc, syncer_factory, monkeypatch):
    blocks = _doc_blocks(ROOT / doc)
    assert blocks, f"no DecoupledLearner example in {doc}"
    s = syncer_factory()
    monkeypatch.setenv("DDILOCO_TOKEN", s.token)
    ns: dict = {}  # one namespace, as a reader runs the blocks in order
    for i, block in enumerate(blocks):
        code = re.sub(r'syncer="[^"]*"', f'syncer="{s.address}"', block)
        assert code != block, f"{doc} example {i} names no syncer address"
        model = tiny_model()
        ns.update(
            model=model,
            optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
            loader=_batches(30, seed=i),
            B=4,
            T=16,
        )
        t0 = time.monotonic()
        exec(compile(code, f"{doc}[example {i}]", "exec"), ns)  # noqa: S102 - the docs' own code
        print(f"{doc} example {i}: {time.monotonic() - t0:.1f} s")
        rep = ns["dl"].report()
        assert rep["global_step"] >= 30 * i + 1 and rep["pushes_accepted"] > 0, rep
        if "load_global_on_exit=True" in code:
            live, _ = state_dict_from_syncer(s.address, token=s.token)
            assert _equal_to(live, model)
    assert SyncerClient(s.address, s.token).status()["merges"] > 0


@pytest.mark.timeout(30)
def test_a_learner_without_a_token_is_told_the_python_names_for_one(monkeypatch):
    from ddiloco.runtime.transport.auth import TOKEN_ENV

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError) as e:
        DecoupledLearner(model, torch.optim.SGD(model.parameters(), lr=0.1), syncer="127.0.0.1:1")
    assert str(e.value).startswith(
        "no shared-secret token: set $DDILOCO_TOKEN or pass token=SECRET or token_file=PATH "
    )
    assert "--token-file" not in str(e.value)
