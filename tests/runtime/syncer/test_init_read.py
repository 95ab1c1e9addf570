"""The syncer reads the initial model tensor by tensor into memory of its own; a shard keeps
only its own fragments' tensors (``Initial.read_tensors``)."""

from collections import Counter

import numpy as np
import pytest

from ddiloco.runtime.syncer.data import Data
from ddiloco.runtime.syncer.initial import Initial


class _Streams:
    """Stands for the server's ``Data`` part: the stream's frames and their count."""

    chunks = Data.chunks

    def __init__(self) -> None:
        self.counters: Counter = Counter()

    @staticmethod
    def _parse(frame):  # continuation frames are the raw payload here
        return {}, frame


class _Reader:
    read_tensors = Initial.read_tensors

    def __init__(self) -> None:
        self.data = _Streams()


@pytest.mark.parametrize("cut", [1, 7, 1000])
def test_a_shard_keeps_its_own_tensors_and_reads_the_others_through(cut):
    numels = [3, 0, 5, 2, 0]
    values = np.arange(sum(numels), dtype=np.float32) + 0.5
    data = memoryview(values.tobytes())
    frames = [data[i : i + cut] for i in range(0, len(data), cut)]
    r = _Reader()
    got = r.read_tensors(frames[0], iter(frames[1:]), numels, [True, True, False, True, False])
    assert got[2] is None and got[4] is None
    assert got[0].tolist() == [0.5, 1.5, 2.5] and got[1].numel() == 0
    assert got[3].tolist() == [8.5, 9.5]
    every = _Reader().read_tensors(frames[0], iter(frames[1:]), numels)
    assert [t.numel() for t in every] == numels
    assert np.concatenate([t.numpy() for t in every]).tolist() == values.tolist()
