"""The real-text benchmark's whole path (bench/real_text): the checked-in KJV sample is
prepared (books split, the held-out books written last, a BPE trained on the rest), trained
on with ``bench/real_text/run.toml`` as it stands but for the model and budget, and
evaluated on the held-out books; and the recipe's own parts: splitting ``bible``'s output
into books, and the message where the package is missing and cannot be installed."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers", reason="the hf extra (tokenizers) is not installed")

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "real_text"


def _load(script: str):
    spec = importlib.util.spec_from_file_location(f"real_text_{script}", BENCH / f"{script}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


recipe = _load("prepare")


@pytest.mark.timeout(120)
def test_sample_prepares_trains_and_evaluates_on_held_out_books(tmp_path, capsys):
    from tokenizers import Tokenizer

    from ddiloco.cli import main

    data = tmp_path / "kjv"
    argv = ["--books", str(BENCH / "sample"), "--out", str(data), "--vocab-size", "512"]
    assert recipe.main([*argv, "--no-progress"]) == 0
    assert "held out: Ruth, Jonah, James" in capsys.readouterr().out
    meta = json.loads((data / "meta.json").read_text())
    assert meta["vocab_size"] == 512
    # The held-out tail is exactly those three books, as the tokenizer encodes them.
    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    held = sorted((data / "books" / "held_out").glob("*.txt"))
    assert [p.name for p in held] == ["08_Ruth.txt", "32_Jonah.txt", "59_James.txt"]
    n_held = sum(len(tok.encode(p.read_text(encoding="utf-8")).ids) + 1 for p in held)
    assert meta["eval_tokens"] == n_held
    trained = {p.name for p in (data / "books" / "train").glob("*.txt")}
    assert trained.isdisjoint(p.name for p in held) and len(trained) == 4

    runs = tmp_path / "runs"
    for method in ("decoupled", "dp"):
        rc = main(
            [
                "train",
                "--config",
                str(BENCH / "run.toml"),
                "--data",
                f"bin:{data}",
                "--model",
                "gpt_tiny",
                "--steps",
                "40",
                "--batch-size",
                "8",
                "--block-size",
                "64",
                "--eval-every",
                "40",
                "--eval-batches",
                "4",
                "--method",
                method,
                "--out",
                str(runs / method),
                "--no-progress",
            ]
        )
        assert rc == 0
    s = json.loads((runs / "decoupled" / "summary.json").read_text())
    assert s["method"] == "decoupled" and s["merges"] > 0
    assert s["config"]["autocast"] == "bf16"  # run.toml's precision, in process
    assert math.isfinite(s["final_eval_loss"])
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5, s  # ln 512 = 6.24 at the start
    assert 0.0 < s["eval_accuracy"] < 1.0  # next-token accuracy on the held-out books

    # the table and the plots of docs/results/real_text.md, from the run directories
    summarize = _load("summarize")
    table = tmp_path / "table" / "real_text"
    assert summarize.main([str(runs), "--out", str(table)]) == 0
    rows = {r["run"]: r for r in json.loads(table.with_suffix(".json").read_text())["runs"]}
    assert rows["dp"]["vs_dp"] == "+0.00%" and rows["decoupled"]["loss"] == round(
        s["final_eval_loss"], 4
    )
    gap = 100 * (rows["decoupled"]["loss"] / rows["dp"]["loss"] - 1)
    assert rows["decoupled"]["vs_dp"] == f"{gap:+.2f}%"
    assert rows["decoupled"]["perplexity"] == pytest.approx(math.exp(s["final_eval_loss"]), 0.01)
    assert "| decoupled | decoupled | 0 |" in table.with_suffix(".md").read_text()
    for axis in ("tokens", "time"):
        assert (tmp_path / "table" / f"real_text_{axis}.png").stat().st_size > 5_000


def test_bible_output_splits_into_books_one_verse_a_line():
    body = "\n".join(f"\n{b} 1\n\n  1 Word of {b}.\n" for b in recipe.BOOKS)
    genesis = (
        "\nGenesis 1\n\n  1 In the beginning God created the heaven and the earth.\n"
        "  2 And the earth was without form, and void; and darkness was upon the face of\n"
        "the deep.\n\nGenesis 2\n\n  1 Thus the heavens\n"
    )
    books = recipe.split_books(genesis + body)
    assert list(books) == recipe.BOOKS
    assert books["Genesis"] == (
        "Genesis 1\nIn the beginning God created the heaven and the earth.\n"
        "And the earth was without form, and void; and darkness was upon the face of the deep."
        "\n\nGenesis 2\nThus the heavens\n\nGenesis 1\nWord of Genesis.\n"
    )
    assert books["1 John"] == "1 John 1\nWord of 1 John.\n"
    assert recipe.book_file("Song of Solomon") == "22_Song_of_Solomon.txt"
    with pytest.raises(ValueError, match="printed no"):
        recipe.split_books(genesis)


@pytest.mark.skipif(shutil.which("bible") is None, reason="Debian's bible-kjv is not installed")
def test_the_whole_bible_splits_and_the_held_out_books_are_a_twentieth():
    books = recipe.split_books(recipe.bible_text())
    verses = sum(len([ln for ln in t.splitlines() if ln]) for t in books.values())
    chapters = sum(t.count("\n\n") + 1 for t in books.values())
    assert len(books) == 66 and chapters == 1189 and verses - chapters == 31102
    size = {b: len(t.encode()) for b, t in books.items()}
    share = sum(size[b] for b in recipe.HELD_OUT) / sum(size.values())
    assert 0.05 < share < 0.06, share


def test_a_missing_package_without_root_says_what_to_do(monkeypatch):
    monkeypatch.setattr(recipe.shutil, "which", lambda name: None)
    monkeypatch.setattr(recipe.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match="apt-get install bible-kjv.*--books"):
        recipe.bible_text()


def test_held_out_books_must_leave_both_splits(tmp_path):
    books = recipe.read_books(BENCH / "sample")
    with pytest.raises(ValueError, match="no held-out or no training book"):
        recipe.write_split(books, tmp_path, ("Genesis",))
    with pytest.raises(ValueError, match="not books of the Bible"):
        recipe.write_split(books, tmp_path, ("Ruth", "Hezekiah"))
    assert list(books) == ["Ruth", "Esther", "Hosea", "Jonah", "Philippians", "Colossians", "James"]


def test_mixed_chapters_keep_the_text_and_the_held_out_books(tmp_path):
    """--mix-chapters writes every training chapter once, in a seeded order that mixes the
    books, and leaves the held-out books whole."""
    books = recipe.read_books(BENCH / "sample")
    assert len(recipe.chapters("Esther", books["Esther"])) == 10
    train, test, _ = recipe.write_split(books, tmp_path / "a", recipe.HELD_OUT, mix_seed=3)
    again, _, _ = recipe.write_split(books, tmp_path / "b", recipe.HELD_OUT, mix_seed=3)
    texts = [f.read_text() for f in sorted(train.iterdir())]
    assert texts == [f.read_text() for f in sorted(again.iterdir())]  # the seed fixes the order
    kept = [b for b in books if b not in recipe.HELD_OUT]
    assert sorted(texts) == sorted(c for b in kept for c in recipe.chapters(b, books[b]))
    assert "".join(texts) != "".join(books[b] for b in kept)  # not in book order
    heads = [t.split("\n", 1)[0].rsplit(" ", 1)[0] for t in texts[:12]]
    assert len(set(heads)) > 1  # the first chapters already come from several books
    assert sorted(f.name for f in test.iterdir()) == ["08_Ruth.txt", "32_Jonah.txt", "59_James.txt"]


_GCIDE_SAMPLE = """

