"""Frame bodies: [u32 BE header length][msgpack header][raw tensor bytes][trailer].

The header is a msgpack map: `v` (protocol version), `kind` (a REGISTRY key), the
message's non-tensor fields, and `tensors`, a list of [name, dtype, shape, nbytes] whose
bytes follow the header in that order, contiguous and little-endian. Everything up to the
end of the tensor bytes is the frame's *canonical bytes* (what receipts hash). Messages
with TRAILER fields (receipts, compute_s: what each stage appends) carry them after the
tensors as a msgpack map, always, so a frame cut at any point fails to decode; every other
message ends with its tensor bytes. Canonical bytes on their own (a stage's frame log)
decode with canonical=True, the trailer fields taking their empty defaults.

decode() checks every length, count, type, dtype and shape a peer declares against
Limits before allocating anything for it, and raises only WireError. Knows nothing of
streams (the transport adds FRAME_PREFIX and enforces max_frame_bytes before reading) or
of what messages mean.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
import sys
from typing import Any

import msgpack
import torch

from shard.errors import JobRef, WireError
from shard.wire.dtypes import BY_NAME, BY_TORCH, DTYPES
from shard.wire.fields import Tensor, kind_of
from shard.wire.limits import FRAME_PREFIX, MAX_RANK, Limits
from shard.wire.messages import PROTOCOL_VERSION, REGISTRY, RESERVED_KEYS, Message

__all__ = ["FRAME_PREFIX", "HEADER_PREFIX", "Limits", "encode", "encode_body", "encode_trailer", "decode", "decode_frame", "frame_job"]

# Inside a body: the length of the msgpack header, u32 big-endian.
HEADER_PREFIX = struct.Struct(">I")
# Tensor bytes are little-endian and decoded by reinterpreting memory in place.
if sys.byteorder != "little":
    raise ImportError("shard.wire.codec assumes a little-endian host")

_TENSOR_ALIGN = max(d.itemsize for d in DTYPES)  # 8: aligned for every wire dtype
_PLAIN_LEAVES = (str, bytes, int, float, bool, type(None))
_DTYPE_NAMES = [d.name for d in DTYPES]
# What the header parser or tensor views may raise on hostile input; all become WireError.
_PARSE_ERRORS = (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException)


def _clip(value: object, n: int = 64) -> object:
    """A peer's value for an error message, cut so logs stay small."""
    if isinstance(value, (str, bytes)) and len(value) > n:
        return value[:n] + (b"..." if isinstance(value, bytes) else "...")
    return value


# A message class's layout is fixed; derived per frame it cost ~20 us of an ~80 us decode.
@functools.cache
def _fields(cls: type) -> tuple[tuple[dataclasses.Field, ...], tuple[dataclasses.Field, ...]]:
    """(header fields, tensor fields) of a message class, in declaration order (trailer fields are neither)."""
    trailer = _trailer_names(cls)
    fs = [f for f in dataclasses.fields(cls) if f.name not in trailer]
    return tuple(f for f in fs if not isinstance(kind_of(f), Tensor)), tuple(f for f in fs if isinstance(kind_of(f), Tensor))


@functools.cache
def _by_name(cls: type) -> dict[str, dataclasses.Field]:  # read only: shared by every frame of cls
    return {f.name: f for f in dataclasses.fields(cls)}


@functools.cache
def _decode_checks(cls: type) -> tuple[frozenset[str], dict[str, Tensor]]:
    """(the keys a header of `cls` may hold, its tensor fields' specs by name; read only)."""
    header_fields, tensor_fields = _fields(cls)
    return frozenset(f.name for f in header_fields) | RESERVED_KEYS, {f.name: kind_of(f) for f in tensor_fields}


def _trailer_names(cls: type) -> tuple[str, ...]:
    return getattr(cls, "TRAILER", ())


def _pack_field(msg: Message, f: dataclasses.Field, limits: Limits) -> Any:
    kind = kind_of(f)
    try:
        packed = kind.pack(getattr(msg, f.name))
    except (TypeError, ValueError) as e:
        raise WireError(f"field '{f.name}' type", type(kind).__name__, type(getattr(msg, f.name)).__name__) from e
    return kind.check(f"field '{f.name}'", packed, limits)


def _itemsize_of(t: Any) -> int:
    row = BY_TORCH.get(t.dtype) if isinstance(t, torch.Tensor) else None
    return row.itemsize if row else 0


def encode(msg: Message, limits: Limits | None = None) -> bytes:
    """The frame body for `msg` (no stream prefix): encode_body then encode_trailer."""
    return encode_body(msg, limits) + encode_trailer(msg, limits)


