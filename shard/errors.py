"""The shard package's exception tree: one root, subclassed by cause, with fields."""

from __future__ import annotations

from typing import NamedTuple


class ShardError(Exception):
    """Root of every error raised by the shard package."""


class StoreError(ShardError):
    """A model store cannot be built, opened or read (missing file, digest mismatch...)."""


class UnsupportedModelError(StoreError):
    """The model's family or architecture is not one the stage runtime can run."""

    def __init__(self, what: str, value: object, supported: object) -> None:
        self.what, self.value, self.supported = what, value, supported
        super().__init__(f"unsupported {what}: {value!r} (supported: {supported})")


class DigestMismatchError(StoreError):
    """A file's or tensor's bytes do not hash to the digest the manifest records."""

    def __init__(self, path: str, expected: str, actual: str) -> None:
        self.path, self.expected, self.actual = path, expected, actual
        super().__init__(f"digest mismatch for {path}: manifest says {expected[:16]}…, file has {actual[:16]}…")


class CacheError(ShardError):
    """A KV-cache request cannot be honoured."""


class CacheFullError(CacheError):
    """Admitting a job or positions would exceed the cache's memory bound."""

    def __init__(self, what: str, limit: int, actual: int) -> None:
        self.what, self.limit, self.actual = what, limit, actual
        super().__init__(f"KV cache full: {what} needs {actual} but the limit is {limit}")


class JobRef(NamedTuple):
    """Which job's frame: enough to answer it with a JobError."""

    job_id: str
    epoch: int
    round: int


class WireError(ShardError):
    """A frame from a peer is malformed or breaks a limit. Fields say what, limit, actual;
    `job` names the frame's job when its job_id, epoch and round were themselves valid
    (the decoder sets it), so the receiver can fail that job instead of only dropping it."""

    def __init__(self, what: str, limit: object = None, actual: object = None) -> None:
        self.what, self.limit, self.actual = what, limit, actual
        self.job: JobRef | None = None
        detail = what
        if limit is not None or actual is not None:
            detail += f" (limit {limit}, got {actual})"
        super().__init__(detail)


class PositionError(ShardError):
    """A rotary position past what the model (and so the rotary table) supports."""

    def __init__(self, limit: int, actual: int) -> None:
        self.limit, self.actual = limit, actual
        super().__init__(f"rotary position (limit < {limit}, the model's max positions, got {actual})")
