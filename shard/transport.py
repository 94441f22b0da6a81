"""The node's libp2p host (TCP + Noise + yamux) and length-prefixed frames over its streams.

A frame is a 4-byte big-endian length followed by that many body bytes. The receiver
checks the length against the caller's bound before reading (or allocating) the body.
Every stream's remote peer id is the one Noise authenticated, which is how a stage knows
its predecessor and the coordinator knows its tail.

This module does not know what is inside a frame (the wire codec does), who should talk
to whom (the ring epoch does), what a link costs (linkemu emulates, linkprobe measures) or
how a host behind a NAT is reached (shard.relay does: circuits, hole punching, AutoNAT).

py-libp2p 0.8.1 quirks handled here:
- `new_host` offers Noise, TLS, SECIO and plaintext by default; we pass exactly Noise
  (`sec_opt`) and exactly yamux (`muxer_opt`), so nothing weaker can be negotiated.
- A handler that raises propagates into the connection's nursery and tears the whole
  connection down (or the host); `set_handler` wraps handlers so any Exception resets only
  that stream (a ShardError is the peer's fault and logged as such; anything else is ours
  and logged with its traceback).
- The swarm's inbound connection slots are never released (`shard.inbound_conns`).
- Yamux buffers whatever a peer sends past a stream's window (`shard.yamux_window`).
- `host.run()` ending leaves connections open; wildcards are advertised (`shard.addresses`).
- `host.connect` records the peer's addrs with a 120 s TTL; we keep our own copy of
  every address dialled so `open_stream(peer_id)` can redial after it expires.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import INetStream
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.network.stream.exceptions import StreamEOF, StreamReset
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import InvalidAddrError, info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

# The transport's errors live with the package's others; importable from here too.
from shard.errors import DialError, FrameTimeoutError, ShardError, StreamClosedError, TransportError, WireError
from shard.addresses import advertised
from shard.inbound_conns import release_slots_on_close
from shard.relay import Reach, ReachConfig, is_circuit
from shard.yamux_window import batch_window_updates, bound_stream_buffers
from shard.wire.limits import FRAME_PREFIX  # ">I": body length, big-endian uint32; torch-free home

log = logging.getLogger(__name__)

MAX_FRAME_BYTES_LIMIT = 2**32 - 1  # the most a ">I" prefix can announce
READ_AHEAD_BYTES = 64 << 10  # the least a frame read asks yamux for (FramedStream._read_exactly)
SECURITY_PROTOCOL = str(NOISE_PROTOCOL_ID)  # "/noise"
MUXER_PROTOCOL = str(YAMUX_PROTOCOL_ID)  # "/yamux/1.0.0"


@dataclass(frozen=True)
class TransportConfig:
    """How a host listens and how long it waits for peers; the only home of these defaults."""

    listen_multiaddr: str = "/ip4/127.0.0.1/tcp/0"
    dial_timeout_s: float = 10.0  # TCP connect + Noise + yamux + stream protocol select
    negotiate_timeout_s: int = 10  # py-libp2p takes whole seconds for multistream-select


@dataclass(frozen=True)
class BodyDeadline:
    """How long a frame's body may take once its length prefix arrived: `base_s` plus its
    length at `min_bytes_per_s`. A sender slower than that (a trickle that would hold the
    stream and its half-read frame forever) has the stream reset. 1 Mbit/s: below any
    uplink the cost model would seat a stage on."""

    base_s: float = 30.0
    min_bytes_per_s: float = 128 * 1024

    def seconds(self, nbytes: int) -> float:
        return self.base_s + nbytes / self.min_bytes_per_s


class FrameEndpoint(Protocol):
    """What every frame stream offers: the real one, the in-memory one, the emulated link."""

    @property
    def remote_peer_id(self) -> str: ...

    async def send_frame(self, body: bytes) -> None: ...

    async def send_frames(self, bodies: Sequence[bytes]) -> None: ...  # in order, as if sent one by one

    async def recv_frame(self, max_frame_bytes: int) -> bytes: ...

    async def aclose(self) -> None: ...


def check_frame_length(length: int, max_frame_bytes: int) -> None:
    """Raise WireError("frame length", limit, actual) if a frame breaks the bound."""
    if length > max_frame_bytes:
        raise WireError("frame length", max_frame_bytes, length)


# Errors a libp2p stream or the trio socket under it raise when the peer goes away.
_STREAM_GONE = (BaseLibp2pError, trio.BrokenResourceError, trio.ClosedResourceError)


def _gone_reason(exc: BaseException) -> str:
    if isinstance(exc, StreamEOF):
        return "closed"
    if isinstance(exc, StreamReset):
        return "reset"
    return f"failed ({type(exc).__name__}: {exc})"


class FramedStream:
    """Length-prefixed frames over one libp2p stream; long-lived, in order, one writer at a time.

    Error handling: `recv_frame` raises WireError for an over-long frame (before reading its
    body) and StreamClosedError when the peer closes or resets; `send_frame` raises
    StreamClosedError if the stream is gone. Neither swallows trio.Cancelled.

    Resource handling: `aclose` half-closes (sends EOF, the peer reads what was sent);
    `reset` abandons the stream at once. Usable as `async with`.
    """

    def __init__(self, stream: INetStream) -> None:
        self._stream = stream
        self._send_lock = trio.Lock()  # concurrent senders would interleave partial writes
        self._recv_lock = trio.Lock()
        self._ahead, self._ahead_at = b"", 0  # bytes read past the last frame asked for, from _ahead_at
        self._remote_peer_id = _authenticated_peer(stream)

    @property
    def remote_peer_id(self) -> str:
        """The peer id the Noise handshake proved (its static key signed by this identity)."""
        return self._remote_peer_id

    @property
    def remote_ip(self) -> str | None:
        """The IP this stream's connection came from, as this host sees it (None: unknown)."""
        return (self._stream.get_remote_address() or (None,))[0]

    @property
    def protocol_id(self) -> str:
        return str(self._stream.get_protocol())

    @property
    def security_protocol(self) -> str | None:
        """The secure channel the connection negotiated ("/noise")."""
        conn = getattr(self._stream, "swarm_conn", None)
        return None if conn is None else conn.get_negotiated_security_protocol()

    @property
    def muxer_protocol(self) -> str | None:
        """The stream multiplexer the connection negotiated ("/yamux/1.0.0")."""
        conn = getattr(self._stream, "swarm_conn", None)
        return None if conn is None else conn.get_negotiated_muxer_protocol()

    async def send_frame(self, body: bytes) -> None:
        """Write one frame: ">I" length prefix + body, as a single write."""
        await self.send_frames((body,))

    async def send_frames(self, bodies: Sequence[bytes]) -> None:
        """Write frames back to back, each ">I" length prefix + body, as a single write: one
        yamux frame, noise message and send call (each ~0.1 ms of a stage's trio thread) for a
        forward's outputs instead of one per frame; the reader sees the same bytes."""
        for body in bodies:
            check_frame_length(len(body), MAX_FRAME_BYTES_LIMIT)
        data = b"".join(part for body in bodies for part in (FRAME_PREFIX.pack(len(body)), body))
        async with self._send_lock:
            try:
                await self._stream.write(data)
            except _STREAM_GONE as exc:
                raise StreamClosedError(self._remote_peer_id, _gone_reason(exc), 0, 0) from exc

    async def recv_frame(self, max_frame_bytes: int, deadline: BodyDeadline | None = None) -> bytes:
        """Read one frame's body; its announced length is checked before the body is read.
        With `deadline`, the body must follow its prefix within deadline.seconds(length),
        else FrameTimeoutError (the stream is then out of sync: reset it)."""
        async with self._recv_lock:
            prefix = await self._read_exactly(FRAME_PREFIX.size, 0, FRAME_PREFIX.size)
            (length,) = FRAME_PREFIX.unpack(prefix)
            check_frame_length(length, max_frame_bytes)
            total = FRAME_PREFIX.size + length
            if deadline is None:
                return await self._read_exactly(length, FRAME_PREFIX.size, total)
            got: list[int] = [0]
            with trio.move_on_after(deadline.seconds(length)):
                return await self._read_exactly(length, FRAME_PREFIX.size, total, got)
            raise FrameTimeoutError(self._remote_peer_id, FRAME_PREFIX.size + got[0], total, deadline.seconds(length))

    async def _read_exactly(self, n: int, already: int, total: int, progress: list[int] | None = None) -> bytes:
        # yamux returns whatever is buffered (up to n), so a frame comes in several reads; each
        # asks for READ_AHEAD_BYTES at least: a small frame's prefix read takes its body and the
        # frames written with it too (one yamux read for them all, not two or more a frame).
        # `progress[0]`: bytes read so far, for the caller's error if a deadline cuts this off.
        first = self._ahead[self._ahead_at:self._ahead_at + n]  # read ahead before
        self._ahead_at += len(first)
        chunks, got = [first] if first else [], len(first)
        while got < n:
            try:
                chunk = await self._stream.read(max(n - got, READ_AHEAD_BYTES))
            except _STREAM_GONE as exc:
                raise StreamClosedError(self._remote_peer_id, _gone_reason(exc), already + got, total) from exc
            if not chunk:
                raise StreamClosedError(self._remote_peer_id, "closed", already + got, total)
            if len(chunk) > n - got:
                self._ahead, self._ahead_at, chunk = chunk, n - got, chunk[:n - got]
            chunks.append(chunk)
            got += len(chunk)
            if progress is not None:
                progress[0] = got
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def aclose(self) -> None:
        try:
            await self._stream.close()
        except _STREAM_GONE:
            pass  # already gone: closing is idempotent

    async def reset(self) -> None:
        await self._stream.reset()

    async def __aenter__(self) -> FramedStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def _authenticated_peer(stream: INetStream) -> str:
    # The Noise session's remote peer is derived from the identity key that signed the
    # handshake payload; yamux and the swarm only copy it.
    secured = getattr(stream.muxed_conn, "secured_conn", None)
    if secured is None:
        raise TransportError("stream has no secure session; cannot authenticate the peer")
    return secured.get_remote_peer().to_base58()


