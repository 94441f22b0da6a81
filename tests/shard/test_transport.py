"""Real libp2p hosts on loopback: Noise + yamux, authenticated peers, bounded frames."""

from __future__ import annotations

import time

import pytest
import trio

from shard.errors import WireError
from shard.identity import keypair_from_seed, peer_id_of
from shard.transport import (
    FRAME_PREFIX,
    MUXER_PROTOCOL,
    SECURITY_PROTOCOL,
    DialError,
    FramedStream,
    StreamClosedError,
    open_host,
)
from shard.memory_stream import memory_stream_pair

ECHO = "/shard-test/echo/1"
MAX_FRAME = 1 << 20


def keypair(n: int):
    return keypair_from_seed(bytes([n]) * 32)


async def echo(stream: FramedStream) -> None:
    while True:
        try:
            body = await stream.recv_frame(MAX_FRAME)
        except StreamClosedError:
            return
        await stream.send_frame(body)


def run(fn, timeout_s: float = 20.0):
    async def bounded():
        with trio.fail_after(timeout_s):
            await fn()

    trio.run(bounded)


def test_noise_and_yamux_are_negotiated_and_peers_authenticated():
    # Guards: falling back to py-libp2p's default security set (plaintext/SECIO offered),
    # and remote_peer_id coming from a claim rather than the Noise handshake: each side
    # must see exactly the other host's id, which derives from the key it holds.
    seen: dict[str, str] = {}

    async def main():
        async with open_host(keypair(1)) as server, open_host(keypair(2)) as client:
            assert server.peer_id == peer_id_of(keypair(1))
            assert all(a.endswith(f"/p2p/{server.peer_id}") for a in server.addrs)

            async def handler(stream: FramedStream) -> None:
                seen["server_sees"] = stream.remote_peer_id
                seen["server_security"] = stream.security_protocol
                await echo(stream)

            server.set_handler(ECHO, handler)
            async with await client.open_stream(server.addrs[0], ECHO) as stream:
                await stream.send_frame(b"ping")
                assert await stream.recv_frame(MAX_FRAME) == b"ping"
                assert stream.remote_peer_id == server.peer_id
                assert stream.security_protocol == SECURITY_PROTOCOL == "/noise"
                assert stream.muxer_protocol == MUXER_PROTOCOL == "/yamux/1.0.0"
                assert stream.protocol_id == ECHO

    run(main)
    assert seen == {"server_sees": peer_id_of(keypair(2)), "server_security": "/noise"}


def test_over_long_frame_is_refused_before_its_body_is_read():
    # Guards: allocating or waiting for a peer-announced length. The peer sends only a
    # prefix announcing 1 MiB + 1 and never the body: a reader that tried to read the body
    # first would block until fail_after fires instead of raising WireError.
    async def main():
        async with open_host(keypair(3)) as server, open_host(keypair(4)) as client:
            got: list[WireError] = []
            done = trio.Event()

            async def handler(stream: FramedStream) -> None:
                try:
                    await stream.recv_frame(MAX_FRAME)
                except WireError as exc:
                    got.append(exc)
                done.set()

            server.set_handler(ECHO, handler)
            stream = await client.open_stream(server.addrs[0], ECHO)
            await stream._stream.write(FRAME_PREFIX.pack(MAX_FRAME + 1))  # prefix, no body
            with trio.fail_after(5):
                await done.wait()
            assert (got[0].what, got[0].limit, got[0].actual) == ("frame length", MAX_FRAME, MAX_FRAME + 1)
            assert str(got[0]) == f"frame length (limit {MAX_FRAME}, got {MAX_FRAME + 1})"
            await stream.aclose()

    run(main)


def test_eof_mid_frame_and_at_boundary_are_clean_transport_errors():
    # Guards: returning a short body as if it were a whole frame, and leaking libp2p's
    # own exception types (callers branch on StreamClosedError and its fields).
    results: list[StreamClosedError] = []

    async def main():
        async with open_host(keypair(5)) as server, open_host(keypair(6)) as client:
            done = trio.Event()

            async def handler(stream: FramedStream) -> None:
                assert await stream.recv_frame(MAX_FRAME) == b"whole"
                for _ in range(2):
                    try:
                        await stream.recv_frame(MAX_FRAME)
                    except StreamClosedError as exc:
                        results.append(exc)
                        break
                done.set()

            server.set_handler(ECHO, handler)
            stream = await client.open_stream(server.addrs[0], ECHO)
            await stream.send_frame(b"whole")
            await stream._stream.write(FRAME_PREFIX.pack(10) + b"abc")  # 3 of 10 body bytes
            await stream.aclose()
            await done.wait()

            done2 = trio.Event()

            async def handler2(stream: FramedStream) -> None:
                try:
                    await stream.recv_frame(MAX_FRAME)
                except StreamClosedError as exc:
                    results.append(exc)
                done2.set()

            server.set_handler(ECHO + "/2", handler2)
            stream = await client.open_stream(server.peer_id, ECHO + "/2")
            await stream.aclose()
            await done2.wait()

    run(main)
    mid, boundary = results
    assert (mid.reason, mid.received_bytes, mid.expected_bytes) == ("closed", 7, 14)
    assert str(mid) == f"stream closed mid-frame after 7 of 14 bytes (peer {peer_id_of(keypair(6))})"
    assert (boundary.received_bytes, boundary.peer_id) == (0, peer_id_of(keypair(6)))
    assert "at a frame boundary" in str(boundary)


