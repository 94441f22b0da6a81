"""Link emulation timing: exact on trio's MockClock over in-memory pairs, with tolerances
on the real clock over a libp2p loopback stream."""

from __future__ import annotations

import time

import pytest
import trio
import trio.testing

from shard.identity import keypair_from_seed
from shard.linkemu import EmulatedLink, Uplink, open_emulated_link
from shard.memory_stream import memory_stream_pair
from shard.transport import FRAME_PREFIX, FramedStream, StreamClosedError, open_host

MAX = 1 << 21
PREFIX = FRAME_PREFIX.size


def run_mock(fn):
    async def bounded():
        with trio.fail_after(60):  # virtual seconds; the mock clock jumps whenever all tasks block
            await fn()

    trio.run(bounded, clock=trio.testing.MockClock(autojump_threshold=0))


async def _stamp(stream) -> tuple[float, bytes]:
    body = await stream.recv_frame(MAX)
    return trio.current_time(), body


def test_single_small_frame_arrives_after_one_latency():
    # Guards: latency not applied, or applied twice (at send and at delivery).
    async def main():
        a, b = memory_stream_pair("a", "b")
        async with open_emulated_link(a, 0.080, 1e6) as link:
            t0 = trio.current_time()
            await link.send_frame(b"x" * 96)
            sent = trio.current_time() - t0
            arrived, body = await _stamp(b)
        assert body == b"x" * 96
        assert sent == pytest.approx((96 + PREFIX) / 1e6)  # send blocks for serialisation only
        assert arrived - t0 == pytest.approx(0.080 + (96 + PREFIX) / 1e6)

    run_mock(main)


def test_back_to_back_frames_pipeline_latency():
    # Guards: a link that delivers one frame per latency (stop-and-wait), which would make
    # pipelined prefill and speculative rounds look K times slower than the network is.
    async def main():
        a, b = memory_stream_pair("a", "b")
        ser = (10_000 + PREFIX) / 1e6
        async with open_emulated_link(a, 0.100, 1e6) as link:
            t0 = trio.current_time()
            for i in range(5):
                await link.send_frame(bytes([i]) * 10_000)
            got = [await _stamp(b) for _ in range(5)]
        assert [body[0] for _, body in got] == [0, 1, 2, 3, 4]
        for i, (t, _) in enumerate(got):
            assert t - t0 == pytest.approx(0.100 + (i + 1) * ser)

    run_mock(main)


def test_one_megabyte_at_8_mbit_takes_a_second_to_serialise():
    # Guards: bandwidth in bits vs bytes confusion (8x), or bandwidth ignored for big frames.
    async def main():
        a, b = memory_stream_pair("a", "b")
        async with open_emulated_link(a, 0.020, 8e6 / 8) as link:
            t0 = trio.current_time()
            await link.send_frame(bytes(1_000_000))
            sent = trio.current_time() - t0
            arrived, body = await _stamp(b)
        assert len(body) == 1_000_000
        assert sent == pytest.approx(1.0, rel=1e-4)
        assert arrived - t0 == pytest.approx(1.020, rel=1e-4)

    run_mock(main)


def test_jitter_delays_but_never_reorders():
    # Guards: jitter implemented as independent per-frame sleeps (reorders frames, which
    # the stage protocol never expects from one stream), or jitter silently ignored.
    async def main():
        a, b = memory_stream_pair("a", "b")
        async with open_emulated_link(a, 0.010, 1e9, jitter_s=0.050, seed=7) as link:
            t0 = trio.current_time()
            for i in range(200):
                await link.send_frame(i.to_bytes(2, "big"))
            got = [await _stamp(b) for _ in range(200)]
        assert [int.from_bytes(body, "big") for _, body in got] == list(range(200))
        delays = [t - t0 for t, _ in got]
        assert delays == sorted(delays)
        assert min(delays) >= 0.010 and max(delays) <= 0.010 + 0.050 + 1e-3
        assert max(delays) > 0.010 + 0.040  # jitter drawn from [0, 50 ms] really applied

    run_mock(main)


