"""Link emulation: a decorator around any frame stream that adds WAN latency, upload
bandwidth and jitter to what this end sends, so benchmarks run the real code path.

Model (sender side only; wrap both ends to shape both directions):
- The node's uplink is a FIFO pipe of `upload_bytes_per_s`. A frame of n bytes (body plus
  the 4-byte prefix) starts serialising when the previous frame on the same `Uplink` has
  finished, and occupies it for n / upload_bytes_per_s seconds. Links that share an
  `Uplink` (one node sending to its successor and to the coordinator) contend for it.
- The frame is delivered `one_way_latency_s + U(0, jitter_s)` after its last byte left,
  but never before an earlier frame of the same link (jitter does not reorder).
- `send_frame` returns once the frame's last byte has left the uplink: it blocks for
  serialisation (as a socket with a small send buffer does), never for latency, so
  back-to-back frames pipeline: the second arrives one latency plus two serialisations
  after the first was sent, not two latencies.
A background task per link (`serve`) holds frames until their delivery time and hands
them to the inner stream, so one link's delays never hold up another stream.

This module does not know about libp2p, peers or what a frame contains; it does not shape
what this end receives, and the inner stream's own (loopback) time adds to every figure.
"""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import trio

from shard.transport import FRAME_PREFIX, FrameEndpoint, StreamClosedError, TransportError


class Uplink:
    """One node's upload pipe: when it is free again, in trio time (seconds)."""

    def __init__(self, upload_bytes_per_s: float) -> None:
        if not upload_bytes_per_s > 0:
            raise ValueError(f"upload_bytes_per_s must be > 0 (math.inf for unlimited), got {upload_bytes_per_s}")
        self.upload_bytes_per_s = upload_bytes_per_s
        self._free_at_s = -math.inf

    def reserve(self, nbytes: int, now_s: float) -> float:
        """Queue `nbytes` behind what is already on the pipe; return when its last byte leaves."""
        start_s = max(now_s, self._free_at_s)
        self._free_at_s = start_s + nbytes / self.upload_bytes_per_s
        return self._free_at_s


def link_settings(latency_ms: float, upload_mbps: float, jitter_ms: float) -> dict[str, float] | None:
    """EmulatedLink keyword arguments from the CLI's units (ms, Mbit/s; 0 = not limited),
    or None when nothing is emulated. The one place those units are converted."""
    if not (latency_ms or upload_mbps or jitter_ms):
        return None
    return dict(one_way_latency_s=latency_ms / 1e3,
                upload_bytes_per_s=upload_mbps * 1e6 / 8 if upload_mbps else math.inf,
                jitter_s=jitter_ms / 1e3)


class EmulatedLink:
    """A FrameEndpoint whose sends see latency, upload bandwidth and jitter.

    Run `serve` in a nursery (or use `open_emulated_link`) before sending.

    Error handling: if the inner stream fails while delivering, the pump stops and the next
    `send_frame` raises that error; frames still held are dropped, as on a dead link.
    Resource handling: `aclose` waits until every held frame is delivered, then closes the
    inner stream.
    """

    def __init__(
        self,
        inner: FrameEndpoint,
        one_way_latency_s: float,
        upload_bytes_per_s: float,
        jitter_s: float = 0.0,
        seed: int = 0,
        *,
        uplink: Uplink | None = None,
    ) -> None:
        if one_way_latency_s < 0 or jitter_s < 0:
            raise ValueError(f"latency and jitter must be >= 0, got {one_way_latency_s} and {jitter_s}")
        self.inner = inner
        self.one_way_latency_s = one_way_latency_s
        self.jitter_s = jitter_s
        self.uplink = uplink if uplink is not None else Uplink(upload_bytes_per_s)
        if uplink is not None and uplink.upload_bytes_per_s != upload_bytes_per_s:
            raise ValueError("a shared uplink's rate and upload_bytes_per_s disagree")
        self._rng = random.Random(seed)
        self._last_delivery_s = -math.inf
        # Unbounded in frames, but send_frame blocks for serialisation, so at most
        # one latency's worth of frames (a bandwidth-delay product) is ever held.
        self._held_send, self._held_recv = trio.open_memory_channel[tuple[float, bytes]](math.inf)
        self._failure: TransportError | None = None
        self._serving = False
        self._drained = trio.Event()

    @property
    def remote_peer_id(self) -> str:
        return self.inner.remote_peer_id

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Deliver held frames at their times; returns after `aclose` once all are delivered."""
        self._serving = True
        task_status.started()
        try:
            async for deliver_at_s, body in self._held_recv:
                await trio.sleep_until(deliver_at_s)  # times are non-decreasing: FIFO is exact
                try:
                    await self.inner.send_frame(body)
                except TransportError as exc:
                    self._failure = exc
                    return
        finally:
            self._drained.set()

    async def send_frame(self, body: bytes) -> None:
        """Hand `body` to the uplink; return when its last byte has left (not when it arrives)."""
        if self._failure is not None:
            raise self._failure
        if not self._serving:
            raise RuntimeError("EmulatedLink.send_frame before serve() started: frames would never be delivered")
        now_s = trio.current_time()
        sent_s = self.uplink.reserve(len(body) + FRAME_PREFIX.size, now_s)
        jitter_s = self._rng.uniform(0.0, self.jitter_s) if self.jitter_s else 0.0
        deliver_at_s = max(sent_s + self.one_way_latency_s + jitter_s, self._last_delivery_s)
        self._last_delivery_s = deliver_at_s
        try:
            self._held_send.send_nowait((deliver_at_s, bytes(body)))
        except trio.ClosedResourceError as exc:
            raise StreamClosedError(self.remote_peer_id, "closed locally", 0, 0) from exc
        await trio.sleep_until(sent_s)

    async def send_frames(self, bodies: Sequence[bytes]) -> None:
        """Each frame as send_frame does: the emulated uplink times every frame on its own."""
        for body in bodies:
            await self.send_frame(body)

    async def recv_frame(self, max_frame_bytes: int) -> bytes:
        return await self.inner.recv_frame(max_frame_bytes)

    async def aclose(self) -> None:
        await self._held_send.aclose()
        if self._serving:
            await self._drained.wait()
        await self.inner.aclose()


@asynccontextmanager
async def open_emulated_link(
    inner: FrameEndpoint,
    one_way_latency_s: float,
    upload_bytes_per_s: float,
    jitter_s: float = 0.0,
    seed: int = 0,
    *,
    uplink: Uplink | None = None,
) -> AsyncIterator[EmulatedLink]:
    """An EmulatedLink with its delivery task running; leaving the block flushes and closes it."""
    link = EmulatedLink(inner, one_way_latency_s, upload_bytes_per_s, jitter_s, seed, uplink=uplink)
    async with trio.open_nursery() as nursery:
        await nursery.start(link.serve)
        yield link
        await link.aclose()
