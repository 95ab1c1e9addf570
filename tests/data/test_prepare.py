"""``ddiloco prepare``: a BPE tokenizer trained offline on text the test writes, token
shards that decode back to that text, and ``bin:FOLDER`` training on them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="the hf extra (tokenizers) is not installed")

from ddiloco.cli import main  # noqa: E402
from ddiloco.data import (  # noqa: E402
    DataConfig,
    build_eval_batches,
    build_stream,
    parse_data_spec,
)
from ddiloco.data.prepare import EOT, prepare  # noqa: E402
from ddiloco.data.text import ShardedTokens, load_token_bin  # noqa: E402

WORDS = (
    "the cat sat on a mat while dogs ran past the old red barn and birds sang over "
    "green hills near quiet rivers"
).split()


def write_corpus(folder: Path, n_files: int = 6, seed: int = 0) -> list[str]:
    """Text files of sentences from a small vocabulary (one with non-ASCII text)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    docs = []
    for i in range(n_files):
        lines = [
            " ".join(rng.choice(WORDS, size=rng.integers(4, 12))).capitalize() + "."
            for _ in range(60)
        ]
        if i == 2:
            lines.append("Ünïcödé — façade, naïve café.")
        text = "\n".join(lines) + "\n"
        (folder / f"doc_{i}.txt").write_text(text, encoding="utf-8")
        docs.append(text)
    (folder / "skip.bin").write_bytes(b"\x00\x01")  # not a .txt/.md file: not read
    return docs


def decode_documents(out: Path, tok_path: Path) -> list[str]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    ids = np.asarray(load_token_bin(out)[np.arange(len(load_token_bin(out)))], dtype=np.int64)
    eot = tok.token_to_id(EOT)
    cuts = np.flatnonzero(ids == eot)
    starts = np.concatenate([[0], cuts[:-1] + 1])
    return [
        tok.decode(ids[a:b].tolist(), skip_special_tokens=False)
        for a, b in zip(starts, cuts, strict=True)
    ]