def test_a_failing_handler_resets_only_its_stream():
    # Guards: a bad frame on one stream tearing down the connection (py-libp2p lets a
    # handler's exception reach the connection's nursery) and so poisoning other jobs.
    async def main():
        async with open_host(keypair(7)) as server, open_host(keypair(8)) as client:

            async def strict(stream: FramedStream) -> None:
                await stream.recv_frame(4)  # raises WireError for longer frames

            server.set_handler("/strict/1", strict)
            server.set_handler(ECHO, echo)
            healthy = await client.open_stream(server.addrs[0], ECHO)
            bad = await client.open_stream(server.peer_id, "/strict/1")
            await bad.send_frame(b"too long for strict")
            with pytest.raises(StreamClosedError):
                await bad.recv_frame(MAX_FRAME)
            await healthy.send_frame(b"still here")
            assert await healthy.recv_frame(MAX_FRAME) == b"still here"

    run(main)


def test_dial_errors_are_dial_errors():
    # Guards: leaking multiaddr/libp2p exceptions, or hanging on an unreachable peer.
    async def main():
        async with open_host(keypair(9)) as client:
            with pytest.raises(DialError, match="not a /…/p2p/<peer id> multiaddr"):
                await client.connect("/ip4/127.0.0.1/tcp/1")
            dead = f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id_of(keypair(10))}"
            with pytest.raises(DialError) as info:
                await client.open_stream(dead, ECHO)
            assert info.value.addr == dead and info.value.peer_id == peer_id_of(keypair(10))

    run(main)


def test_one_long_lived_stream_carries_1000_frames_of_100_kib_in_order(capsys):
    # Guards: per-frame stream setup, lost/reordered/merged frames on a ring edge, and
    # partial-read bugs (100 KiB frames span many yamux/Noise chunks). Each body carries
    # its index and a byte pattern derived from it, so any misframing is caught.
    n_frames, frame_bytes = 1000, 100 * 1024
    report: dict[str, float] = {}

    async def main():
        async with open_host(keypair(11)) as server, open_host(keypair(12)) as client:
            received: list[int] = []

            async def sink(stream: FramedStream) -> None:
                for _ in range(n_frames):
                    body = await stream.recv_frame(MAX_FRAME)
                    index = int.from_bytes(body[:4], "big")
                    assert len(body) == frame_bytes and body[4:] == bytes([index % 251]) * (frame_bytes - 4)
                    received.append(index)
                await stream.send_frame(b"done")

            server.set_handler("/sink/1", sink)
            server.set_handler(ECHO, echo)
            stream = await client.open_stream(server.addrs[0], "/sink/1")
            start = time.perf_counter()
            for i in range(n_frames):
                await stream.send_frame(i.to_bytes(4, "big") + bytes([i % 251]) * (frame_bytes - 4))
            assert await stream.recv_frame(16) == b"done"
            report["MB_per_s"] = n_frames * frame_bytes / (time.perf_counter() - start) / 1e6
            assert received == list(range(n_frames))

            pinger = await client.open_stream(server.peer_id, ECHO)
            rtts = []
            for _ in range(200):
                t = time.perf_counter()
                await pinger.send_frame(b"x" * 64)
                await pinger.recv_frame(64)
                rtts.append(time.perf_counter() - t)
            report["rtt_ms_median"] = sorted(rtts)[len(rtts) // 2] * 1e3

    run(main, timeout_s=25.0)
    with capsys.disabled():
        print(f"\n[loopback libp2p] 1000x100KiB one stream: {report['MB_per_s']:.1f} MB/s; "
              f"64 B echo RTT median {report['rtt_ms_median']:.2f} ms")


def test_memory_pair_has_the_same_bound_and_close_semantics():
    # Guards: the in-process stand-in being laxer than the real stream, so a stage test
    # passes in memory and fails over libp2p.
    async def main():
        a, b = memory_stream_pair("peer-a", "peer-b")
        assert (a.remote_peer_id, b.remote_peer_id) == ("peer-b", "peer-a")
        await a.send_frame(b"12345")
        with pytest.raises(WireError, match=r"frame length \(limit 4, got 5\)"):
            await b.recv_frame(4)
        await a.aclose()
        with pytest.raises(StreamClosedError):
            await b.recv_frame(4)

    run(main)


def test_frames_sent_in_one_write_arrive_as_the_same_frames_in_order():
    # Guards: a stage's batch of outputs written as one (send_frames) being read back merged,
    # split or reordered (an empty body, small decode-sized bodies and one spanning many
    # yamux/Noise chunks share the write); the receiver reads them with recv_frame as ever.
    bodies = [b"", bytes([7]) * 2858, bytes(range(256)) * 1200, b"last"]

    async def main():
        async with open_host(keypair(13)) as server, open_host(keypair(14)) as client:
            got: list[bytes] = []

            async def sink(stream: FramedStream) -> None:
                for _ in range(len(bodies) + 1):
                    got.append(await stream.recv_frame(MAX_FRAME))
                await stream.send_frame(b"done")

            server.set_handler("/sink/1", sink)
            stream = await client.open_stream(server.addrs[0], "/sink/1")
            await stream.send_frames(bodies)
            await stream.send_frames([b"after"])
            assert await stream.recv_frame(16) == b"done"
            assert got == [*bodies, b"after"]

    run(main)
