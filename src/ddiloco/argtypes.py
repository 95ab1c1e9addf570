"""argparse value types shared by the command-line entry points (torch-free)."""

from __future__ import annotations

import argparse
import math

__all__ = ["positive_int", "positive_float", "nonneg_float"]


def positive_int(text: str) -> int:
    """An integer >= 1; scientific notation such as ``1.2e6`` is accepted."""
    try:
        v = int(float(text)) if "e" in text.lower() else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _number(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")
    return v


def positive_float(text: str) -> float:
    """A finite number > 0."""
    v = _number(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def nonneg_float(text: str) -> float:
    """A finite number >= 0."""
    v = _number(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def codec_name(text: str) -> str:
    """A codec name (``bf16``, ``int4``, ... or a block-size variant such as ``int2/4096``)."""
    from ddiloco.algorithm.codecs import get_codec

    try:
        return get_codec(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