def encode_body(msg: Message, limits: Limits | None = None) -> bytes:
    """The canonical bytes of `msg`: header and tensors, no trailer. Checks msg with the
    same rules decode applies, under `limits` (default Limits()), so we never send what a
    peer must refuse. These are the bytes receipts hash (a prefix of encode's)."""
    limits = limits or Limits()
    cls = type(msg)
    if REGISTRY.get(getattr(cls, "KIND", None)) is not cls:
        raise TypeError(f"not a wire message: {cls.__name__}")
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": cls.KIND}
    header_fields, tensor_fields = _fields(cls)
    for f in header_fields:
        header[f.name] = _pack_field(msg, f, limits)
    table, chunks = [], []
    # Largest itemsize first: with the tensor bytes starting 8-aligned (see `pad`), every
    # tensor then starts at a multiple of its own itemsize and decodes without a copy.
    for f in sorted(tensor_fields, key=lambda f: -_itemsize_of(getattr(msg, f.name))):
        t, spec = getattr(msg, f.name), kind_of(f)
        if t is None:
            if not spec.optional:
                raise WireError(f"tensor '{f.name}' missing")
            continue
        if not isinstance(t, torch.Tensor):
            raise WireError(f"tensor '{f.name}' type", "Tensor", type(t).__name__)
        row = BY_TORCH.get(t.dtype)
        if row is None or row.name not in spec.dtypes:
            raise WireError(f"tensor '{f.name}' dtype", sorted(spec.dtypes), str(t.dtype))
        if t.dim() > MAX_RANK:
            raise WireError(f"tensor '{f.name}' rank", MAX_RANK, t.dim())
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)  # (numel * itemsize,)
        table.append([f.name, row.name, list(t.shape), raw.numel()])
        chunks.append(memoryview(raw.numpy()))
    header["tensors"] = table
    msg.check(limits)
    # bin8 holds 0..255 bytes behind a fixed 2-byte prefix, so growing `pad` by d grows
    # the header by exactly d: one repack lands the tensor bytes on an 8-byte boundary.
    header["pad"] = b""
    unpadded = len(msgpack.packb(header, use_bin_type=True))
    header["pad"] = bytes(-(HEADER_PREFIX.size + unpadded) % _TENSOR_ALIGN)
    head = msgpack.packb(header, use_bin_type=True)
    if len(head) > limits.max_header_bytes:
        raise WireError("header length", limits.max_header_bytes, len(head))
    return b"".join([HEADER_PREFIX.pack(len(head)), head, *chunks])


def encode_trailer(msg: Message, limits: Limits | None = None) -> bytes:
    """The bytes that follow msg's canonical bytes: a msgpack map of its TRAILER fields
    (b"" for a class with none)."""
    names = _trailer_names(type(msg))
    if not names:
        return b""
    limits = limits or Limits()
    by_name = _by_name(type(msg))
    return msgpack.packb({name: _pack_field(msg, by_name[name], limits) for name in names}, use_bin_type=True)


def decode(body: bytes | bytearray | memoryview, limits: Limits, *, canonical: bool = False) -> Message:
    """Parse and validate a frame body from a peer. Raises WireError and nothing else.

    Tensors are views into `body` when it is writable (bytearray) and suitably aligned;
    otherwise their bytes are copied once. Keep `body` alive as long as the tensors.
    canonical=True: `body` is canonical bytes only (no trailer; see the module doc).
    """
    return decode_frame(body, limits, canonical=canonical)[0]


def decode_frame(body: bytes | bytearray | memoryview, limits: Limits, *, canonical: bool = False) -> tuple[Message, int]:
    """decode(), plus the length n of the body's canonical bytes (body[:n], what receipts
    hash: everything before the trailer)."""
    try:
        return _decode(body, limits, canonical)
    except WireError:
        raise
    except _PARSE_ERRORS as e:  # a check we missed must still be a protocol error on this edge
        raise WireError("malformed frame", None, f"{type(e).__name__}: {_clip(str(e), 200)}") from e


def frame_job(body: bytes | bytearray | memoryview, limits: Limits) -> JobRef | None:
    """The (job_id, epoch, round) a frame's header names, each checked as decode() checks it,
    the rest of the frame unread; None when the header does not parse or names no valid job.
    Never raises: it names the job to answer when decoding failed for a reason of our own."""
    try:
        mv = memoryview(body).cast("B")  # (n,) bytes
        (head_len,) = HEADER_PREFIX.unpack_from(mv, 0)
        if head_len > limits.max_header_bytes or HEADER_PREFIX.size + head_len > mv.nbytes:
            return None
        header = _parse_header(mv[HEADER_PREFIX.size : HEADER_PREFIX.size + head_len], limits)
        return _job_ref(_message_class(header), header, limits)
    except Exception:  # noqa: BLE001 (what failed the decode may fail here too: then no job can be named)
        return None


