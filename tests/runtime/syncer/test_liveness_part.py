"""The syncer's timer thread (``ddiloco.runtime.syncer.liveness``), alone: fake callbacks
stand for the server."""

import threading
import time

import pytest

from ddiloco.runtime.syncer.liveness import Liveness


@pytest.mark.timeout(30)
def test_due_deadlines_fire_in_order_and_silent_learners_are_declared_dead():
    lock = threading.Lock()
    closed = False
    now0 = time.monotonic()
    heard = {0: now0, 1: now0 - 60.0}  # learner 1 has been silent for a minute
    live = {0, 1}
    fired: list[int] = []
    dead: list[int] = []
    ticks = [0]
    done = threading.Event()

    def declare_dead(m: int, now_s: float) -> None:
        dead.append(m)
        live.discard(m)

    def fire(p: int, now_s: float) -> None:
        fired.append(p)
        if len(fired) == 2:
            done.set()

    part = Liveness(
        lock,
        heartbeat_timeout_s=5.0,
        closed=lambda: closed,
        ready=lambda: True,
        tick=lambda: ticks.__setitem__(0, ticks[0] + 1),
        fire=fire,
        live=lambda: live,
        last_heartbeat_s=heard.get,
        declare_dead=declare_dead,
    )
    thread = part.start()
    with lock:
        part.add_timer(now0 + 0.2, 7)
        part.add_timer(now0 + 0.1, 3)
        part.add_timer(now0 + 3600.0, 9)  # not due
    assert done.wait(10.0)
    with lock:
        closed = True
        part.wake()
    thread.join(5.0)
    assert not thread.is_alive()
    assert fired == [3, 7] and [p for _, p in part.timers] == [9]
    assert dead == [1] and live == {0} and ticks[0] >= 1


@pytest.mark.timeout(30)
def test_nothing_happens_before_the_server_holds_a_model():
    lock = threading.Lock()
    closed = False
    calls: list[str] = []
    part = Liveness(
        lock,
        heartbeat_timeout_s=0.01,
        closed=lambda: closed,
        ready=lambda: False,
        tick=lambda: calls.append("tick"),
        fire=lambda p, now: calls.append("fire"),
        live=lambda: [0],
        last_heartbeat_s=lambda m: 0.0,
        declare_dead=lambda m, now: calls.append("dead"),
    )
    thread = part.start()
    time.sleep(0.6)  # a few ticks: no learner is declared dead, no publication retried
    with lock:
        closed = True
        part.wake()
    thread.join(5.0)
    assert calls == []
