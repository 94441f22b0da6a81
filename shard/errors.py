"""The shard package's exception tree: one root, subclassed by cause, with fields."""

from __future__ import annotations

from typing import NamedTuple


class ShardError(Exception):
    """Root of every error raised by the shard package."""


class DeviceError(ShardError):
    """The torch device a node was told to use is not on this machine. Fields: device."""

    def __init__(self, device: str, reason: str) -> None:
        self.device = device
        super().__init__(f"--device {device}: {reason}")


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


class TransportError(ShardError):
    """A connection or stream failed. Fields: what happened, and the peer if known."""

    def __init__(self, what: str, peer_id: str | None = None) -> None:
        self.what, self.peer_id = what, peer_id
        super().__init__(what if peer_id is None else f"{what} (peer {peer_id})")


class DialError(TransportError):
    """Could not connect to, or open a stream with, a peer. Fields: addr, reason."""

    def __init__(self, addr: str, reason: str, peer_id: str | None = None) -> None:
        self.addr, self.reason = addr, reason
        super().__init__(f"cannot reach {addr}: {reason}", peer_id)


class FrameTimeoutError(TransportError):
    """A frame's body did not arrive within its deadline after its length prefix did."""

    def __init__(self, peer_id: str, received_bytes: int, expected_bytes: int, deadline_s: float) -> None:
        self.received_bytes, self.expected_bytes, self.deadline_s = received_bytes, expected_bytes, deadline_s
        super().__init__(f"frame body too slow: {received_bytes} of {expected_bytes} bytes within the "
                         f"{deadline_s:.1f} s deadline", peer_id)


class StreamClosedError(TransportError):
    """The peer closed or reset the stream. `received_bytes` of `expected_bytes` of the
    frame (prefix included) had arrived; 0 of 4 means it closed at a frame boundary."""

    def __init__(self, peer_id: str, reason: str, received_bytes: int, expected_bytes: int) -> None:
        self.reason, self.received_bytes, self.expected_bytes = reason, received_bytes, expected_bytes
        where = (
            "at a frame boundary"
            if received_bytes == 0
            else f"mid-frame after {received_bytes} of {expected_bytes} bytes"
        )
        super().__init__(f"stream {reason} {where}", peer_id)


def sole_error(exc: BaseException) -> BaseException:
    """What ended a task tree: the one exception inside nested ExceptionGroups (trio and
    py-libp2p wrap what a child raised once per nursery), else `exc` itself."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for inner in e.exceptions:
                walk(inner)
        else:
            leaves.append(e)

    walk(exc)
    return leaves[0] if len(leaves) == 1 else exc