StreamHandler = Callable[[FramedStream], Awaitable[None]]


class Host:
    """A running libp2p host. Made by `open_host`; valid only inside its `async with`."""

    def __init__(self, libp2p_host: object, config: TransportConfig, reach: Reach) -> None:
        self._host = libp2p_host
        self._config = config
        self.reach = reach
        self._known_addrs: dict[str, multiaddr.Multiaddr] = {}

    @property
    def peer_id(self) -> str:
        return self._host.get_id().to_base58()

    @property
    def addrs(self) -> list[str]:
        """Full multiaddrs others dial, each ending in /p2p/<peer id>: circuits through the
        relays this host reserved on (`reach.use_relay`: when they could not dial it), then its own."""
        return self.reach.circuit_addrs + [str(a) for a in self._host.get_addrs()]

    def path_of(self, stream: FramedStream) -> str:
        """"direct", "hole_punched" or "relayed": the path of the connection `stream` crosses."""
        return self.reach.path_of(stream._stream.swarm_conn)

    def via_of(self, stream: FramedStream) -> str | None:
        """The relay's peer id when `stream` crosses a relayed connection, else None."""
        return self.reach.via_of(stream._stream.swarm_conn)

    async def connect(self, addr: str, probing: bool = False) -> str:
        """Dial `addr` (which must end in /p2p/<id>) unless already connected; return the peer id.
        A circuit address is reached through its relay, then hole-punched (Reach.connect_relayed;
        `probing`: a link probe, which waits for the punch only ReachConfig.probe_punch_wait_s).

        Error handling: DialError if the address is malformed, the peer is unreachable, the
        handshake fails, or it takes longer than `dial_timeout_s`.
        """
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        except (InvalidAddrError, ValueError) as exc:
            raise DialError(addr, f"not a /…/p2p/<peer id> multiaddr: {exc}") from exc
        peer_id = info.peer_id.to_base58()
        if info.addrs:
            self._known_addrs[peer_id] = info.addrs[0]
        if is_circuit(addr):
            await self.reach.connect_relayed(addr, peer_id, self._config.dial_timeout_s,
                                             self.reach.config.probe_punch_wait_s if probing else None)
            return peer_id
        # Callers pace retries: py-libp2p's 60 s block would bar a coordinator restarted at once.
        self._host.get_network().unblock_peer(info.peer_id)
        with trio.move_on_after(self._config.dial_timeout_s) as scope:
            try:
                await self._host.connect(info)
            except (BaseLibp2pError, OSError) as exc:
                raise DialError(addr, f"{type(exc).__name__}: {exc}", peer_id) from exc
        if scope.cancelled_caught:
            raise DialError(addr, f"no connection within {self._config.dial_timeout_s} s", peer_id)
        await self.reach.after_connect(peer_id)  # a relay we may need: are we dialable, else reserve
        return peer_id

    def set_handler(self, protocol_id: str, handler: StreamHandler) -> None:
        """Serve inbound streams of `protocol_id` with `handler(FramedStream)`.

        An Exception escaping the handler (a ShardError: bad frame, peer gone; anything
        else: our bug) is logged and resets only that stream, never the connection or the
        host; trio.Cancelled passes. The stream is closed when the handler returns.
        """

        async def on_stream(stream: INetStream) -> None:
            framed = FramedStream(stream)
            try:
                await handler(framed)
            except Exception as exc:
                if isinstance(exc, ShardError):
                    log.warning("%s handler for peer %s failed: %s", protocol_id, framed.remote_peer_id, exc)
                else:
                    log.exception("%s handler for peer %s raised", protocol_id, framed.remote_peer_id)
                try:
                    await framed.reset()
                except _STREAM_GONE:
                    pass
                return
            await framed.aclose()

        self._host.set_stream_handler(TProtocol(protocol_id), on_stream)

    async def open_stream(self, peer: str, protocol_id: str) -> FramedStream:
        """Open a stream speaking `protocol_id` to `peer`: a peer id, or a full multiaddr.

        Error handling: DialError if the peer cannot be reached or does not serve
        `protocol_id` within `dial_timeout_s`.
        """
        if peer.startswith("/"):
            peer_id = await self.connect(peer)
        else:
            peer_id = peer
            if peer in self._known_addrs and not self._is_connected(peer):
                await self.connect(f"{self._known_addrs[peer]}/p2p/{peer}")
        try:
            target = ID.from_base58(peer_id)
        except ValueError as exc:
            raise DialError(peer, f"not a peer id: {exc}") from exc
        with trio.move_on_after(self._config.dial_timeout_s) as scope:
            try:
                stream = await self._host.new_stream(target, [TProtocol(protocol_id)])
            except (BaseLibp2pError, OSError) as exc:
                raise DialError(peer, f"cannot open {protocol_id}: {type(exc).__name__}: {exc}", peer_id) from exc
        if scope.cancelled_caught:
            raise DialError(peer, f"no {protocol_id} stream within {self._config.dial_timeout_s} s", peer_id)
        return FramedStream(stream)

    def _is_connected(self, peer_id: str) -> bool:
        return bool(self._host.get_network().connections.get(ID.from_base58(peer_id)))


