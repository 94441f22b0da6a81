"""Canonical bytes and field rules shared by receipts, bundles and evidence records.

Canonical form: a msgpack array of the fields in a fixed order, packed with bin for bytes
and str for text; msgpack packs each int in its shortest form, so equal values give equal
bytes. Decoding re-packs what it read and rejects input that is not byte-identical, so a
record has exactly one encoding and a digest of it is meaningful. Every bound is checked
before the value is used. This module does not know what any record means.
"""

from __future__ import annotations

import re

import msgpack

from receipts.errors import MalformedError

MAX_UINT64 = 2**64 - 1
MAX_LAYERS = 2**16  # far above any model; bounds layer indices from peers
MIN_NONCE_BYTES = 16  # 128 bits: a per-job nonce the coordinator draws at random
MAX_NONCE_BYTES = 32  # the wire protocol caps the nonce at 32 bytes too
MAX_JOB_ID_CHARS = 64  # ASCII, so also the wire cap of 64 bytes
# Job ids name files in the bundle store, so they are restricted to a filename-safe set
# that cannot be "." / ".." or hidden (uuid hex and "chatcmpl-…" both fit).
JOB_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def pack_canonical(fields: list[object]) -> bytes:
    """The canonical msgpack bytes of a record's field list."""
    return msgpack.packb(fields, use_bin_type=True)


def unpack_canonical(what: str, data: bytes, *, max_bytes: int, num_fields: int) -> list[object]:
    """Unpack a canonical field list of exactly `num_fields` items from at most `max_bytes`.

    Error handling: MalformedError (with `what`) for oversize input, bytes msgpack cannot
    read, a top level that is not an array of the right length, or a non-canonical encoding.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedError(what, f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > max_bytes:
        raise MalformedError(what, f"{len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        fields = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=num_fields,  # records are flat: nested records travel as bin
            max_map_len=0,  # no record contains a map
            max_ext_len=0,  # nor an ext type
        )
    except (ValueError, msgpack.UnpackException) as e:
        raise MalformedError(what, f"not msgpack ({type(e).__name__}: {e})") from e
    if not isinstance(fields, list) or len(fields) != num_fields:
        got = f"array of {len(fields)}" if isinstance(fields, list) else type(fields).__name__
        raise MalformedError(what, f"expected an array of {num_fields} fields, got {got}")
    try:
        canonical = pack_canonical(fields)
    except (ValueError, TypeError, OverflowError) as e:  # pragma: no cover - unpackb output repacks
        raise MalformedError(what, f"cannot re-encode ({e})") from e
    if canonical != data:
        raise MalformedError(what, "not in canonical encoding")
    return fields


def check_uint(what: str, value: object, *, limit: int = MAX_UINT64) -> int:
    """`value` as an int in [0, limit]; bool is not an int here."""
    if type(value) is not int:
        raise MalformedError(what, f"expected an int, got {type(value).__name__}")
    if not 0 <= value <= limit:
        raise MalformedError(what, f"{value} is outside [0, {limit}]")
    return value


def check_float(what: str, value: object) -> float:
    if type(value) is not float:
        raise MalformedError(what, f"expected a float, got {type(value).__name__}")
    return value


def check_bytes(what: str, value: object, *, length: int | None = None, min_len: int = 0, max_len: int | None = None) -> bytes:
    """`value` as bytes of exactly `length`, or within [min_len, max_len]."""
    if not isinstance(value, bytes):
        raise MalformedError(what, f"expected bytes, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise MalformedError(what, f"expected {length} bytes, got {len(value)}")
    if len(value) < min_len or (max_len is not None and len(value) > max_len):
        raise MalformedError(what, f"expected {min_len}..{max_len} bytes, got {len(value)}")
    return value


def check_job_id(value: object) -> str:
    if not isinstance(value, str):
        raise MalformedError("job_id", f"expected str, got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_JOB_ID_CHARS or not JOB_ID_PATTERN.fullmatch(value):
        raise MalformedError(
            "job_id", f"{value[:40]!r} is not 1..{MAX_JOB_ID_CHARS} chars of [A-Za-z0-9._-] starting alphanumeric"
        )
    return value


def check_nonce(value: object) -> bytes:
    return check_bytes("nonce", value, min_len=MIN_NONCE_BYTES, max_len=MAX_NONCE_BYTES)


def check_layers(what: str, start: object, end: object) -> tuple[int, int]:
    """A half-open layer range [start, end) with start < end <= MAX_LAYERS."""
    s = check_uint(f"{what}.layer_start", start, limit=MAX_LAYERS)
    e = check_uint(f"{what}.layer_end", end, limit=MAX_LAYERS)
    if not s < e:
        raise MalformedError(what, f"layer range [{s}, {e}) is empty or reversed")
    return s, e
