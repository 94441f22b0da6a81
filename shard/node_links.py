"""A node's links: the emulated uplink every stream it sends on crosses, and the probes
that measure its round trips, upload and download.

One `Uplink` per node: the ring successor edge, the control stream and probe echoes all
queue on it, as they would on a real upload. The coordinator is probed with sized Pings
on the control stream (round trip, then a payload each way); peers the coordinator names
are probed with echoes on their own stream (`shard.linkprobe`). Probes cross the same
emulation as ring frames, so they measure the links frames will see. A probe that fails,
whatever the reason, costs its own entry of the report, never the others or the session.
This module does not know about stages, frames' contents, assignments or the ring.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import trio

from shard.errors import WireError
from shard.linkemu import EmulatedLink, Uplink, link_settings, open_emulated_link
from shard.linkprobe import PROBE_PROTOCOL, measure_rtt, serve_probe
from shard.transport import FramedStream, Host, TransportError
from shard.wire.messages import LinkReport, Ping, ProbePeers

log = logging.getLogger("shard.node")

# Anyone may probe a node. A prober uses one stream at a time (shard.node_links.rtt_to_peer);
# two cover a retry overlapping a stream not yet closed.
MAX_PROBE_STREAMS_PER_PEER = 2

T = TypeVar("T")


@dataclass
class NodeLinks:
    """`send_control(msg)` sends on the control stream; `nursery` (set once the node
    serves) runs the emulated links' delivery tasks."""

    host: Host
    send_control: Callable[[object], Awaitable[None]]
    latency_ms: float = 0.0
    upload_mbps: float = 0.0
    jitter_ms: float = 0.0
    probe_timeout_s: float = 30.0
    nursery: trio.Nursery | None = None
    _uplink: Uplink | None = None
    _pong_waiters: dict[int, trio.Event] = field(default_factory=dict)
    _nonces: itertools.count = field(default_factory=lambda: itertools.count(1))
    _probing: dict[str, int] = field(default_factory=dict)  # peer id -> its open probe streams

    def _settings(self) -> dict | None:
        """EmulatedLink arguments with this node's one uplink, or None when not emulated."""
        settings = link_settings(self.latency_ms, self.upload_mbps, self.jitter_ms)
        if settings is None:
            return None
        if self._uplink is None:
            self._uplink = Uplink(settings["upload_bytes_per_s"])
        return {**settings, "uplink": self._uplink}

    async def emulate(self, stream):
        """An outgoing edge (ring successor, control stream) behind the emulation, its
        delivery task in `nursery`; `stream` itself when nothing is emulated."""
        settings = self._settings()
        if settings is None:
            return stream
        link = EmulatedLink(stream, **settings)
        await self.nursery.start(link.serve)
        return link

    @contextlib.asynccontextmanager
    async def open_link(self, stream: FramedStream) -> AsyncIterator:
        """`stream` behind the emulation (if any) for the block; closed after."""
        settings = self._settings()
        if settings is None:
            try:
                yield stream
            finally:
                await stream.aclose()
            return
        async with open_emulated_link(stream, **settings) as link:
            yield link

    def pong(self, nonce: int) -> None:
        """A Pong arrived on the control stream."""
        waiter = self._pong_waiters.pop(nonce, None)
        if waiter is not None:
            waiter.set()

    async def ping_coordinator(self, payload_bytes: int, reply_bytes: int) -> float:
        """Seconds from handing a Ping to the (emulated) uplink to its Pong's arrival."""
        nonce = next(self._nonces)
        arrived = self._pong_waiters[nonce] = trio.Event()
        start_s = trio.current_time()
        try:
            with trio.fail_after(self.probe_timeout_s):
                await self.send_control(Ping(nonce=nonce, sent_ns=time.time_ns(), payload=bytes(payload_bytes),
                                             reply_bytes=reply_bytes))
                await arrived.wait()
        finally:
            self._pong_waiters.pop(nonce, None)
        return trio.current_time() - start_s

    async def probe_coordinator(self, nbytes: int) -> tuple[float, float, float]:
        """(round trip s, upload bytes/s, download bytes/s) to the coordinator. A sized Ping
        costs one round trip plus its serialisation on our uplink; a sized Pong, one round
        trip plus its serialisation on the way down. The quickest of three empty pings is
        the round trip subtracted (other traffic only ever adds time)."""
        rtt_s = min([await self.ping_coordinator(0, 0) for _ in range(3)])
        up_s = await self.ping_coordinator(nbytes, 0)
        down_s = await self.ping_coordinator(0, nbytes)
        # Loopback noise can leave a sized ping no slower than an empty one: 0.1 ms floor.
        return rtt_s, nbytes / max(up_s - rtt_s, 1e-4), nbytes / max(down_s - rtt_s, 1e-4)

    async def report(self, req: ProbePeers, coordinator_id: str) -> None:
        """Measure what the coordinator asked for and send a LinkReport. Never raises (but
        Cancelled): each entry is probed on its own, and one that fails for any reason (a
        malformed address, an unreachable peer, a bug in its probe) is left out of the
        report as unreachable, with a log line, costing neither the other entries nor the
        node's session, which runs this as one of its tasks."""
        rtt_ms: dict[str, float] = {}
        upload = download = None
        for peer, addrs in sorted(req.peers.items()):
            rtt_s = await _or_none(self.rtt_to_peer(peer, addrs), f"no round trip to {peer}")
            if rtt_s is not None:
                rtt_ms[peer] = rtt_s * 1e3
        if req.bandwidth_bytes:
            probed = await _or_none(self.probe_coordinator(req.bandwidth_bytes), "no bandwidth probe to the coordinator")
            if probed is not None:
                rtt_ms[coordinator_id], upload, download = probed[0] * 1e3, probed[1], probed[2]
        try:
            await self.send_control(LinkReport(peer_id=self.host.peer_id, rtt_ms=rtt_ms, upload_bytes_per_s=upload,
                                               download_bytes_per_s=download))
        except Exception as exc:  # noqa: BLE001 (a lost control stream is the session's to notice, on its reads)
            log.warning("link report failed: %s: %s", type(exc).__name__, exc)

    async def rtt_to_peer(self, peer: str, addrs: tuple[str, ...]) -> float | None:
        """Quickest of three echoes over our emulated uplink and the peer's; None if unreachable."""
        try:
            with trio.fail_after(self.probe_timeout_s):
                for addr in addrs:
                    try:
                        await self.host.connect(addr, probing=True)  # a hole punch the NATs defeat is not waited for
                        break
                    except TransportError as exc:
                        log.info("could not dial %s at %s: %s", peer, addr, exc)
                async with self.open_link(await self.host.open_stream(peer, PROBE_PROTOCOL)) as link:
                    return (await measure_rtt(link, 3)).min_s
        except (TransportError, WireError, trio.TooSlowError) as exc:
            log.info("no round trip to %s: %s", peer, exc)
            return None

    async def on_probe_stream(self, stream: FramedStream) -> None:
        """Echo a peer's probes; the echoes cross our own emulated uplink, as ring frames would.
        A stream lives at most twice probe_timeout_s (a probe is a few round trips within the
        prober's own probe_timeout_s), and a peer's streams past MAX_PROBE_STREAMS_PER_PEER
        are reset unread."""
        peer = stream.remote_peer_id
        if self._probing.get(peer, 0) >= MAX_PROBE_STREAMS_PER_PEER:
            log.info("reset a probe stream from %s: it holds %d already", peer, MAX_PROBE_STREAMS_PER_PEER)
            try:
                await stream.reset()
            except Exception:  # already gone
                pass
            return
        self._probing[peer] = self._probing.get(peer, 0) + 1
        try:
            with trio.move_on_after(2 * self.probe_timeout_s):
                async with self.open_link(stream) as link:
                    await serve_probe(link)
        finally:
            self._probing[peer] -= 1
            if not self._probing[peer]:
                del self._probing[peer]


async def _or_none(probe: Awaitable[T], what: str) -> T | None:
    """`probe`'s result, or None when it raises, logged in one line as `what` and the fault:
    a transport failure or timeout is the link's; anything else (a malformed entry, a bug)
    that one probe's, so it fails alone."""
    try:
        return await probe
    except (TransportError, WireError, trio.TooSlowError) as exc:
        log.info("%s: %s", what, exc)
    except Exception as exc:  # noqa: BLE001 (see above: never the other probes' or the session's)
        log.warning("%s: %s: %s", what, type(exc).__name__, exc)
    return None
