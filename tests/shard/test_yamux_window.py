"""A peer that sends past a stream's yamux window cannot make us buffer without bound.

Bug guarded: py-libp2p 0.8.1 only logs a window violation and keeps buffering, so a peer
pushed 600 MB into one probe stream nobody read. The test writes raw yamux DATA frames
(48 MiB, 1 MiB each) for a stream whose handler never reads, bypassing the sender's own
window accounting as a hostile peer would. Sound: the server's buffer for that stream
stays within MAX_STREAM_BUFFER_BYTES, and the connection still carries another stream.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct

import trio
import trio.testing
from libp2p.stream_muxer.yamux.yamux import DEFAULT_WINDOW_SIZE

from shard.identity import keypair_from_seed
from shard.transport import open_host
from shard.yamux_window import MAX_STREAM_BUFFER_BYTES

DATA_HEADER = struct.Struct("!BBHII")  # version, type (0 = DATA), flags, stream id, length
CHUNK = 1 << 20


@contextlib.asynccontextmanager
async def _sink_pair(echo_bytes: int):
    """(server, client, a client stream on the server's /sink/1, which never reads it); the
    server's /echo/1 sends back one frame of up to `echo_bytes`."""
    async def echo(stream):
        await stream.send_frame(await stream.recv_frame(echo_bytes))

    async with open_host(keypair_from_seed(os.urandom(32))) as server, \
            open_host(keypair_from_seed(os.urandom(32))) as client:
        server.set_handler("/sink/1", lambda stream: trio.sleep_forever())
        server.set_handler("/echo/1", echo)
        await client.connect(server.addrs[0])
        yield server, client, await client.open_stream(server.peer_id, "/sink/1")


def _buffered(server, client) -> list[int]:
    """Bytes the server's muxer holds per stream of its connection from `client`."""
    [conn] = server._host.get_network().connections[client._host.get_id()]
    return [len(b) for b in conn.muxed_conn.stream_buffers.values()]


def test_a_stream_past_its_window_is_cut_not_buffered():
    async def main():
        with trio.fail_after(30):
            async with _sink_pair(1 << 10) as (server, client, sink):
                await sink.send_frame(b"hello")
                muxed = sink._stream.muxed_conn
                stream_id = sink._stream.muxed_stream.stream_id
                for _ in range(48):
                    await muxed.secured_conn.write(DATA_HEADER.pack(0, 0, 0, stream_id, CHUNK) + bytes(CHUNK))
                await trio.testing.wait_all_tasks_blocked(cushion=0.2)
                buffered = max(_buffered(server, client), default=0)
                assert buffered <= MAX_STREAM_BUFFER_BYTES
                other = await client.open_stream(server.peer_id, "/echo/1")
                await other.send_frame(b"still here")
                assert await other.recv_frame(1 << 10) == b"still here"
            return buffered

    assert trio.run(main) > 0  # the sink's buffer did fill: the bound, not a dead stream, held it


def test_an_unread_stream_buffers_no_more_than_the_window_it_granted(caplog):
    # Bug guarded (issue 20, bench_hostile_ring's window_abuse): the bound was 32 MiB per
    # stream whatever the window granted, so four strangers' probe streams, each pushed
    # past its window while the probe server waited on its echoes, held +133 MB in a stage
    # (one identity per stream: the per-peer stream caps do not add up to a bound).
    # Sound: a stream nobody reads granted only its initial window (DEFAULT_WINDOW_SIZE),
    # so the attacker's 64 KiB frames fill it (buffered within one frame of it) and every
    # frame past it is dropped; a peer that honours its window still moves a 40 MiB frame
    # each way on the same connection (windows grown by reads are granted, not refused).
    # And the 764 frames dropped cost one log line, not one each (the node's log grew
    # 480 KB in that bench run).
    async def main():
        with trio.fail_after(60):
            async with _sink_pair(64 << 20) as (server, client, sink):
                muxed = sink._stream.muxed_conn
                stream_id = sink._stream.muxed_stream.stream_id
                frame = 1 << 16
                for _ in range(768):  # 48 MiB
                    async with muxed._write_lock:
                        await muxed.secured_conn.write(DATA_HEADER.pack(0, 0, 0, stream_id, frame) + bytes(frame))
                await trio.testing.wait_all_tasks_blocked(cushion=0.2)
                buffered = max(_buffered(server, client))
                big = os.urandom(40 << 20)
                other = await client.open_stream(server.peer_id, "/echo/1")
                await other.send_frame(big)
                assert await other.recv_frame(64 << 20) == big
            return buffered, frame

    with caplog.at_level(logging.INFO):
        buffered, frame = trio.run(main)
    assert DEFAULT_WINDOW_SIZE - frame <= buffered <= DEFAULT_WINDOW_SIZE
    assert len([r for r in caplog.records if "peer ignores its window" in r.getMessage()]) == 1
    assert not [r for r in caplog.records if "exceeded receive window" in r.getMessage()]
