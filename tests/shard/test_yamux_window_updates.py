"""A ring stream's reader grants yamux window in batches, not with one update per read.

Bug guarded: py-libp2p 0.8.1 answered every read of a stream with its own WINDOW_UPDATE
frame (one more encrypted write and send for the reader, one more frame for the sender's
muxer), so each ring frame cost two frames at every hop: ~6% of the gateway's busy CPU at
16 streams. Sound: 300 small frames (a decode row's size) cost at most a handful of
updates, and a frame several windows long still arrives whole (the window is granted in
time: no stall).
"""

from __future__ import annotations

import os

import trio

from libp2p.stream_muxer.yamux.yamux import TYPE_WINDOW_UPDATE

from shard.identity import keypair_from_seed
from shard.transport import open_host

SMALL, ROW = 300, 2304 + 200  # a SmolLM2 decode row on an f32 wire and its header
BIG = 5 << 20  # a long prefill chunk's hidden states: ~20 default windows


def _count_window_updates(stream) -> list[int]:
    """From now on, count the WINDOW_UPDATE frames the stream's connection writes."""
    conn, count = stream._stream.muxed_conn, [0]
    write = conn._write_frame

    async def counted(frame: bytes) -> None:
        count[0] += frame[1] == TYPE_WINDOW_UPDATE  # header: version, type, ...
        await write(frame)

    conn._write_frame = counted
    return count


def test_small_frames_share_window_updates_and_a_big_frame_still_arrives():
    async def main():
        got: dict[str, object] = {}
        done = trio.Event()

        async def sink(stream):
            updates = _count_window_updates(stream)
            sizes = [len(await stream.recv_frame(1 << 20)) for _ in range(SMALL)]
            got["small_updates"] = updates[0]
            got["big"] = len(await stream.recv_frame(BIG + 1))
            got["sizes"], got["big_updates"] = sizes, updates[0] - got["small_updates"]
            await stream.send_frame(b"ok")
            done.set()

        async with open_host(keypair_from_seed(os.urandom(32))) as server, \
                open_host(keypair_from_seed(os.urandom(32))) as client:
            server.set_handler("/sink/1", sink)
            with trio.fail_after(60):
                await client.connect(server.addrs[0])
                stream = await client.open_stream(server.peer_id, "/sink/1")
                for _ in range(SMALL):
                    await stream.send_frame(bytes(ROW))
                    await trio.sleep(0)  # the reader reads each as it comes, as a stage does
                await stream.send_frame(bytes(BIG))
                assert await stream.recv_frame(16) == b"ok"
                await done.wait()
        return got

    got = trio.run(main)
    assert got["sizes"] == [ROW] * SMALL and got["big"] == BIG
    assert 1 <= got["small_updates"] <= 8, got  # ~750 KB read: a grant per half window (was one per read: 300)
    assert got["big_updates"] >= 1, got
