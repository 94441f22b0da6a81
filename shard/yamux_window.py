"""Yamux with a bound on what one stream may buffer unread: py-libp2p 0.8.1's receiver only
logs a peer that sends past a stream's receive window, and keeps buffering what it sends.

A peer that honours the protocol never sends a stream more than the window it was granted
(the stream's `recv_window`, which py-libp2p raises before it sends each grant, so it is
never less than what the peer was told); a swarm's connections refuse a DATA frame past it
(`bound_stream_buffers`), and past MAX_STREAM_BUFFER_BYTES unread whatever the window: the
frame is dropped, py-libp2p marks the stream's receive side closed (its reader sees the
end of the stream), and the bytes already buffered are all the stream can hold. A stream
nobody reads granted only its initial window (256 KiB); one being read, at most what its
reads grew it to (MAX_WINDOW_SIZE, 16 MiB). The issue's probe stream held 600 MB; a
bound of 32 MiB per stream whatever the window still let four strangers' probe streams
hold +133 MB in a stage (bench_hostile_ring's window_abuse).

`batch_window_updates`: py-libp2p 0.8.1 also answers (nearly) every read of a stream with
its own WINDOW_UPDATE frame (its "partial slack" grant fires whenever less than half the
window is owed), each one more noise-encrypted write and socket send for the reader and
one more frame for the sender's muxer to decrypt and handle: one per ring frame at every
hop. Streams grant window the way go-yamux does instead, once half the window was read.
Does not know frames, protocols or peers' roles.
"""

from __future__ import annotations

import functools
from typing import Any

from libp2p.stream_muxer.yamux.yamux import MAX_WINDOW_SIZE, YamuxStream

MAX_STREAM_BUFFER_BYTES = 2 * MAX_WINDOW_SIZE


class WindowExceeded(Exception):
    """Raised inside py-libp2p's frame loop, which closes that stream's receive side."""


class _BoundedBuffer(bytearray):
    """One stream's unread bytes; `stream()`: its YamuxStream (None before the muxer has
    registered it). Once refused, a stream drops what its peer sends without a word: py-libp2p
    logs each refusal at ERROR, and an attacker's every frame would be a log line."""

    refused = False

    def stream(self) -> Any:
        return None

    def extend(self, data) -> None:  # the muxer's only way to append a stream's data
        stream = self.stream()
        if self.refused:
            if stream is not None:
                stream.recv_window += len(data)  # the muxer charges it next: dropped, it costs no window
            return
        if stream is not None and len(data) > stream.recv_window:
            self.refused = True
            raise WindowExceeded(f"stream data past its receive window ({len(data)} bytes, {stream.recv_window} "
                                 "granted): peer ignores its window; dropping what it sends on this stream")
        if len(self) + len(data) > MAX_STREAM_BUFFER_BYTES:
            self.refused = True
            raise WindowExceeded(f"stream buffer past {MAX_STREAM_BUFFER_BYTES} bytes unread "
                                 f"(had {len(self)}, got {len(data)} more): peer ignores its window")
        super().extend(data)


class _BoundedBuffers(dict):
    """stream id -> _BoundedBuffer, whatever buffer the muxer puts in; `conn`: the muxer,
    whose streams hold each one's window."""

    def __init__(self, buffers: dict, conn: Any) -> None:
        super().__init__(buffers)
        self._conn = conn

    def __setitem__(self, stream_id, buffer) -> None:
        bounded = buffer if isinstance(buffer, _BoundedBuffer) else _BoundedBuffer(buffer)
        bounded.stream = functools.partial(_stream_of, self._conn, stream_id)
        super().__setitem__(stream_id, bounded)


def _stream_of(conn: Any, stream_id: int) -> Any:
    return conn.streams.get(stream_id)


def bound_stream_buffers(swarm: Any) -> None:
    """Give every connection `swarm` adds from now on per-stream buffers that refuse data
    past the stream's receive window, and past MAX_STREAM_BUFFER_BYTES unread. (py-libp2p 0.8.1 builds its Yamux itself, whatever
    muxer class the host was given, so the buffers are swapped as the swarm adds the
    connection, before it has any stream.)"""
    add_conn = swarm.add_conn

    @functools.wraps(add_conn)
    async def add_bounded_conn(muxed_conn: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(getattr(muxed_conn, "stream_buffers", None), dict):
            muxed_conn.stream_buffers = _BoundedBuffers(muxed_conn.stream_buffers, muxed_conn)
        return await add_conn(muxed_conn, *args, **kwargs)

    swarm.add_conn = add_bounded_conn


async def _grant_by_half_windows(self: Any, *, bytes_read: int = 0) -> None:
    """YamuxStream._auto_tune_and_send_window_update as go-yamux's sendWindowUpdate: grant
    what the reader consumed once it is half the target window (auto-tuning the target as
    py-libp2p does when it grants), not after every read. A sender blocks only at a zero
    window, where the reader, having read what was sent, has a whole window to grant."""
    async with self.window_lock:
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        consumed = self.target_recv_window - (self.recv_window + buffered)  # read, not yet granted again
        if consumed <= 0 or consumed < self.target_recv_window // 2:
            return
        self._pending_recv_release = 0
        grant = self._grow_to_delta(buffered) + self._apply_autotune_epoch(buffered)
    if grant > 0:
        await self.send_window_update(grant, skip_lock=True)


def batch_window_updates() -> None:
    """Have py-libp2p's yamux streams grant receive window by half windows (go-yamux's
    cadence) instead of with a WINDOW_UPDATE after every read; idempotent. At 16 streams on
    the loopback ring the per-read updates were ~11% of the gateway's main-thread busy
    samples and ~2% of a stage's (py-spy)."""
    YamuxStream._auto_tune_and_send_window_update = _grant_by_half_windows