@asynccontextmanager
async def open_host(
    keypair: KeyPair, listen_multiaddr: str | None = None, *, config: TransportConfig | None = None,
    relay_hop: bool = False, reach_config: ReachConfig | None = None,
) -> AsyncIterator[Host]:
    """Start a TCP + Noise + yamux libp2p host for `keypair`, listening on `listen_multiaddr`;
    it accepts relayed circuits and hole punches (shard.relay), and with `relay_hop` it
    relays for others and answers their reachability checks.

    Resource handling: the listener, every connection and every stream handler task live
    inside this context; leaving it closes them all.
    """
    config = config or TransportConfig()
    listen = multiaddr.Multiaddr(listen_multiaddr or config.listen_multiaddr)
    noise = NoiseTransport(keypair, noise_privkey=create_x25519_key_pair().private_key)
    libp2p_host = new_host(
        key_pair=keypair,
        sec_opt={TProtocol(NOISE_PROTOCOL_ID): noise},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        listen_addrs=[listen],
        negotiate_timeout=config.negotiate_timeout_s,
        addrs_factory=advertised,  # 0.0.0.0 is never advertised: each interface's address is
    )
    release_slots_on_close(libp2p_host.get_network())
    bound_stream_buffers(libp2p_host.get_network())
    batch_window_updates()
    reach = Reach(libp2p_host, relay_hop, reach_config or ReachConfig())
    async with libp2p_host.run([listen]), trio.open_nursery() as nursery:
        await nursery.start(reach.serve)
        try:
            yield Host(libp2p_host, config, reach)
        finally:
            nursery.cancel_scope.cancel()
            # run() ending leaves connections open: peers would never see this host go.
            with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                await libp2p_host.get_network().close()
