"""Link probes a node runs before registering: round-trip time and upload bandwidth to a peer.

Probe frames start with a one-byte kind: b"P" ping (echoed whole), b"D" data (counted,
not answered), b"S" sync (answered with b"S" + the 8-byte big-endian count of data body
bytes received since the previous sync). Times come from trio's clock, so probes over an
EmulatedLink measure the emulated link, and tests can run on a mock clock.

This module does not know where the numbers go (ring's link model) or how often to probe.
"""

from __future__ import annotations

import statistics
import struct
from dataclasses import dataclass

import trio

from shard.errors import WireError
from shard.transport import FrameEndpoint, StreamClosedError

PROBE_PROTOCOL = "/shard/probe/1.0.0"
PROBE_MAX_FRAME_BYTES = 1 << 20  # the probe server's bound; data chunks must fit in it
DEFAULT_CHUNK_BYTES = 256 * 1024
_PING, _DATA, _SYNC = b"P", b"D", b"S"
_COUNT = struct.Struct(">Q")


@dataclass(frozen=True)
class RttMeasurement:
    samples_s: tuple[float, ...]

    @property
    def min_s(self) -> float:
        return min(self.samples_s)

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)


@dataclass(frozen=True)
class BandwidthMeasurement:
    nbytes: int
    elapsed_s: float  # first byte handed over .. sync answer received
    rtt_s: float  # subtracted from elapsed_s: the sync's own round trip
    bytes_per_s: float


async def serve_probe(stream: FrameEndpoint, max_frame_bytes: int = PROBE_MAX_FRAME_BYTES) -> None:
    """Answer probe frames on `stream` until the peer closes it.

    Error handling: WireError for an unknown kind or an over-long frame (the stream
    handler wrapper then resets the stream); returns when the peer closes.
    """
    received = 0
    while True:
        try:
            frame = await stream.recv_frame(max_frame_bytes)
        except StreamClosedError:
            return
        kind = frame[:1]
        if kind == _PING:
            await stream.send_frame(frame)
        elif kind == _DATA:
            received += len(frame) - 1
        elif kind == _SYNC:
            await stream.send_frame(_SYNC + _COUNT.pack(received))
            received = 0
        else:
            raise WireError(f"probe frame kind {kind!r}", "one of b'P', b'D', b'S'", kind)


async def measure_rtt(stream: FrameEndpoint, n: int, payload_bytes: int = 32) -> RttMeasurement:
    """Time `n` sequential small echoes to a `serve_probe` peer."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ping = _PING + bytes(payload_bytes)
    samples = []
    for _ in range(n):
        start_s = trio.current_time()
        await stream.send_frame(ping)
        echoed = await stream.recv_frame(len(ping))
        samples.append(trio.current_time() - start_s)
        if echoed != ping:
            raise WireError("probe echo differs from the ping", len(ping), len(echoed))
    return RttMeasurement(tuple(samples))


async def measure_bandwidth(
    stream: FrameEndpoint, nbytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> BandwidthMeasurement:
    """Push `nbytes` to a `serve_probe` peer and time it: our upload toward that peer.

    elapsed = serialisation + one round trip (last byte out, sync answer back), so the
    round trip measured just before is subtracted.
    """
    if nbytes < 1 or not 1 <= chunk_bytes < PROBE_MAX_FRAME_BYTES:
        raise ValueError(f"need nbytes >= 1 and 1 <= chunk_bytes < {PROBE_MAX_FRAME_BYTES}")
    rtt_s = (await measure_rtt(stream, 3)).min_s
    chunk = _DATA + bytes(chunk_bytes)
    start_s = trio.current_time()
    left = nbytes
    while left > 0:
        body = chunk if left >= chunk_bytes else _DATA + bytes(left)
        await stream.send_frame(body)
        left -= len(body) - 1
    await stream.send_frame(_SYNC)
    answer = await stream.recv_frame(1 + _COUNT.size)
    elapsed_s = trio.current_time() - start_s
    if answer[:1] != _SYNC or len(answer) != 1 + _COUNT.size:
        raise WireError("probe sync answer", 1 + _COUNT.size, len(answer))
    (counted,) = _COUNT.unpack(answer[1:])
    if counted != nbytes:
        raise WireError("probe bytes counted by the peer", nbytes, counted)
    transfer_s = elapsed_s - rtt_s if elapsed_s > rtt_s else elapsed_s
    return BandwidthMeasurement(nbytes, elapsed_s, rtt_s, nbytes / transfer_s)
