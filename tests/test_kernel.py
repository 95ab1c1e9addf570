import pytest

from ddiloco.kernel import Event, EventKernel


def test_kernel_orders_by_time_priority_then_seq_and_logs_exactly():
    k = EventKernel(log_events=True)
    seen = []

    def handler(kern, ev):
        seen.append((kern.now_s, ev.kind, ev.target))
        if ev.kind == "a" and ev.target == 0:
            kern.after(1.5, Event("b", 9))  # scheduled from inside a handler

    k.on("a", handler)
    k.on("b", handler)
    k.schedule(2.0, Event("a", 2))
    k.schedule(1.0, Event("b", 1), priority=1)
    k.schedule(1.0, Event("a", 0), priority=0)
    k.schedule(1.0, Event("a", 3), priority=1)  # same time and priority: scheduling order
    k.run(until_s=10.0)
    expected = [(1.0, "a", 0), (1.0, "b", 1), (1.0, "a", 3), (2.0, "a", 2), (2.5, "b", 9)]
    assert seen == expected
    assert [(e.time_s, e.kind, e.target) for e in k.log] == expected
    assert k.now_s == 10.0 and len(k) == 0


def test_kernel_run_stops_at_until_and_keeps_later_events():
    k = EventKernel()
    k.on("x", lambda kern, ev: None)
    k.schedule(5.0, Event("x"))
    k.run(until_s=4.0)
    assert k.now_s == 4.0 and len(k) == 1 and k.peek_time() == 5.0


def test_kernel_rejects_past_events_and_unknown_kinds_and_double_handlers():
    k = EventKernel()
    k.on("x", lambda kern, ev: None)
    with pytest.raises(ValueError):
        k.on("x", lambda kern, ev: None)
    k.run(until_s=3.0)
    with pytest.raises(ValueError, match="cannot schedule"):
        k.schedule(1.0, Event("x"))
    k.schedule(4.0, Event("nope"))
    with pytest.raises(KeyError, match="nope"):
        k.run(until_s=5.0)


def test_kernel_handler_errors_surface():
    k = EventKernel()

    def boom(kern, ev):
        raise RuntimeError("broken invariant")

    k.on("x", boom)
    k.schedule(0.0, Event("x"))
    with pytest.raises(RuntimeError, match="broken invariant"):
        k.run(until_s=1.0)


def test_push_and_pop_give_the_same_order_for_a_driver_with_its_own_loop():
    k = EventKernel()
    k.push(1.0, 9, "start", (0, 0))
    k.push(1.0, 1, "arrive", "x")
    k.push(0.5, 5, "end", None)
    k.push(1.0, 1, "arrive", "y")  # same time and priority: scheduling order
    assert bool(k) and len(k) == 4
    got = [k.pop() for _ in range(4)]
    assert got == [
        (0.5, "end", None),
        (1.0, "arrive", "x"),
        (1.0, "arrive", "y"),
        (1.0, "start", (0, 0)),
    ]
    assert k.now_s == 1.0 and not k
    with pytest.raises(ValueError, match="cannot schedule"):
        k.push(0.9, 0, "late")
