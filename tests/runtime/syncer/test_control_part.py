"""The syncer's control plane (``ddiloco.runtime.syncer.control``), alone: a fake state and
fake callbacks stand for the server."""

import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from ddiloco.algorithm.schedule import SlotClock
from ddiloco.runtime.syncer.common import LearnerInfo, Reject
from ddiloco.runtime.syncer.control import Control
from ddiloco.runtime.syncer.durability import Resumed
from ddiloco.runtime.syncer.publication import Publication
from ddiloco.runtime.syncer.run_config import SyncerServerConfig
from ddiloco.runtime.transport import session, wire
from ddiloco.runtime.transport.wire import ErrorCode as E

pytestmark = pytest.mark.timeout(30)


class _State:
    """What the control plane reads of the state machine."""

    def __init__(self) -> None:
        self.live: set[int] = set()
        self.step_s: list[float] = []
        self.ledger: dict = {}
        self.policy = None
        self.merges = 0
        self.quorum_sizes: list[int] = []

    def join(self, m: int) -> None:
        self.live.add(m)

    def observe_step_s(self, s: float) -> None:
        self.step_s.append(s)


def _fail(ctx, r: Reject, who: str) -> None:
    raise r


def _control(st: _State | None, departed: list, events: list, **cfg) -> Control:
    lock = threading.Lock()
    pub = Publication(
        lock,
        Counter(),
        downlink_codec="fp32",
        downlink_delta=False,
        max_staleness=4,
        owns=lambda p: True,
    )
    pub.reset(2)

    def depart(m: int, now_s: float) -> None:
        departed.append(m)
        assert st is not None
        st.live.discard(m)

    def require_ready():
        if st is None:
            raise Reject(grpc.StatusCode.FAILED_PRECONDITION, E.NOT_READY, "no model")
        return st

    return Control(
        lock,
        SyncerServerConfig(token="t", **cfg),
        pub,
        boot_id="boot",
        started_s=time.monotonic(),
        state=lambda: st,
        require_ready=require_ready,
        spec=lambda: {"names": []},
        fingerprint=lambda: "fp",
        bulk_port=lambda: 50052,
        closed=lambda: False,
        depart=depart,
        counters=lambda: {"merges": 0},
        rejections=Counter(),
        event=lambda kind, **kw: events.append(kind),
        auth=lambda ctx: None,
        fail=_fail,
        bulk_slots=threading.BoundedSemaphore(1),
    )


def _call(fn, header: dict) -> dict:
    return wire.unpack(fn(wire.pack(header), None))[0]


def _join(c: Control) -> tuple[int, int, bytes]:
    r = _call(c.join, {"fingerprint": "fp", "process": "p"})
    return r["learner"], r["incarnation"], bytes.fromhex(r["session"])