def _decode(body: Any, limits: Limits, canonical: bool) -> tuple[Message, int]:
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise WireError("frame body type", "bytes", type(body).__name__)
    mv = memoryview(body).cast("B")  # (n,) bytes; cast raises ValueError if non-contiguous
    n = mv.nbytes
    if n > limits.max_frame_bytes:
        raise WireError("frame length", limits.max_frame_bytes, n)
    if n < HEADER_PREFIX.size:
        raise WireError("frame shorter than its header length field", HEADER_PREFIX.size, n)
    (head_len,) = HEADER_PREFIX.unpack_from(mv, 0)
    if head_len > limits.max_header_bytes:
        raise WireError("header length", limits.max_header_bytes, head_len)
    if HEADER_PREFIX.size + head_len > n:
        raise WireError("header length past end of frame", n - HEADER_PREFIX.size, head_len)
    tensor_start = HEADER_PREFIX.size + head_len
    header = _parse_header(mv[HEADER_PREFIX.size : tensor_start], limits)

    cls = _message_class(header)
    ref = _job_ref(cls, header, limits)
    try:
        return _decode_message(cls, header, body, mv, tensor_start, limits, canonical)
    except WireError as e:
        e.job = ref
        raise
    except _PARSE_ERRORS as e:
        err = WireError("malformed frame", None, f"{type(e).__name__}: {_clip(str(e), 200)}")
        err.job = ref
        raise err from e


def _job_ref(cls: type, header: dict, limits: Limits) -> JobRef | None:
    """The frame's (job_id, epoch, round) if its class has them and each passes its own
    check; None otherwise (a frame naming no valid job cannot be answered per job)."""
    by_name = _by_name(cls)
    values = []
    for name in JobRef._fields:
        f = by_name.get(name)
        if f is None or name not in header:
            return None
        try:
            values.append(kind_of(f).check(f"field '{name}'", header[name], limits))
        except WireError:
            return None
    return JobRef(*values)


def _decode_message(cls: type, header: dict, body: Any, mv: memoryview, tensor_start: int, limits: Limits,
                    canonical: bool) -> tuple[Message, int]:
    n = mv.nbytes
    header_fields, tensor_fields = _fields(cls)
    allowed, specs = _decode_checks(cls)
    for key in header:
        if key not in allowed:
            raise WireError(f"unknown field for '{cls.KIND}'", None, _clip(key))
    pad = header.get("pad", b"")
    if not isinstance(pad, bytes):
        raise WireError("field 'pad' type", "bytes", type(pad).__name__)
    if len(pad) >= _TENSOR_ALIGN:
        raise WireError("field 'pad' length", _TENSOR_ALIGN - 1, len(pad))
    values: dict[str, Any] = {}
    for f in header_fields:
        if f.name not in header:
            raise WireError(f"field '{f.name}' missing")
        values[f.name] = kind_of(f).check(f"field '{f.name}'", header[f.name], limits)

    table = _tensor_table(header, specs, limits, n - tensor_start)
    for f in tensor_fields:
        if f.name not in table and not kind_of(f).optional:
            raise WireError(f"tensor '{f.name}' missing")
    canonical_end = tensor_start + sum(nbytes for _, _, nbytes in table.values())
    values.update(_trailer(() if canonical else _trailer_names(cls), cls, mv[canonical_end:], limits))
    values.update(_tensor_views(body, mv, tensor_start, table))
    msg = cls(**values)
    msg.check(limits)
    return msg, canonical_end


def _trailer(names: tuple[str, ...], cls: type, raw: memoryview, limits: Limits) -> dict[str, Any]:
    """The values of trailer fields `names` from `raw` (all bytes after the tensors)."""
    if not names:
        if raw.nbytes:
            raise WireError("bytes after the tensors", 0, raw.nbytes)
        return {}
    trailer = _parse_header(raw, limits, what="trailer")
    fields = _by_name(cls)
    for key in trailer:
        if key not in names:
            raise WireError(f"unknown trailer field for '{cls.KIND}'", list(names), _clip(key))
    values = {}
    for name in names:
        if name not in trailer:
            raise WireError(f"trailer field '{name}' missing")
        values[name] = kind_of(fields[name]).check(f"field '{name}'", trailer[name], limits)
    return values


