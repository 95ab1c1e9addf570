"""The real-text corpus (issue 27): the King James Bible, one document per book, whole books
held out, a byte-level BPE trained by ``ddiloco prepare`` on the training books only.

    python bench/real_text/prepare.py --out data/kjv          # from Debian's bible-kjv
    python bench/real_text/prepare.py --books bench/real_text/sample --out /tmp/kjv_sample \\
        --vocab-size 512                                       # the checked-in sample
    ddiloco train --config bench/real_text/run.toml --data bin:data/kjv [--method dp]

Needs the tokenizer's package (``pip install 'ddiloco[text]'``).

The text comes from ``bible "Gen1:1-Rev22:21"`` (Debian's ``bible-kjv``, installed here
with apt-get when it is missing and this process is root), or from ``--books DIR``, a folder
of book files as this script writes them (``bench/real_text/sample`` is one). Each book
becomes one document: its chapter headings (``Genesis 1``) kept, each verse on a line of its
own without its verse number (the package wraps verses at 80 columns and numbers them; the
numbers are a counter, not language).

The books of ``HELD_OUT`` (5.5% of the text) are held out: the tokenizer is trained without
them and no learner trains on them. They are passed to ``ddiloco prepare --held-out``, which
writes them last and records their length in ``meta.json``, so ``--data bin:OUT`` evaluates
on exactly those books. They span the kinds of text of the rest (narrative, wisdom, poetry,
prophecy, a gospel, letters); Mark is not among them, since most of it is also in Matthew
and Luke.

OUT gets ``books/train/*.txt`` and ``books/held_out/*.txt`` (two-digit canonical order
first, so sorted order is the Bible's), ``tokenizer.json`` and the shards with
``meta.json``.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT / "src") not in sys.path:
    sys.path.append(str(ROOT / "src"))

BOOKS = (
    "Genesis|Exodus|Leviticus|Numbers|Deuteronomy|Joshua|Judges|Ruth|1 Samuel|2 Samuel|"
    "1 Kings|2 Kings|1 Chronicles|2 Chronicles|Ezra|Nehemiah|Esther|Job|Psalms|Proverbs|"
    "Ecclesiastes|Song of Solomon|Isaiah|Jeremiah|Lamentations|Ezekiel|Daniel|Hosea|Joel|Amos|"
    "Obadiah|Jonah|Micah|Nahum|Habakkuk|Zephaniah|Haggai|Zechariah|Malachi|Matthew|Mark|Luke|"
    "John|Acts|Romans|1 Corinthians|2 Corinthians|Galatians|Ephesians|Philippians|Colossians|"
    "1 Thessalonians|2 Thessalonians|1 Timothy|2 Timothy|Titus|Philemon|Hebrews|James|1 Peter|"
    "2 Peter|1 John|2 John|3 John|Jude|Revelation"
).split("|")
"""The 66 books in the order ``bible`` prints them."""

HELD_OUT = ("Ruth", "Ecclesiastes", "Lamentations", "Jonah", "John", "Romans", "James")
"""Books no learner trains on: 227 KB of the corpus's 4.15 MB (5.5%; 65,041 of its
1,161,721 tokens at the default vocabulary)."""

VOCAB_SIZE = 2048
"""The BPE vocabulary of the full corpus, chosen by ``bench/real_text/vocab_size.py``
(``docs/results/real_text.md``)."""

PASSAGE = "Gen1:1-Rev22:21"
_HEADING = re.compile(r"^(.+) (\d+)$")
_VERSE = re.compile(r"^ {2}(\d+) (.*)$")


def bible_text(passage: str = PASSAGE) -> str:
    """What ``bible PASSAGE`` prints, installing Debian's ``bible-kjv`` first where it is
    missing and this process may (root, apt-get present)."""
    _install("bible-kjv", shutil.which("bible") is None)
    if shutil.which("bible") is None:
        raise SystemExit(
            "the `bible` command (Debian package bible-kjv) is not installed: run "
            "`sudo apt-get install bible-kjv` (Debian, Ubuntu), or pass --books "
            f"{HERE / 'sample'} to prepare the checked-in sample instead"
        )
    r = subprocess.run(["bible", passage], capture_output=True, text=True, check=True)
    return r.stdout


GCIDE = Path("/usr/share/dictd/gcide.dict.dz")
"""Debian's dict-gcide: the Collaborative International Dictionary of English (Webster's
Revised Unabridged of 1913 and WordNet; GPL 2 or later), 40 MB of text in dictzip
(gzip) form."""
GCIDE_ENTRIES_PER_DOC = 500
"""Consecutive dictionary entries per document (about 90 KB each)."""
GCIDE_HELD_OUT = 0.05
"""Share of the dictionary's documents held out, drawn by a fixed seed."""
_SOURCE_TAG = re.compile(r"^\s*\[[^\]]{1,40}\]\s*$")
_ENTRY = re.compile(r"\n\n(?=\S)")


