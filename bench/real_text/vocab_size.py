"""The BPE vocabulary of the real-text corpus, by measurement (issue 27).

    python bench/real_text/vocab_size.py --sizes 1024,2048,4096,8192,16384

For each size, ``ddiloco prepare`` trains the tokenizer on the training books and writes
the shards (the held-out books last), and this prints: the seconds it took; the tokens of
the training books and bytes per token of the held-out books (how much text a token
carries, on text the tokenizer did not see); the share of the vocabulary that occurs fewer
than ``--rare`` times in the training tokens (embeddings that get few gradient updates in
a few passes over 1M tokens), and how many entries never occur (byte tokens of bytes
the text does not have, mostly); and the share of ``--model``'s parameters in its two
embedding matrices (token embedding and unembedding, untied) at that vocabulary.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT / "src") not in sys.path:
    sys.path.append(str(ROOT / "src"))


def _recipe():
    spec = importlib.util.spec_from_file_location("real_text_prepare", HERE / "prepare.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1024,2048,4096,8192,16384")
    ap.add_argument("--books", type=Path, default=None, help="book files (default: `bible`)")
    ap.add_argument("--rare", type=int, default=100)
    ap.add_argument("--model", default="gpt_small")
    args = ap.parse_args(argv)

    from ddiloco.data.prepare import prepare
    from ddiloco.data.text import load_token_bin
    from ddiloco.models import build_config, build_model

    recipe = _recipe()
    books = recipe.read_books(args.books) if args.books else recipe.split_books(recipe.bible_text())
    held_bytes = sum(len(t.encode()) for b, t in books.items() if b in recipe.HELD_OUT)
    print(
        f"| vocabulary | prepare s | training tokens | held-out bytes per token | "
        f"vocabulary under {args.rare} uses | never used | {args.model} embeddings share |"
    )
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        train, test, _ = recipe.write_split(books, Path(tmp), recipe.HELD_OUT)
        for v in (int(s) for s in args.sizes.split(",")):
            out = Path(tmp) / f"v{v}"
            t0 = time.perf_counter()
            r = prepare(
                [str(train)],
                held_out=[str(test)],
                tokenizer=out / "tokenizer.json",
                out=out,
                vocab_size=v,
                progress=False,
            )
            wall = time.perf_counter() - t0
            ids = np.asarray(load_token_bin(out))
            n_train = r.n_tokens - r.eval_tokens
            counts = np.bincount(ids[:n_train], minlength=r.vocab_size)
            d = build_config(args.model).n_embd
            n_params = sum(p.numel() for p in build_model(args.model, vocab_size=v).parameters())
            print(
                f"| {r.vocab_size} | {wall:.1f} | {n_train:,} | {held_bytes / r.eval_tokens:.2f} "
                f"| {np.mean(counts < args.rare):.1%} | {int(np.sum(counts == 0))} "
                f"| {2 * v * d / n_params:.1%} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