def test_prepare_trains_a_tokenizer_and_shards_decode_to_the_text(tmp_path, capsys):
    docs = write_corpus(tmp_path / "corpus")
    tok, out = tmp_path / "tok.json", tmp_path / "shards"
    rc = main(
        [
            "prepare",
            str(tmp_path / "corpus"),
            "--tokenizer",
            str(tok),
            "--vocab-size",
            "400",
            "--out",
            str(out),
            "--shard-tokens",
            "2000",
        ]
    )
    assert rc == 0
    captured = capsys.readouterr()
    assert "tokenizing" in captured.err  # the progress bar
    assert "trained and saved to" in captured.out
    meta = json.loads((out / "meta.json").read_text())
    assert 300 < meta["vocab_size"] <= 400 and meta["dtype"] == "uint16"  # fewer merges exist
    assert meta["n_documents"] == 6 and meta["eot_id"] == 0
    assert len(meta["shards"]) == -(-meta["n_tokens"] // 2000) >= 2
    assert sum(s["tokens"] for s in meta["shards"]) == meta["n_tokens"]
    assert all((out / s["file"]).stat().st_size == 2 * s["tokens"] for s in meta["shards"])
    assert decode_documents(out, tok) == docs  # lossless, in file order
    # BPE merges: fewer tokens than bytes
    assert meta["n_tokens"] < 0.6 * sum(len(d.encode()) for d in docs)

    # a second run loads the saved tokenizer and writes the same tokens
    again = prepare(
        [str(tmp_path / "corpus")],
        tokenizer=tok,
        out=tmp_path / "again",
        shard_tokens=1 << 20,
        progress=False,
    )
    assert not again.tokenizer_trained and again.shards == ["tokens_000.bin"]
    one = np.fromfile(tmp_path / "again" / "tokens_000.bin", dtype=np.uint16)
    many = np.concatenate([np.fromfile(out / s["file"], dtype=np.uint16) for s in meta["shards"]])
    assert np.array_equal(one, many)


def test_bin_folder_reads_the_shards_as_one_array(tmp_path):
    write_corpus(tmp_path / "corpus")
    r = prepare(
        [str(tmp_path / "corpus")],
        tokenizer=tmp_path / "tok.json",
        out=tmp_path / "s",
        vocab_size=300,
        shard_tokens=700,
        progress=False,
    )
    tokens = load_token_bin(tmp_path / "s")
    assert isinstance(tokens, ShardedTokens) and len(tokens) == r.n_tokens
    flat = np.concatenate([np.fromfile(tmp_path / "s" / f, dtype=np.uint16) for f in r.shards])
    idx = np.arange(650, 760).reshape(2, 55)  # windows across the shard boundary at 700
    assert np.array_equal(tokens[idx], flat[idx])
    cfg = parse_data_spec(f"bin:{tmp_path / 's'}")
    assert cfg.vocab_size == r.vocab_size <= 300
    stream = build_stream(cfg, learner=1, n_learners=2, batch_size=4, block_size=16)
    x, y = stream.next_batch()
    assert x.shape == (4, 16) and int(x.max()) < 300 and np.array_equal(x[:, 1:], y[:, :-1])
    assert len(build_eval_batches(cfg, n_batches=2, batch_size=4, block_size=16)) == 2


def test_training_on_prepared_shards_lowers_the_loss(tmp_path):
    from ddiloco.config import TrainConfig
    from ddiloco.engine import run

    write_corpus(tmp_path / "corpus", n_files=10)
    prepare(
        [str(tmp_path / "corpus")],
        tokenizer=tmp_path / "tok.json",
        out=tmp_path / "s",
        vocab_size=300,
        progress=False,
    )
    s = run(
        TrainConfig(
            out=str(tmp_path / "run"),
            method="decoupled",
            learners=2,
            steps=60,
            data=f"bin:{tmp_path / 's'}",
            model="gpt_tiny",
            batch_size=8,
            block_size=32,
            fragments=2,
            H=8,
            eval_every=60,
            eval_batches=2,
            progress=False,
            lr_schedule="constant",
        )
    )
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 1.0, s


def test_prepare_streams_an_hf_dataset(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the hf extra (datasets) is not installed")
    rows = [f"Row {i}: the cat sat on the mat {i % 13} times." for i in range(1200)]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": rows})}).save_to_disk(
        str(tmp_path / "ds")
    )
    r = prepare(
        [f"hf:{tmp_path / 'ds'}"],
        tokenizer=tmp_path / "tok.json",
        out=tmp_path / "s",
        vocab_size=300,
        text_column="body",
        progress=False,
    )
    assert r.n_documents == 1200
    assert decode_documents(tmp_path / "s", tmp_path / "tok.json") == rows


def test_prepare_errors_say_what_to_do(tmp_path, capsys):
    assert (
        main(
            [
                "prepare",
                str(tmp_path / "nope"),
                "--tokenizer",
                str(tmp_path / "t.json"),
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    assert (
        main(
            [
                "prepare",
                str(tmp_path / "empty"),
                "--tokenizer",
                str(tmp_path / "t.json"),
                "--out",
                str(tmp_path / "o"),
                "--no-progress",
            ]
        )
        == 2
    )
    assert "hold no text" in capsys.readouterr().err
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(tmp_path / "plain.json"))
    write_corpus(tmp_path / "c", n_files=1)
    with pytest.raises(ValueError, match=f"no {EOT} token"):
        prepare([str(tmp_path / "c")], tokenizer=tmp_path / "plain.json", out=tmp_path / "o2")
    with pytest.raises(ValueError, match="vocab_size must be >= 257"):
        prepare(
            [str(tmp_path / "c")],
            tokenizer=tmp_path / "new.json",
            out=tmp_path / "o3",
            vocab_size=100,
        )
    with pytest.raises(ValueError, match="without meta.json"):
        load_token_bin(tmp_path / "c")


def test_held_out_sources_are_the_eval_tail_and_no_learner_reads_them(tmp_path, capsys):
    train_docs = write_corpus(tmp_path / "train", n_files=6, seed=0)
    held_docs = write_corpus(tmp_path / "held", n_files=2, seed=1)
    tok, out = tmp_path / "tok.json", tmp_path / "s"
    argv = ["prepare", str(tmp_path / "train"), "--held-out", str(tmp_path / "held")]
    assert main([*argv, "--tokenizer", str(tok), "--vocab-size", "300", "--out", str(out)]) == 0
    assert "held out" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    assert meta["held_out_sources"] == [str(tmp_path / "held")]
    assert decode_documents(out, tok) == train_docs + held_docs  # held-out documents last
    tokens = np.asarray(load_token_bin(out))
    assert np.count_nonzero(tokens[-meta["eval_tokens"] :] == 0) == len(held_docs)  # their EOTs

    # The tokenizer saw the training sources only: the same as one trained on them alone.
    alone = prepare(
        [str(tmp_path / "train")],
        tokenizer=tmp_path / "alone.json",
        out=tmp_path / "a",
        vocab_size=300,
        progress=False,
    )
    assert alone.eval_tokens == 0 and "eval_tokens" not in json.loads(
        (tmp_path / "a" / "meta.json").read_text()
    )
    assert (tmp_path / "alone.json").read_text() == tok.read_text()

    # bin: holds out exactly that tail: learners' windows end before it, eval windows lie in it.
    cfg = parse_data_spec(f"bin:{out}")
    assert cfg.held_out_tokens == meta["eval_tokens"]
    start = len(tokens) - meta["eval_tokens"]
    for m in range(3):
        stream = build_stream(cfg, learner=m, n_learners=3, batch_size=8, block_size=16, seed=m)
        assert stream.shard[1] <= start  # type: ignore[attr-defined]
        contiguous = DataConfig(kind="bin", path=str(out), sharding="contiguous")
        stream = build_stream(contiguous, learner=m, n_learners=3, batch_size=8, block_size=16)
        assert stream.shard[1] == start * (m + 1) // 3 <= start  # type: ignore[attr-defined]
    tail = tokens[start:]
    for x, y in build_eval_batches(cfg, n_batches=4, batch_size=8, block_size=16):
        for row in np.concatenate([x.numpy(), y.numpy()[:, -1:]], axis=1):
            hits = np.flatnonzero(
                np.all(np.lib.stride_tricks.sliding_window_view(tail, 17) == row, 1)
            )
            assert len(hits), "an eval window outside the held-out documents"
    # An explicit eval_fraction overrides the declared tail.
    frac = DataConfig(kind="bin", path=str(out), eval_fraction=0.5, sharding="contiguous")
    assert frac.held_out_tokens is None
    assert build_stream(frac, learner=0, n_learners=1, batch_size=1, block_size=16).shard == (
        0,
        len(tokens) - int(len(tokens) * 0.5),
    )