def _install(package: str, missing: bool) -> None:
    """``apt-get install -y PACKAGE`` where it is ``missing`` and this process is root."""
    if not missing or os.geteuid() != 0 or not shutil.which("apt-get"):
        return
    print(f"installing Debian's {package} (apt-get install -y {package})", file=sys.stderr)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(["apt-get", "install", "-y", package], env=env).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, check=False)  # a stale package list
        subprocess.run(["apt-get", "install", "-y", package], env=env, check=False)


def gcide_documents(path: Path = GCIDE) -> list[str]:
    """The dictionary as documents of ``GCIDE_ENTRIES_PER_DOC`` consecutive entries, in its
    own (alphabetical) order: the database's header entries (``00-database-*``) and the
    source tags on lines of their own (``[1913 Webster]``, ``[WordNet 1.5]``, ``[PJC]``:
    a third of its lines, and no language) dropped."""
    import gzip

    _install("dict-gcide", not path.exists())
    if not path.exists():
        raise SystemExit(
            f"{path} (Debian package dict-gcide) is not there: run `sudo apt-get install "
            f"dict-gcide` (Debian, Ubuntu), or leave out --with-gcide"
        )
    text = gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
    lines = [ln.rstrip() for ln in text.splitlines() if not _SOURCE_TAG.match(ln)]
    entries = [e.strip("\n") for e in _ENTRY.split("\n".join(lines))]
    entries = [e for e in entries if e.strip() and not e.lstrip().startswith("00-database")]
    # the licence and front matter come first, as an entry of their own; keep only entries
    # that start with a headword (``Word \Pro*nun"ci*a*tion\``)
    entries = [e for e in entries if "\\" in e.split("\n", 1)[0]]
    n = GCIDE_ENTRIES_PER_DOC
    return ["\n\n".join(entries[i : i + n]) + "\n" for i in range(0, len(entries), n)]


def write_gcide(docs: list[str], out: Path, seed: int = 0) -> tuple[int, int]:
    """The dictionary's documents into OUT/books/train and OUT/books/held_out (a
    ``GCIDE_HELD_OUT`` share drawn by ``seed``); returns (training, held-out) counts."""
    k = max(1, round(len(docs) * GCIDE_HELD_OUT))
    held = set(random.Random(seed).sample(range(len(docs)), k))
    for i, d in enumerate(docs):
        where = "held_out" if i in held else "train"
        (out / "books" / where / f"gcide_{i:04d}.txt").write_text(d, encoding="utf-8")
    return len(docs) - k, k


def split_books(text: str) -> dict[str, str]:
    """``bible``'s output as {book: document}: chapter headings kept, each verse joined onto
    one line and its number dropped."""
    books: dict[str, list[str]] = {}
    lines: list[str] | None = None
    for raw in text.splitlines():
        line = raw.rstrip()
        heading = _HEADING.match(line)
        if heading and heading.group(1) in BOOKS:
            lines = books.setdefault(heading.group(1), [])
            if lines:
                lines.append("")
            lines.append(line)
            continue
        if lines is None or not line:
            continue
        verse = _VERSE.match(line)
        if verse:
            lines.append(verse.group(2))
        else:  # a verse's continuation, wrapped by the package
            lines[-1] += " " + line.strip()
    missing = [b for b in BOOKS if b not in books]
    if missing:
        raise ValueError(f"`bible {PASSAGE}` printed no {', '.join(missing)}")
    return {b: "\n".join(ls) + "\n" for b, ls in books.items()}


def book_file(book: str) -> str:
    """``08_Ruth.txt``: canonical order first."""
    return f"{BOOKS.index(book) + 1:02d}_{book.replace(' ', '_')}.txt"


def read_books(folder: Path) -> dict[str, str]:
    """The book files of ``folder`` (as :func:`book_file` names them), by book."""
    books = {}
    for f in sorted(folder.glob("*.txt")):
        name = f.stem.split("_", 1)[-1].replace("_", " ")
        if name not in BOOKS:
            raise ValueError(f"{f}: not a book file (NN_Book.txt with a book of the Bible)")
        books[name] = f.read_text(encoding="utf-8")
    if not books:
        raise ValueError(f"no book files (NN_Book.txt) in {folder}")
    return books


