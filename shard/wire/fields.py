"""Field kinds of wire messages: each checks a value decoded from a peer and packs ours.

A message field is declared with `spec(kind)`; the codec finds the kind in the field's
metadata. `check` takes what msgpack produced (a peer's, so anything) and returns the
value the dataclass holds, or raises WireError; `pack` turns our value into msgpack
types. Knows nothing of frames, tensors' bytes or of which message uses which field.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from receipts.schema import JOB_ID_PATTERN, MAX_JOB_ID_CHARS
from shard.errors import WireError
from shard.wire.limits import Limits

# msgpack carries ints in [-2^63, 2^64); every int field here is a non-negative i64.
I64_MAX = (1 << 63) - 1


def _typename(value: object) -> str:
    return type(value).__name__


def _need(what: str, value: object, types: type | tuple[type, ...], expected: str) -> None:
    # bool is a subclass of int: a peer's True must not pass as 1.
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise WireError(f"{what} type", expected, "bool")
    if not isinstance(value, types):
        raise WireError(f"{what} type", expected, _typename(value))


@dataclass(frozen=True)
class Int:
    lo: int = 0
    hi: int = I64_MAX

    def check(self, what: str, value: Any, limits: Limits) -> int:
        _need(what, value, int, "int")
        if not (self.lo <= value <= self.hi):
            raise WireError(f"{what} range", f"[{self.lo}, {self.hi}]", value)
        return value

    def pack(self, value: Any) -> Any:
        return value  # no coercion: check() must see a bool or a numpy int as the bug it is


@dataclass(frozen=True)
class Float:
    """A finite float >= lo (rates, durations). Ints are accepted and widened."""

    lo: float = 0.0

    def check(self, what: str, value: Any, limits: Limits) -> float:
        _need(what, value, (int, float), "float")
        value = float(value)
        if not math.isfinite(value) or value < self.lo:
            raise WireError(f"{what} range", f"finite >= {self.lo}", value)
        return value

    def pack(self, value: Any) -> Any:
        return float(value) if type(value) is int else value  # widen ints only; check() rejects the rest


@dataclass(frozen=True)
class Str:
    """UTF-8 text of at most max_bytes encoded bytes, optionally one of `choices`, or
    matching `pattern` whole (`pattern_text` says what it allows, for the error)."""

    max_bytes: int
    choices: tuple[str, ...] | None = None
    pattern: re.Pattern | None = None
    pattern_text: str = ""

    def check(self, what: str, value: Any, limits: Limits) -> str:
        _need(what, value, str, "str")
        n = len(value.encode("utf-8"))
        if n > self.max_bytes:
            raise WireError(f"{what} length", self.max_bytes, n)
        if self.choices is not None and value not in self.choices:
            raise WireError(f"{what} value", list(self.choices), value)
        if self.pattern is not None and not self.pattern.fullmatch(value):
            raise WireError(f"{what} value", self.pattern_text, value[:64])
        return value

    def pack(self, value: Any) -> str:
        return value


@dataclass(frozen=True)
class Bytes:
    max_bytes: int
    min_bytes: int = 0

    def check(self, what: str, value: Any, limits: Limits) -> bytes:
        _need(what, value, bytes, "bytes")
        if not (self.min_bytes <= len(value) <= self.max_bytes):
            limit = self.max_bytes if self.min_bytes == 0 else f"{self.min_bytes}..{self.max_bytes}"
            raise WireError(f"{what} length", limit, len(value))
        return value

    def pack(self, value: Any) -> Any:
        return bytes(value) if isinstance(value, (bytearray, memoryview)) else value


@dataclass(frozen=True)
class OptionalOf:
    """None or a value of `inner`."""

    inner: Any

    def check(self, what: str, value: Any, limits: Limits) -> Any:
        return None if value is None else self.inner.check(what, value, limits)

    def pack(self, value: Any) -> Any:
        return None if value is None else self.inner.pack(value)


@dataclass(frozen=True)
class ListOf:
    """A list of `item`, at most max_items long (None = limits.max_list_len). Held as a tuple."""

    item: Any
    max_items: int | None = None

    def check(self, what: str, value: Any, limits: Limits) -> tuple:
        _need(what, value, list, "list")
        cap = limits.max_list_len if self.max_items is None else min(self.max_items, limits.max_list_len)
        if len(value) > cap:
            raise WireError(f"{what} length", cap, len(value))
        return tuple(self.item.check(f"{what}[{i}]", v, limits) for i, v in enumerate(value))

    def pack(self, value: Any) -> list:
        return [self.item.pack(v) for v in value]


@dataclass(frozen=True)
class MapOf:
    """A str -> value map of at most limits.max_list_len entries."""

    key: Str
    value: Any

    def check(self, what: str, value: Any, limits: Limits) -> dict:
        _need(what, value, dict, "map")
        if len(value) > limits.max_list_len:
            raise WireError(f"{what} length", limits.max_list_len, len(value))
        return {self.key.check(f"{what} key", k, limits): self.value.check(f"{what}[{k!r}]", v, limits) for k, v in value.items()}

    def pack(self, value: Any) -> dict:
        return {self.key.pack(k): self.value.pack(v) for k, v in value.items()}


@dataclass(frozen=True)
class Tensor:
    """A tensor field: travels in the tensor table, not the header. `dtypes` are wire names."""

    dtypes: frozenset[str]
    optional: bool = False


def spec(kind: Any, **field_kwargs: Any) -> Any:
    """Declare a message field of `kind` (a dataclasses.field carrying it as metadata)."""
    return dataclasses.field(metadata={"wire": kind}, **field_kwargs)


def kind_of(f: dataclasses.Field) -> Any:
    return f.metadata["wire"]


# Job ids name receipt bundles' files and nonces key receipts: the wire holds them to the
# receipt schema's own rules, so a frame a stage accepts is one it can sign. Every message
# naming a job uses this one field.
JOB_ID = Str(MAX_JOB_ID_CHARS, pattern=JOB_ID_PATTERN,
             pattern_text=f"1..{MAX_JOB_ID_CHARS} chars of [A-Za-z0-9._-] starting alphanumeric")
