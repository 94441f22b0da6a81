"""SHA-256 digests of wire bytes and token ids: the only hash the receipts use.

A digest here is always the raw 32-byte SHA-256 value (hex only at the JSON/CLI edge).
This module does not know what the bytes mean: the stage decides which exact bytes it
received and sent, and hashes them with `sha256_digest`.
"""

from __future__ import annotations

import hashlib
import operator
import sys
from array import array
from collections.abc import Iterable, Sequence

DIGEST_BYTES = 32
MAX_TOKEN_ID = 2**32 - 1


def sha256_digest(*chunks: bytes | bytearray | memoryview) -> bytes:
    """SHA-256 of the concatenation of `chunks` (a frame's header and tensor bytes, say)."""
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return h.digest()


def token_digest(token_ids: Sequence[int] | Iterable[int]) -> bytes:
    """SHA-256 of the ids as little-endian uint32: the request/output digest of a bundle.

    Raises ValueError for an id outside [0, 2**32), which no tokenizer produces.
    """
    ids = array("I")  # unsigned int: 4 bytes on every platform CPython supports
    for t in token_ids:
        try:
            v = operator.index(t)  # ints and numpy integers, not floats
        except TypeError:
            v = -1
        if isinstance(t, bool) or not 0 <= v <= MAX_TOKEN_ID:
            raise ValueError(f"token id must be an int in [0, {MAX_TOKEN_ID}], got {t!r}")
        ids.append(v)
    if sys.byteorder == "big":  # pragma: no cover - the digest is defined little-endian
        ids.byteswap()
    return hashlib.sha256(ids.tobytes()).digest()