def test_learners_join_report_steps_until_the_budget_is_spent_and_leave():
    st, departed, events = _State(), [], []
    c = _control(st, departed, events, step_budget=10)
    c.start_epoch()
    (a, inc_a, key_a), (b, inc_b, key_b) = _join(c), _join(c)
    assert (a, b) == (0, 1) and st.live == {0, 1} and c.run_started_wall is not None

    def beat(m, inc, key, hb, step):
        h = {"learner": m, "incarnation": inc, "hb": hb, "report": {"step": step, "step_s": 0.5}}
        return _call(c.heartbeat, session.sign(key, h))

    assert beat(a, inc_a, key_a, 1, 6)["stop"] is False
    r = beat(b, inc_b, key_b, 1, 4)
    assert r["stop"] is True and c.budget_spent and c.steps_done == {0: 6, 1: 4}
    assert r["clock"] is not None and r["clock"]["slot_s"] == 0.5  # the slot clock started
    with pytest.raises(Reject) as replay:
        beat(a, inc_a, key_a, 1, 7)
    assert replay.value.code == E.SESSION
    with pytest.raises(Reject) as unsigned:
        _call(c.heartbeat, {"learner": a, "incarnation": inc_a, "hb": 2})
    assert unsigned.value.code == E.SESSION
    with pytest.raises(Reject) as stale:
        c.require_live(a, inc_a + 1)
    assert stale.value.code == E.UNKNOWN_LEARNER
    assert c.require_live(a, inc_a) is st
    hello = session.sign(key_b, {"op": "hello", "token": "t", "learner": b})
    assert c.session_of(hello) == b and c.session_of({**hello, "learner": a}) is None

    _call(c.leave, session.sign(key_a, {"learner": a, "incarnation": inc_a}))
    assert departed == [a] and c.learners[a].state == "left" and c.run_ended_wall is None
    c.declare_dead(b, time.monotonic())
    assert departed == [a, b] and c.learners[b].state == "dead" and st.live == set()

    status = c.status()
    assert status["membership"]["join"] == 2 and status["membership"]["leave"] == 1
    assert status["membership"]["dead"] == 1 and status["steps_done"] == 10
    assert status["budget_spent"] and status["counters"] == {"merges": 0}
    assert [k for k in events if k != "clock"] == ["join", "join", "budget-spent", "leave", "dead"]


def test_a_live_learner_is_not_taken_over_by_another_process():
    st, departed, events = _State(), [], []
    c = _control(st, departed, events)
    r = _call(c.join, {"learner": 3, "fingerprint": "fp"})
    with pytest.raises(Reject) as dup:
        _call(c.join, {"learner": 3, "fingerprint": "fp"})
    assert dup.value.code == E.DUPLICATE
    with pytest.raises(Reject) as spec:
        _call(c.join, {"learner": 4, "fingerprint": "other"})
    assert spec.value.code == E.SPEC
    # the same process joins again with its session: a new incarnation
    again = _call(c.join, session.sign(bytes.fromhex(r["session"]), {"learner": 3}))
    assert again["incarnation"] == r["incarnation"] + 1 and c.incarnations == {3: 2}


def test_a_join_retried_after_its_reply_was_lost_is_the_same_process():
    """A Join that went through but whose reply never arrived is sent again by the same
    process without the session it made: its process key says it is that process, and it
    gets a new session; another process is still refused, even one that names the same
    process id (which ``status`` shows), and so is a Join without a key."""
    st, departed, events = _State(), [], []
    c = _control(st, departed, events)
    join = {"learner": 3, "fingerprint": "fp", "process": "p", "process_key": "k1"}
    first = _call(c.join, join)
    again = _call(c.join, join)
    assert again["incarnation"] == first["incarnation"] + 1 and st.live == {3}
    assert again["session"] != first["session"]
    for other in ({**join, "process_key": "k2"}, {**join, "process_key": None}):
        with pytest.raises(Reject) as dup:
            _call(c.join, other)
        assert dup.value.code == E.DUPLICATE
        assert "already live in another process" in dup.value.message


def test_before_the_model_a_join_asks_for_it():
    c = _control(None, [], [])
    assert _call(c.join, {})["need_init"] is True
    assert c.status()["initialised"] is False


def test_a_resume_restores_the_learners_not_live_and_their_ledger():
    st = _State()
    c = _control(st, [], [])
    c.start_epoch()
    clock = SlotClock(epoch_s=100.0, t0_s=100.0, x0=0.0, slot_s=0.25)
    c.restore(
        Resumed(
            path=Path("syncer.json"),
            incarnations={0: 3},
            steps_done={0: 40},
            epoch_s=100.0,
            clock=clock,
            run_started_wall=90.0,
            learners={0: LearnerInfo(incarnation=3, state="dead")},
        )
    )
    assert c.epoch_s == 100.0 and c.clock == clock and c.run_started_wall == 90.0
    status = c.status()
    assert status["learners"]["0"]["state"] == "dead" and status["steps_done"] == 40
    assert _join(c)[:2] == (1, 1)  # a new learner gets an id never handed out
