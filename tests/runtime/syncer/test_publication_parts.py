"""The syncer's publication and checkpoint thread (``ddiloco.runtime.syncer.publication``,
``ddiloco.runtime.syncer.durability``), alone: fakes stand for the server."""

import threading
from collections import Counter

import torch

from ddiloco.algorithm.syncer_state import Merged
from ddiloco.runtime.syncer.durability import Durability
from ddiloco.runtime.syncer.publication import Publication


def _merged(p: int, version: int, learners=(0,), seqs=(1,)) -> Merged:
    return Merged(
        fragment=p,
        version=version,
        params=[torch.full((3,), float(version))],
        learners=tuple(learners),
        weights=tuple(1.0 for _ in learners),
        reason="quorum",
        at_s=0.0,
        seqs=tuple(seqs),
    )


def _publication(counters: Counter, lock: threading.Lock) -> Publication:
    pub = Publication(
        lock,
        counters,
        downlink_codec="fp32",
        downlink_delta=False,
        max_staleness=4,
        owns=lambda p: True,
    )
    pub.reset(2)
    return pub


def test_a_failed_publication_is_kept_and_published_on_retry_with_its_sequence_numbers():
    counters: Counter = Counter()
    lock = threading.Lock()
    pub = _publication(counters, lock)
    real, failures = pub.encode_down, [1]

    def flaky(params):
        if failures:
            failures.pop()
            raise MemoryError("injected")
        return real(params)

    pub.encode_down = flaky  # type: ignore[method-assign]
    mg = _merged(0, 1, learners=(0, 1), seqs=(5, 7))
    with lock:
        pub.note_merged(mg)
        watched = pub.merged_seq_pub  # what a watcher holds: never changed in place
        assert not pub.publish_merged(mg)
        assert pub.versions() == [0, 0] and counters["publish_errors"] == 1
        assert pub.merged_seq_pub == {} and 0 in pub.retry
        pub.retry_failed()
    assert pub.versions() == [1, 0] and not pub.retry
    assert pub.merged_seq_pub == {0: {0: 5}, 1: {0: 7}} and watched == {}
    assert torch.equal(pub.theta[0][0], mg.params[0])


def test_merges_wait_for_a_checkpoint_when_durable_and_are_published_at_once_otherwise():
    counters: Counter = Counter()
    lock = threading.Lock()
    pub = _publication(counters, lock)

    def part(**kw) -> Durability:
        return Durability(
            lock,
            counters,
            pub,
            checkpoint_keep=2,
            closed=lambda: False,
            snapshot=dict,
            **kw,
        )

    def merged(d: Durability, mg: Merged) -> None:  # as the server does with every merge
        pub.note_merged(mg)
        d.merged(mg)

    durable = part(checkpoint_dir="/nowhere", checkpoint_every=1)
    every2 = part(checkpoint_dir="/nowhere", checkpoint_every=2)
    none = part(checkpoint_dir=None, checkpoint_every=1)
    assert durable.durable and not every2.durable and not none.durable
    with lock:
        merged(durable, _merged(0, 1))
        assert pub.versions() == [0, 0] and durable.requested and 0 in durable.unpublished
        merged(every2, _merged(0, 1))
        assert pub.versions() == [1, 0] and not every2.requested  # one merge of two
        merged(every2, _merged(1, 1))
        assert pub.versions() == [1, 1] and every2.requested and every2.dirty_merges == 2
        merged(none, _merged(0, 2))
        assert pub.versions() == [2, 1] and not none.requested