def _parse_header(raw: memoryview, limits: Limits, what: str = "header") -> dict:
    def no_ext(code: int, data: bytes) -> None:
        raise WireError(f"{what} msgpack ext type", None, code)

    try:
        header = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=no_ext,
            max_str_len=len(raw),
            max_bin_len=len(raw),
            max_array_len=limits.max_list_len,
            max_map_len=limits.max_list_len,
            max_ext_len=0,
        )
    except WireError:
        raise
    except _PARSE_ERRORS as e:
        raise WireError(f"{what} msgpack", None, f"{type(e).__name__}: {_clip(str(e), 200)}") from e
    # Iterative walk: bounds nesting and rejects any non-plain value, without recursion.
    stack = [(header, 1)]
    while stack:
        obj, depth = stack.pop()
        if isinstance(obj, (dict, list)):
            if depth > limits.max_depth:
                raise WireError(f"{what} nesting depth", limits.max_depth, depth)
            stack.extend((v, depth + 1) for v in (obj.values() if isinstance(obj, dict) else obj))
        elif not isinstance(obj, _PLAIN_LEAVES):
            raise WireError(f"{what} value type", None, type(obj).__name__)
    if not isinstance(header, dict):
        raise WireError(f"{what} type", "map", type(header).__name__)
    return header


def _message_class(header: dict) -> type:
    v = header.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:
        raise WireError("protocol version", PROTOCOL_VERSION, _clip(v))
    kind = header.get("kind")
    cls = REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise WireError("message kind", sorted(REGISTRY), _clip(kind))
    return cls


def _tensor_table(header: dict, specs: dict[str, Tensor], limits: Limits, remaining: int) -> dict[str, tuple[str, list[int], int]]:
    """name -> (dtype name, shape, nbytes), every entry checked; nothing allocated."""
    entries = header.get("tensors")
    if not isinstance(entries, list):
        raise WireError("field 'tensors' type", "list", type(entries).__name__)
    if len(entries) > limits.max_tensors:
        raise WireError("tensor count", limits.max_tensors, len(entries))
    table: dict[str, tuple[str, list[int], int]] = {}
    total_elements = total_bytes = 0
    for i, entry in enumerate(entries):
        if not (isinstance(entry, list) and len(entry) == 4):
            raise WireError(f"tensor entry {i}", "[name, dtype, shape, nbytes]", _clip(repr(entry)))
        name, dtype, shape, nbytes = entry
        if not isinstance(name, str) or name not in specs:
            raise WireError(f"tensor entry {i} name", sorted(specs), _clip(name))
        if name in table:
            raise WireError(f"tensor '{name}' repeated")
        what = f"tensor '{name}'"
        if not isinstance(dtype, str) or dtype not in BY_NAME:
            raise WireError(f"{what} dtype", _DTYPE_NAMES, _clip(dtype))
        if dtype not in specs[name].dtypes:
            raise WireError(f"{what} dtype", sorted(specs[name].dtypes), dtype)
        if not isinstance(shape, list) or len(shape) > MAX_RANK:
            raise WireError(f"{what} rank", MAX_RANK, len(shape) if isinstance(shape, list) else type(shape).__name__)
        for d in shape:
            if type(d) is not int:
                raise WireError(f"{what} dim type", "int", type(d).__name__)
            if not (0 <= d <= limits.max_tensor_elements):
                raise WireError(f"{what} dim", f"[0, {limits.max_tensor_elements}]", d)
        elements = math.prod(shape)
        total_elements += elements
        if total_elements > limits.max_tensor_elements:
            raise WireError("tensor elements", limits.max_tensor_elements, total_elements)
        expected = elements * BY_NAME[dtype].itemsize
        if type(nbytes) is not int or nbytes != expected:
            raise WireError(f"{what} nbytes", expected, _clip(nbytes))
        total_bytes += nbytes
        table[name] = (dtype, shape, nbytes)
    if total_bytes > remaining:
        raise WireError("tensor bytes after header", total_bytes, remaining)
    return table


def _tensor_views(body: Any, mv: memoryview, start: int, table: dict[str, tuple[str, list[int], int]]) -> dict[str, torch.Tensor]:
    """Tensors over the frame's bytes, in table order from `start`. Sizes already checked."""
    if not table:
        return {}
    if mv.nbytes == start:  # every tensor is empty: nothing to view
        return {name: torch.empty(shape, dtype=BY_NAME[dt].torch_dtype) for name, (dt, shape, _) in table.items()}
    if mv.readonly:
        # torch cannot safely view read-only memory: copy the tensor region once.
        base, offset = torch.frombuffer(bytearray(mv[start:]), dtype=torch.uint8), 0
    else:
        base, offset = torch.frombuffer(mv, dtype=torch.uint8), start  # (n,) zero-copy
    out = {}
    for name, (dt, shape, nbytes) in table.items():
        row = BY_NAME[dt]
        seg = base[offset : offset + nbytes]  # (nbytes,)
        offset += nbytes
        if row.torch_dtype is torch.bool and nbytes and int(seg.max()) > 1:
            raise WireError(f"tensor '{name}' values", "0 or 1", int(seg.max()))
        if seg.storage_offset() % row.itemsize or seg.data_ptr() % row.itemsize:
            seg = seg.clone()  # fresh, aligned storage
        out[name] = seg.view(row.torch_dtype).reshape(shape)
    return out
