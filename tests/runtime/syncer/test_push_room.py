"""The syncer's room for push payloads (``ddiloco.runtime.syncer.push_room``)."""

import threading
import time

import pytest

from ddiloco.runtime.syncer.push_room import PushRoom


@pytest.mark.timeout(30)
def test_pushes_wait_for_room_and_get_it_as_it_is_given_back():
    room = PushRoom(100)
    a = room.take(50, 1.0, learner=0)
    b = room.take(40, 1.0, learner=1)
    assert a is not None and b is not None and room.used == 90
    got = []
    t = threading.Thread(target=lambda: got.append(room.take(30, 10.0, learner=2)))
    t.start()
    time.sleep(0.2)
    assert not got and room.waits == 1  # no room: it waits
    a.give_back()
    a.give_back()  # once only
    t.join(5.0)
    assert got and got[0] is not None and room.used == 70
    assert room.take(40, 0.1, learner=3) is None  # none freed in time: refused
    b.give_back()
    got[0].give_back()
    assert room.used == 0


@pytest.mark.timeout(30)
def test_one_learner_holds_at_most_half_the_room():
    """A learner whose pushes stall holding room leaves the other half to the others; a
    push over a learner's share takes all of that share."""
    room = PushRoom(100)
    stalled = room.take(500, 1.0, learner=0)
    assert stalled is not None and room.used == 50
    assert room.take(10, 0.1, learner=0) is None  # its share is taken
    other = room.take(500, 0.1, learner=1)  # another learner gets the other half at once
    assert other is not None and room.used == 100
    assert room.take(1, 0.05, learner=2) is None
    other.give_back()
    stalled.give_back()
    assert room.used == 0
    free = PushRoom()
    assert free.take(10**12, 0.0) is not None and free.used == 0
    with pytest.raises(ValueError):
        free.capacity = -1