def chapters(book: str, text: str) -> list[str]:
    """A book's text cut at its chapter headings (``Genesis 1``), each with its heading."""
    return [c for c in re.split(rf"(?m)^(?={re.escape(book)} \d+$)", text) if c.strip()]


def write_split(
    books: dict[str, str], out: Path, held_out: tuple[str, ...], mix_seed: int | None = None
) -> tuple[Path, Path, list[str]]:
    """OUT/books/train and OUT/books/held_out, one file per book; returns both folders and
    the held-out books present. With ``mix_seed``, the training text is written instead as
    one file per chapter in a random order of that seed, so that each learner's shard (a
    contiguous quarter of the tokens at M = 4) mixes chapters from every kind of book."""
    unknown = sorted(set(held_out) - set(BOOKS))
    if unknown:
        raise ValueError(f"--held-out: {unknown} are not books of the Bible")
    present = [b for b in books if b in held_out]
    if not present or len(present) == len(books):
        raise ValueError(
            f"the held-out books {list(held_out)} leave no held-out or no training book "
            f"among {list(books)}"
        )
    train, test = out / "books" / "train", out / "books" / "held_out"
    for d in (train, test):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    mixed = []
    for book, text in books.items():
        if book in held_out:
            (test / book_file(book)).write_text(text, encoding="utf-8")
        elif mix_seed is None:
            (train / book_file(book)).write_text(text, encoding="utf-8")
        else:
            mixed += chapters(book, text)
    order = random.Random(mix_seed).sample(range(len(mixed)), len(mixed))
    for i, k in enumerate(order):
        (train / f"{i:05d}.txt").write_text(mixed[k], encoding="utf-8")
    return train, test, present


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=Path("data/kjv"), help="output folder (--data bin:OUT)"
    )
    ap.add_argument(
        "--books", type=Path, default=None, help="folder of NN_Book.txt files (default: `bible`)"
    )
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE, help="BPE vocabulary")
    ap.add_argument(
        "--held-out", nargs="+", default=list(HELD_OUT), metavar="BOOK", help="held-out books"
    )
    ap.add_argument(
        "--mix-chapters",
        type=int,
        default=None,
        metavar="SEED",
        help="write the training books' chapters in a random order of SEED, so that every "
        "learner's shard mixes all kinds of book (default: whole books in canonical order, "
        "so each learner gets a run of consecutive books)",
    )
    ap.add_argument(
        "--with-gcide",
        action="store_true",
        help="add Debian's dict-gcide dictionary (40 MB, about 10M tokens; 5%% of it held "
        "out): a corpus that one run in the DiLoCo family's regime does not read twice",
    )
    ap.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = ap.parse_args(argv)

    from ddiloco.data.prepare import prepare

    t0 = time.perf_counter()
    books = read_books(args.books) if args.books else split_books(bible_text())
    train, test, present = write_split(books, args.out, tuple(args.held_out), args.mix_chapters)
    extra, n_gcide = "", 0
    if args.with_gcide:
        docs = gcide_documents()
        n_train, n_held = write_gcide(docs, args.out)
        n_gcide = sum(len(d.encode("utf-8")) for d in docs)
        extra = (
            f"; dictionary: {len(docs)} documents ({n_gcide:,} bytes), {n_held} held out, "
            f"{n_train} for training"
        )
    tok = args.out / "tokenizer.json"
    tok.unlink(missing_ok=True)  # trained afresh on these training books
    r = prepare(
        [str(train)],
        held_out=[str(test)],
        tokenizer=tok,
        out=args.out,
        vocab_size=args.vocab_size,
        progress=not args.no_progress,
    )
    n_bytes = sum(len(t.encode("utf-8")) for t in books.values())
    n_all = n_bytes + n_gcide
    print(
        f"{len(books)} books ({n_bytes:,} bytes), held out: {', '.join(present)}{extra}; "
        f"{r.n_tokens:,} tokens ({n_all / r.n_tokens:.2f} bytes per token), the last "
        f"{r.eval_tokens:,} held out; vocabulary {r.vocab_size}; "
        f"{time.perf_counter() - t0:.1f} s\n"
        f"(ddiloco prepare {train} --held-out {test} --tokenizer {tok} "
        f"--vocab-size {args.vocab_size} --out {args.out})\n"
        f"train: ddiloco train --config {HERE / 'run.toml'} --data bin:{args.out}"
    )
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except ImportError as e:  # the tokenizer's package: one line that says what to install
        print(f"prepare.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
