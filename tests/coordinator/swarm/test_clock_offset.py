"""Each node's clock offset from Ping/Pong round trips (coordinator.swarm.clock_offset)."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from coordinator.swarm.clock_offset import MAX_PENDING, ClockOffsets, Estimate, Sample, estimate, keep_measuring
from shard.transport import TransportError
from shard.wire.messages import Pong

delays = st.floats(0.0, 2.0)


def _sample(true_offset_s: float, sent_s: float, there_s: float, back_s: float) -> Sample:
    """A Ping sent at `sent_s` (coordinator clock) that takes `there_s` to the node and
    `back_s` back; the node stamps its clock (ours + true_offset_s) on arrival."""
    return Sample(sent_s, there_s + back_s, sent_s + there_s + true_offset_s)


@given(st.floats(-1e4, 1e4), st.lists(st.tuples(st.floats(0, 1e3), delays, delays), min_size=1, max_size=20))
def test_the_estimate_is_within_half_its_round_trip_of_the_truth(true_offset_s, pings):
    # Bug guarded: the midpoint taken at the wrong end, or the bound claimed tighter than
    # the asymmetry allows. Sound: each sample's directions are drawn independently (fully
    # asymmetric allowed), and the estimate must still lie within its own stated bound.
    samples = [_sample(true_offset_s, 1.7e9 + t, a, b) for t, a, b in pings]
    e = estimate(samples)
    assert e.samples == len(samples)
    assert e.uncertainty_s == pytest.approx(min(a + b for _, a, b in pings) / 2)
    assert abs(e.offset_s - true_offset_s) <= e.uncertainty_s + 1e-6


@given(st.floats(-1e4, 1e4), delays, st.lists(st.tuples(delays, delays), min_size=1, max_size=20))
def test_the_minimum_round_trip_sample_is_the_one_kept(true_offset_s, fast_s, slow):
    # Bug guarded: a mean or the latest sample kept, letting one queued (lopsided) round
    # trip drag the estimate. Sound: one symmetric sample is faster than every other, which
    # is all queueing on the way back; only the minimum recovers the offset to rounding.
    fast = _sample(true_offset_s, 1.7e9, fast_s / 2, fast_s / 2)
    slowed = [_sample(true_offset_s, 1.7e9 + 1, a, fast_s + 0.01 + b) for a, b in slow]
    e = estimate([*slowed, fast, *slowed])
    assert e.uncertainty_s == pytest.approx(fast_s / 2)
    assert e.offset_s == pytest.approx(true_offset_s, abs=1e-5)


def test_no_samples_no_estimate_and_a_correction_only_when_the_clocks_are_told_apart():
    # Bug guarded: same-machine stamps (exact) shifted by a link's asymmetry. Sound: within
    # the bound, zero is as consistent with the round trips as the midpoint.
    assert estimate([]) is None
    assert Estimate(0.004, 0.005, 3).applied_s == 0.0
    assert Estimate(-0.004, 0.005, 3).applied_s == 0.0
    assert Estimate(5.002, 0.005, 3).applied_s == 5.002
    assert Estimate(-0.5, 0.005, 3).applied_s == -0.5


def test_pongs_are_matched_to_our_pings_by_nonce_and_peer():
    # Bug guarded: a node's answer to someone else's Ping, a replayed Pong, or one with no
    # clock taken as a sample. Sound: the clocks are scripted, so the one sample is exact.
    now = {"wall": 1000.0, "mono": 50.0}
    clocks = ClockOffsets(wall=lambda: now["wall"], mono=lambda: now["mono"])
    ping = clocks.ping("A")
    assert ping.sent_ns == 1000 * 10**9
    now["mono"] += 0.2  # a 200 ms round trip; A's clock read 3 s ahead at its middle
    clocks.pong("B", Pong(nonce=ping.nonce, sent_ns=ping.sent_ns, clock_s=1003.1))
    clocks.pong("A", Pong(nonce=ping.nonce + 1, sent_ns=ping.sent_ns, clock_s=1003.1))
    clocks.pong("A", Pong(nonce=ping.nonce, sent_ns=ping.sent_ns))
    assert clocks.get("A") is None
    clocks.pong("A", Pong(nonce=ping.nonce, sent_ns=ping.sent_ns, clock_s=1003.1))
    clocks.pong("A", Pong(nonce=ping.nonce, sent_ns=ping.sent_ns, clock_s=9999.0))  # replayed: ignored
    e = clocks.get("A")
    assert (e.offset_s, e.uncertainty_s, e.samples) == (pytest.approx(3.0), pytest.approx(0.1), 1)
    assert clocks.stage_offsets_s(["A", "B"]) == (pytest.approx(3.0), 0.0)
    assert clocks.summary() == {"A": {"offset_s": pytest.approx(3.0), "uncertainty_s": pytest.approx(0.1),
                                      "applied_s": pytest.approx(3.0), "samples": 1}}
    clocks.forget(["B"])
    assert clocks.summary() == {}


def test_unanswered_pings_are_bounded():
    # Bug guarded: a node that never answers growing the coordinator's memory without end.
    clocks = ClockOffsets()
    for _ in range(MAX_PENDING + 50):
        clocks.ping("silent")
    assert len(clocks._pending) == MAX_PENDING


def test_keep_measuring_pings_every_member_each_interval_and_skips_a_broken_stream():
    # Bug guarded: one member's failed stream ending the loop for all. Sound: on a mock
    # clock the loop runs exactly three rounds in 2.5 intervals.
    sent: list[str] = []

    async def send(peer, ping):
        if peer == "gone":
            raise TransportError("stream closed", peer)
        sent.append(peer)

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep_measuring, ClockOffsets(), lambda: ["b", "gone", "a"], send, 1.0)
            await trio.sleep(2.5)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert sent == ["a", "b"] * 3
