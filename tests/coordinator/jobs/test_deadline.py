"""A round's deadline (coordinator.jobs.deadline.round_deadline_s).

Bug guarded: a stage that accepts frames and never answers held every request for the
fixed 120 s per frame (four attempts: 520 s, then a 503), while an honest but loaded ring
must not be cut off by a deadline tighter than its own measured rounds. Sound: examples
at exact values, and properties over any prediction and measurements.
"""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from coordinator.jobs.deadline import DeadlinePolicy, round_deadline_s

POLICY = DeadlinePolicy(slack=5.0, margin_s=5.0, max_s=120.0, max_ratio=50.0)


def test_a_new_ring_scales_the_prediction_alone():
    # 0.2 s predicted, nothing measured yet: 5 x 0.2 + 5.
    assert round_deadline_s(0.2, [], frames=1, policy=POLICY) == 6.0


def test_a_ring_measured_slower_than_predicted_gets_its_worst_recent_ratio():
    assert round_deadline_s(0.2, [1.5, 3.0, 2.0], frames=1, policy=POLICY) == 5 * 0.2 * 3.0 + 5
    # Faster than predicted does not shrink it below the prediction.
    assert round_deadline_s(0.2, [0.1, 0.5], frames=1, policy=POLICY) == 6.0


def test_no_usable_prediction_or_a_wildly_wrong_model_falls_back_to_the_cap_per_frame():
    assert round_deadline_s(None, [2.0], frames=3, policy=POLICY) == 360.0
    assert round_deadline_s(math.nan, [], frames=1, policy=POLICY) == 120.0
    assert round_deadline_s(0.01, [51.0], frames=2, policy=POLICY) == 240.0


def test_a_long_prefill_is_capped_by_its_frames():
    assert round_deadline_s(100.0, [], frames=2, policy=POLICY) == 240.0


finite = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)
ratios = st.lists(st.floats(min_value=0.0, max_value=1e3, allow_nan=False), max_size=8)


@given(finite, ratios, st.integers(1, 16))
def test_the_deadline_covers_the_prediction_and_every_recent_round_and_never_passes_the_cap(predicted, rs, frames):
    d = round_deadline_s(predicted, rs, frames, POLICY)
    cap = POLICY.max_s * frames
    assert POLICY.margin_s <= d <= cap or d == cap
    worst = max([1.0, *[r for r in rs if r > 0]])
    if d < cap:  # under the cap it leaves slack over the worst measured round
        assert d >= POLICY.slack * predicted * worst


@given(finite, finite, ratios, st.integers(1, 16))
def test_a_slower_prediction_never_gets_a_shorter_deadline(a, b, rs, frames):
    lo, hi = sorted((a, b))
    assert round_deadline_s(lo, rs, frames, POLICY) <= round_deadline_s(hi, rs, frames, POLICY)


def test_other_jobs_work_queued_at_a_stage_extends_the_deadline():
    # Bug guarded: 32 streams on a 3-stage CPU ring had decode rounds wait behind other
    # jobs' prefill chunks past a deadline that knew only their own prediction, and honest
    # stages were blamed as stalled (bench_load). 0.2 s own + 3 x 1.0 s queued: 5 x 3.2 + 5.
    assert round_deadline_s(0.2, [], frames=1, policy=POLICY, queued_s=3.0) == 5 * 3.2 + 5
    # Nonsense queued figures count as nothing, and the cap still holds.
    assert round_deadline_s(0.2, [], frames=1, policy=POLICY, queued_s=math.nan) == 6.0
    assert round_deadline_s(0.2, [], frames=1, policy=POLICY, queued_s=-1.0) == 6.0
    assert round_deadline_s(0.2, [], frames=1, policy=POLICY, queued_s=1e6) == 120.0


@given(finite, finite, finite, ratios, st.integers(1, 16))
def test_more_queued_work_never_shortens_the_deadline(predicted, q1, q2, rs, frames):
    lo, hi = sorted((q1, q2))
    assert (round_deadline_s(predicted, rs, frames, POLICY, queued_s=lo)
            <= round_deadline_s(predicted, rs, frames, POLICY, queued_s=hi))
