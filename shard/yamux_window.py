"""Yamux with a bound on what one stream may buffer unread: py-libp2p 0.8.1's receiver only
logs a peer that sends past a stream's receive window, and keeps buffering what it sends.

A peer that honours the protocol never has more unread bytes on a stream than the window
it was granted, at most MAX_WINDOW_SIZE (16 MiB); a swarm's connections refuse data past twice
that (`bound_stream_buffers`): the frame is dropped, py-libp2p marks the stream's receive side closed (its reader
sees the end of the stream), and the bytes already buffered are all the stream can hold.
Per stream, so one peer's open streams times this bound is what it can make us buffer
(the issue's probe stream held 600 MB). Does not know frames, protocols or peers' roles.
"""

from __future__ import annotations

import functools
from typing import Any

from libp2p.stream_muxer.yamux.yamux import MAX_WINDOW_SIZE

MAX_STREAM_BUFFER_BYTES = 2 * MAX_WINDOW_SIZE


class WindowExceeded(Exception):
    """Raised inside py-libp2p's frame loop, which closes that stream's receive side."""


class _BoundedBuffer(bytearray):
    def extend(self, data) -> None:  # the muxer's only way to append a stream's data
        if len(self) + len(data) > MAX_STREAM_BUFFER_BYTES:
            raise WindowExceeded(f"stream buffer past {MAX_STREAM_BUFFER_BYTES} bytes unread "
                                 f"(had {len(self)}, got {len(data)} more): peer ignores its window")
        super().extend(data)


class _BoundedBuffers(dict):
    """stream id -> _BoundedBuffer, whatever buffer the muxer puts in."""

    def __setitem__(self, stream_id, buffer) -> None:
        super().__setitem__(stream_id, buffer if isinstance(buffer, _BoundedBuffer) else _BoundedBuffer(buffer))


def bound_stream_buffers(swarm: Any) -> None:
    """Give every connection `swarm` adds from now on per-stream buffers that refuse data
    past MAX_STREAM_BUFFER_BYTES unread. (py-libp2p 0.8.1 builds its Yamux itself, whatever
    muxer class the host was given, so the buffers are swapped as the swarm adds the
    connection, before it has any stream.)"""
    add_conn = swarm.add_conn

    @functools.wraps(add_conn)
    async def add_bounded_conn(muxed_conn: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(getattr(muxed_conn, "stream_buffers", None), dict):
            muxed_conn.stream_buffers = _BoundedBuffers(muxed_conn.stream_buffers)
        return await add_conn(muxed_conn, *args, **kwargs)

    swarm.add_conn = add_bounded_conn