def test_a_slow_link_does_not_hold_up_another_stream():
    # Guards: one global delivery task or lock that serialises all links' delays.
    async def main():
        slow_a, slow_b = memory_stream_pair("a", "b")
        fast_a, fast_b = memory_stream_pair("a", "c")
        async with open_emulated_link(slow_a, 0.5, 1e5) as slow, open_emulated_link(fast_a, 0.010, 1e9) as fast:
            t0 = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(slow.send_frame, bytes(100_000))  # 1 s of serialisation
                await trio.sleep(0.001)
                await fast.send_frame(b"hi")
                t_fast, _ = await _stamp(fast_b)
            t_slow, _ = await _stamp(slow_b)
        assert t_fast - t0 == pytest.approx(0.011, abs=1e-4)
        assert t_slow - t0 == pytest.approx(1.5, rel=1e-3)

    run_mock(main)


def test_links_sharing_an_uplink_queue_behind_each_other():
    # Guards: per-link bandwidth when the node has one uplink (a tail sending hidden states
    # to the coordinator while a standby pulls a copy would both get full rate).
    async def main():
        uplink = Uplink(1e6)
        a1, b1 = memory_stream_pair("a", "b")
        a2, b2 = memory_stream_pair("a", "c")
        async with open_emulated_link(a1, 0.0, 1e6, uplink=uplink) as l1, open_emulated_link(a2, 0.0, 1e6, uplink=uplink) as l2:
            t0 = trio.current_time()
            stamps: list[float] = []

            async def receive(end) -> None:
                stamps.append((await _stamp(end))[0] - t0)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(receive, b1)
                nursery.start_soon(receive, b2)
                nursery.start_soon(l1.send_frame, bytes(500_000 - PREFIX))
                nursery.start_soon(l2.send_frame, bytes(500_000 - PREFIX))
        assert stamps == pytest.approx([0.5, 1.0])  # the second waits for the first's bytes

    run_mock(main)


def test_dead_inner_stream_surfaces_on_the_next_send():
    # Guards: the delivery task dying silently, so the sender keeps queueing into a void.
    async def main():
        a, b = memory_stream_pair("a", "b")
        link = EmulatedLink(a, 0.010, 1e9)
        async with trio.open_nursery() as nursery:
            await nursery.start(link.serve)
            await b._recv.aclose()  # the receiver is gone
            await link.send_frame(b"lost")
            await trio.sleep(0.1)
            with pytest.raises(StreamClosedError):
                await link.send_frame(b"again")

    run_mock(main)


def test_real_loopback_libp2p_stream_sees_the_emulated_latency():
    # Guards: the decorator not composing with the real FramedStream (the code path every
    # benchmark runs). Real clock: arrival must be >= the emulated latency, and five
    # back-to-back frames must take about one latency, not five.
    latency_s = 0.060
    arrived: list[float] = []

    async def main():
        async with open_host(keypair_from_seed(b"\x21" * 32)) as server, open_host(keypair_from_seed(b"\x22" * 32)) as client:
            first_in, all_in = trio.Event(), trio.Event()

            async def sink(stream: FramedStream) -> None:
                for i in range(6):
                    await stream.recv_frame(MAX)
                    arrived.append(time.perf_counter())
                    first_in.set()
                all_in.set()

            server.set_handler("/sink/1", sink)
            stream = await client.open_stream(server.addrs[0], "/sink/1")
            async with open_emulated_link(stream, latency_s, 125e6) as link:
                t_single = time.perf_counter()
                await link.send_frame(b"one")
                await first_in.wait()
                t_burst = time.perf_counter()
                for _ in range(5):
                    await link.send_frame(bytes(1000))
                await all_in.wait()
        return t_single, t_burst

    async def bounded():
        with trio.fail_after(20):
            return await main()

    t_single, t_burst = trio.run(bounded)
    assert latency_s <= arrived[0] - t_single < latency_s + 0.100
    assert latency_s <= arrived[-1] - t_burst < 2 * latency_s


def test_probes_measure_the_emulated_link():
    # Guards: probes that time the local send call instead of the round trip, or that
    # count the sync's own round trip as transfer time (bandwidth under-reported).
    # Oracle: the emulation's own parameters (mock clock, so exact up to the prefix bytes).
    from shard.linkprobe import measure_bandwidth, measure_rtt, serve_probe

    async def main():
        near, far = memory_stream_pair("client", "server")
        async with open_emulated_link(near, 0.040, 1e6) as up, open_emulated_link(far, 0.040, 1e9) as down:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve_probe, down)
                rtt = await measure_rtt(up, 5)
                bw = await measure_bandwidth(up, 2_000_000)
                await up.aclose()
        assert rtt.median_s == pytest.approx(0.080, rel=0.01)
        assert bw.bytes_per_s == pytest.approx(1e6, rel=0.01)

    run_mock(main)