00-database-url
   ftp://ftp.gnu.org/gnu/gcide

00-database-short
   The Collaborative International Dictionary of English v.0.48

 This file is part 1 of the GNU version of the dictionary.

Abjure \\Ab*jure"\\, v. t. [imp. & p. p. {Abjured}.]
   1. To renounce upon oath; to forswear.
      [1913 Webster]

   2. To renounce or reject with solemnity.
      [1913 Webster]

Abjurer \\Ab*jur"er\\, n.
   One who abjures.
   [1913 Webster]

Zythum \\Zy"thum\\, n. [L., fr. Gr.]
   A kind of ancient malt beverage.
   [WordNet 1.5]
"""


def test_the_dictionary_becomes_documents_of_entries_without_source_tags(tmp_path, monkeypatch):
    """``--with-gcide``: the dictionary's headword entries, grouped into documents in its
    own order, without the database's header entries or the source tag lines; a share of
    the documents is held out, the same share for the same seed."""
    import gzip

    path = tmp_path / "gcide.dict.dz"
    path.write_bytes(gzip.compress(_GCIDE_SAMPLE.encode()))
    monkeypatch.setattr(recipe, "GCIDE_ENTRIES_PER_DOC", 2)
    docs = recipe.gcide_documents(path)
    assert len(docs) == 2
    assert docs[0].startswith('Abjure \\Ab*jure"\\, v. t.') and "Abjurer" in docs[0]
    assert docs[1].startswith("Zythum") and docs[1].endswith("beverage.\n")
    joined = "".join(docs)
    assert "[1913 Webster]" not in joined and "[WordNet 1.5]" not in joined
    assert "00-database" not in joined and "GNU version" not in joined
    assert "[imp. & p. p. {Abjured}.]" in joined  # brackets inside a line are text
    for d in ("train", "held_out"):
        (tmp_path / "out" / "books" / d).mkdir(parents=True)
    many = [f"entry {i}\n" for i in range(100)]
    assert recipe.write_gcide(many, tmp_path / "out", seed=0) == (95, 5)
    held = sorted(p.name for p in (tmp_path / "out" / "books" / "held_out").iterdir())
    assert len(held) == 5 and len(list((tmp_path / "out" / "books" / "train").iterdir())) == 95
    for d in ("train", "held_out"):
        shutil.rmtree(tmp_path / "out" / "books" / d)
        (tmp_path / "out" / "books" / d).mkdir(parents=True)
    recipe.write_gcide(many, tmp_path / "out", seed=0)
    assert sorted(p.name for p in (tmp_path / "out" / "books" / "held_out").iterdir()) == held


def test_a_missing_dictionary_without_root_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(recipe.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match="apt-get install dict-gcide.*--with-gcide"):
        recipe.gcide_documents(tmp_path / "absent.dict.dz")


def test_the_regime_recipe_merges_each_fragment_100_times_in_under_one_pass():
    """``bench/real_text/regime.toml``: at least 100 rounds per fragment, and the tokens
    its M learners read are under the 13.9M training tokens of ``--with-gcide``."""
    from ddiloco.config.files import loads_config

    text = (BENCH / "regime.toml").read_text()
    cfg = loads_config(text.replace("bin:data/kjv_gcide", "synthetic"), source="regime.toml")
    assert cfg.steps // cfg.sync.H >= 100
    tokens = cfg.learners * cfg.steps * cfg.data.batch_size * cfg.data.block_size
    assert tokens < 13_895_363  # data/kjv_gcide: 14,617,076 tokens, the last 721,713 held out
    assert cfg.data.sharding == "interleaved"
