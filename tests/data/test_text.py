"""Text and token-file data: loading, shards, streams, resume, and every error case."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ddiloco.data.text import (
    TokenStream,
    bin_stream,
    load_text_bytes,
    load_token_bin,
    text_stream,
    token_eval_batches,
    token_layout,
)


def test_text_file_and_folder(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.MD").write_text("world")
    (tmp_path / "c.py").write_text("print()")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "d.txt").write_text("secret")
    assert load_text_bytes(tmp_path / "a.txt").tobytes() == b"hello"
    assert load_text_bytes(tmp_path).tobytes() == b"hello\nworld"
    assert load_text_bytes(tmp_path, all_files=True).tobytes() == b"hello\nprint()\nworld"
    assert load_text_bytes(tmp_path).dtype == np.uint8


def test_text_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.txt does not exist"):
        load_text_bytes(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_text_bytes(tmp_path / "empty.txt")
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "x.bin").write_bytes(b"12")
    with pytest.raises(ValueError, match="all_files=True"):
        load_text_bytes(tmp_path / "only")


def test_token_bin(tmp_path: Path) -> None:
    ids = np.arange(1000, dtype=np.uint16) * 37
    ids.tofile(tmp_path / "train.bin")
    tokens = load_token_bin(tmp_path / "train.bin")
    assert isinstance(tokens, np.memmap) and np.array_equal(tokens, ids)
    ids.astype(np.uint32).tofile(tmp_path / "wide.bin")
    assert np.array_equal(load_token_bin(tmp_path / "wide.bin", dtype="uint32"), ids)
    stream = bin_stream(tmp_path / "train.bin", learner=0, n_learners=2, batch_size=2, block_size=8)
    x, y = stream.next_batch()
    assert x.dtype == torch.long and (x % 37 == 0).all()


def test_token_bin_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.bin does not exist"):
        load_token_bin(tmp_path / "nope.bin")
    with pytest.raises(ValueError, match="is a folder"):
        load_token_bin(tmp_path)
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_token_bin(tmp_path / "empty.bin")
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match="not a multiple of the uint16 item size"):
        load_token_bin(tmp_path / "odd.bin")


def test_layout_is_disjoint_and_validated() -> None:
    shards, (eval_start, eval_end) = token_layout(
        1000, n_learners=3, block_size=8, eval_fraction=0.1
    )
    assert shards == [(0, 300), (300, 600), (600, 900)] and (eval_start, eval_end) == (900, 1000)
    with pytest.raises(ValueError, match="fewer learners"):
        token_layout(100, n_learners=8, block_size=16, eval_fraction=0.0)
    with pytest.raises(ValueError, match="held-out tail"):
        token_layout(100, n_learners=1, block_size=16, eval_fraction=0.05)
    with pytest.raises(ValueError, match="eval_fraction"):
        token_layout(100, n_learners=1, block_size=16, eval_fraction=1.0)


def test_streams_stay_in_their_shard_and_resume() -> None:
    tokens = np.arange(2000, dtype=np.int64)  # token value == its position
    kw = dict(n_learners=2, batch_size=4, block_size=16, eval_fraction=0.1, sharding="contiguous")
    for m, (lo, hi) in enumerate([(0, 900), (900, 1800)]):
        s = TokenStream(tokens, learner=m, **kw)
        for _ in range(20):
            x, y = s.next_batch()
            assert x.shape == (4, 16) and torch.equal(y, x + 1)
            assert x.min() >= lo and y.max() < hi
    a = TokenStream(tokens, learner=0, **kw)
    b = TokenStream(tokens, learner=1, **kw)
    assert not torch.equal(a.next_batch()[0] % 900, b.next_batch()[0] % 900)
    ref = TokenStream(tokens, learner=1, **kw)
    expected = [ref.next_batch() for _ in range(5)]
    resumed = TokenStream(tokens, learner=1, **kw)
    resumed.load_state_dict({**ref.state_dict(), "position": 2})
    for x, _ in expected[2:]:
        assert torch.equal(resumed.next_batch()[0], x)
    assert resumed.position == 5
    with pytest.raises(ValueError, match="n_tokens"):
        TokenStream(tokens[:1000], learner=1, **kw).load_state_dict(ref.state_dict())


def test_eval_batches_come_from_the_tail(tmp_path: Path) -> None:
    tokens = np.arange(2000, dtype=np.int64)
    ev = token_eval_batches(tokens, n_batches=3, batch_size=4, block_size=16, eval_fraction=0.1)
    assert len(ev) == 3 and all(x.min() >= 1800 for x, _ in ev)
    again = token_eval_batches(tokens, n_batches=3, batch_size=4, block_size=16, eval_fraction=0.1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(ev, again))
    with pytest.raises(ValueError, match="no held-out"):
        token_eval_batches(tokens, n_batches=1, batch_size=1, block_size=4, eval_fraction=0.0)


def test_text_stream(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_bytes(bytes(range(256)) * 8)
    s = text_stream(tmp_path / "t.txt", learner=0, n_learners=1, batch_size=2, block_size=32)
    x, y = s.next_batch()
    assert x.max() < 256 and torch.equal(y[:, :-1], x[:, 1:])
    with pytest.raises(ValueError, match="learner"):
        text_stream(tmp_path / "t.txt", learner=1, n_learners=1, batch_size=2, block_size=32)
    with pytest.raises(ValueError, match="1-D"):
        TokenStream(np.zeros((2, 2)), learner=0, n_learners=1, batch_size=1, block_size=1)


@pytest.mark.parametrize("n_learners,shard_block", [(1, 64), (3, 64), (4, 100), (5, 37)])
def test_interleaved_shares_are_disjoint_and_cover_the_training_tokens(n_learners, shard_block):
    """The default sharding: each learner's blocks are its own, the learners' blocks
    together are every training token, and every window a learner draws lies in its
    share, inside one block (the held-out tail is never reached)."""
    tokens = np.arange(3000, dtype=np.int64)  # token value == its position
    kw = dict(
        n_learners=n_learners,
        batch_size=16,
        block_size=16,
        eval_fraction=0.1,
        shard_block=shard_block,
    )
    owner = np.full(2700, -1)
    streams = []
    for m in range(n_learners):
        s = TokenStream(tokens, learner=m, **kw)
        streams.append(s)
        for lo, hi in s.pieces:
            assert (owner[lo:hi] == -1).all(), "two learners share a token"
            owner[lo:hi] = m
    # every training token belongs to a learner (blocks too short for a window excepted)
    short = [i for i in range(2700) if owner[i] == -1]
    assert len(short) <= 16 and all(i >= 2700 - 16 for i in short)
    assert (
        owner[: shard_block * n_learners]
        == np.repeat(np.arange(n_learners), shard_block)[: shard_block * n_learners]
    ).all()
    for m, s in enumerate(streams):
        seen = set()
        for _ in range(40):
            x, y = s.next_batch()
            assert torch.equal(y, x + 1) and int(y.max()) < 2700
            first, last = x[:, 0].numpy(), y[:, -1].numpy()
            assert (owner[first] == m).all() and (owner[last] == m).all()
            assert (first // shard_block == last // shard_block).all()  # one block each
            seen.update((first // shard_block).tolist())
        if n_learners > 1:  # a learner's windows come from all over the corpus
            assert min(seen) < 2 * n_learners and max(seen) > 2700 // shard_block - 2 * n_learners
    # the same position gives the same batch after a resume; a state of another sharding is
    # refused
    ref = TokenStream(tokens, learner=n_learners - 1, **kw)
    expected = [ref.next_batch()[0] for _ in range(4)]
    resumed = TokenStream(tokens, learner=n_learners - 1, **kw)
    resumed.load_state_dict({**ref.state_dict(), "position": 2})
    assert torch.equal(resumed.next_batch()[0], expected[2])
    other = TokenStream(tokens, learner=n_learners - 1, **{**kw, "shard_block": shard_block + 1})
    with pytest.raises(ValueError, match="shard_block"):
        other.load_state_dict(ref.state_dict())


def test_contiguous_sharding_is_the_old_layout_and_draws() -> None:
    """``sharding="contiguous"``: one shard per learner, drawn exactly as before the
    interleaved default (the plain offset within the shard)."""
    from ddiloco.data.stream import TRAIN, rng_for

    tokens = np.arange(2000, dtype=np.int64)
    s = TokenStream(
        tokens,
        learner=1,
        n_learners=2,
        batch_size=4,
        block_size=16,
        eval_fraction=0.1,
        sharding="contiguous",
    )
    assert s.shard == (900, 1800) and s.pieces.tolist() == [[900, 1800]]
    for b in range(3):
        offsets = rng_for(0, TRAIN, 1, b).integers(0, 900 - 16, size=4)
        assert torch.equal(s.next_batch()[0][:, 0], torch.from_numpy(900 + offsets))
    with pytest.raises(ValueError, match="sharding"):
        TokenStream(tokens, learner=0, n_learners=2, batch_size=1, block_size=4, sharding="x")
    with pytest.raises(ValueError, match="shard_block"):
        TokenStream(tokens, learner=0, n_learners=2, batch_size=1, block_size=64, shard_block=32)
