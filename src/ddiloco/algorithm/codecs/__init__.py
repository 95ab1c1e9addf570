"""Codecs for what travels between learners and the syncer, by name.

``registry`` defines the ``Codec`` protocol (``name``, ``delta``, ``lossless``,
``downlink``, ``nbytes``, ``encode``, ``encode_many``, ``decode``, ``roundtrip``) and the
registry; each other module defines codecs and registers them at import. Importing this
package registers the built-in ones, the modules imported below (``cast``: fp32 and bf16;
``integer``: int8, int4, int2 and 1bit; and so on). A new codec is one such module and its
name added to that import.
"""

from __future__ import annotations

from ddiloco.algorithm.codecs import cast, fp8, integer  # noqa: F401  (they register themselves)
from ddiloco.algorithm.codecs.registry import (
    CODECS,
    Codec,
    codec_names,
    downlink_codec_names,
    get_codec,
    register_codec,
)

__all__ = [
    "CODECS",
    "Codec",
    "codec_names",
    "downlink_codec_names",
    "get_codec",
    "register_codec",
]
