"""Each hop's transfer from the stages' clock stamps (coordinator.gateway.hop_times)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.gateway.hop_times import HopWindow, hop_transfers_s, with_measured_hops

gaps = st.floats(0.0, 5.0)


@given(st.lists(st.tuples(gaps, gaps), min_size=1, max_size=8), gaps, st.lists(st.floats(-2.0, 2.0), min_size=8, max_size=8))
def test_hops_are_the_gaps_between_hand_off_and_take_in_and_their_sum_is_clock_free(stages, last_hop, offsets):
    # Bug guarded: a stage's compute or queueing counted as transfer, a hop attributed to its
    # neighbour, or the sum depending on how the machines' clocks differ. Sound: a frame is
    # built from known per-hop gaps and per-stage residences; each stage's stamps are shifted
    # by its own clock offset, which the sum must cancel exactly.
    t, true_clock, skewed = 100.0, [], []
    hops = []
    for i, (hop, residence) in enumerate(stages):
        hops.append(hop)
        t += hop
        true_clock.append(t)
        skewed.append(t + offsets[i])
        t += residence
        true_clock.append(t)
        skewed.append(t + offsets[i])
    hops.append(last_hop)
    arrived = t + last_hop
    n = len(stages)
    assert hop_transfers_s(100.0, true_clock, arrived, n) == pytest.approx(hops)
    measured = hop_transfers_s(100.0, skewed, arrived, n)
    residences = sum(r for _, r in stages)
    assert sum(measured) == pytest.approx(arrived - 100.0 - residences)
    # A hop carries the offset of its receiver less its sender's.
    assert measured[0] == pytest.approx(hops[0] + offsets[0])
    # Given each stage's offset, the stamps are put back on the coordinator's clock.
    assert hop_transfers_s(100.0, skewed, arrived, n, offsets[:n]) == pytest.approx(hops)
    # Offsets that do not name every stage correct nothing (never a neighbour's offset).
    assert hop_transfers_s(100.0, skewed, arrived, n, (*offsets[:n], 0.0)) == pytest.approx(measured)


def test_stamps_that_do_not_fit_the_ring_give_nothing():
    assert hop_transfers_s(0.0, (1.0, 2.0, 3.0), 4.0, 2) is None  # a stage that did not stamp both
    assert hop_transfers_s(0.0, (1.0, 2.0, 3.0, 4.0, 5.0, 6.0), 7.0, 2) is None
    assert hop_transfers_s(0.0, (), 1.0, 0) is None


def test_window_starts_over_on_a_new_epoch_and_keeps_kinds_apart():
    # Bug guarded: medians mixing a previous ring's links, or big prefill chunks with decode
    # rows. Sound: values are chosen so each mix would change the median.
    w = HopWindow(frames=3)
    w.add(1, "prefill", (9.0, 9.0))
    w.add(2, "decode", (0.010, 0.020))
    w.add(2, "verify", (0.030, 0.040))
    w.add(2, "prefill", (0.5, 0.6))
    assert w.summary() == [{"transfer_s": {"decode": pytest.approx(0.020), "prefill": 0.5}, "frames": {"decode": 2, "prefill": 1}},
                           {"transfer_s": {"decode": pytest.approx(0.030), "prefill": 0.6}, "frames": {"decode": 2, "prefill": 1}}]
    for i in range(5):
        w.add(2, "decode", (1.0, 1.0))
    assert w.summary()[0]["frames"]["decode"] == 3 and w.summary()[0]["transfer_s"]["decode"] == 1.0  # bounded


def test_v1_ring_gets_the_measured_hops_only_for_the_ring_it_describes():
    info = {"epoch": 4, "topology": {"plan": {"hops": [{"src": "c", "dst": "a"}, {"src": "a", "dst": "c"}]}}}
    w = HopWindow()
    assert [h["measured"] for h in with_measured_hops(info, w)["topology"]["plan"]["hops"]] == [None, None]
    w.add(3, "decode", (0.1, 0.2))  # an older ring's frame
    assert with_measured_hops(info, w)["topology"]["plan"]["hops"][0]["measured"] is None
    w.add(4, "decode", (0.1, 0.2))
    out = with_measured_hops(info, w)
    assert out["topology"]["plan"]["hops"][1]["measured"] == {"transfer_s": {"decode": 0.2, "prefill": None},
                                                              "frames": {"decode": 1, "prefill": 0}}
    assert "measured" not in info["topology"]["plan"]["hops"][0]  # the engine's own dict is left alone
    w.add(4, "decode", (0.1, 0.2, 0.3))  # hop count not the plan's: not shown
    assert with_measured_hops({"epoch": 4, "topology": {"plan": None}}, w) == {"epoch": 4, "topology": {"plan": None}}
