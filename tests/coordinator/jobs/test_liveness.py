"""Frames in flight on a ring and the work they put ahead of a round (coordinator.jobs.liveness).

Bug guarded (issue 21): at 32 streams the round deadline knew only the round's own
prediction, and decode rounds queued behind other jobs' batched work at the stages were
declared missed: honest stages were blamed as stalled and requests failed. The deadline
now counts what other jobs have in flight on the same ring; a lone job counts nothing
(its stall detection stays as fast: tests/e2e/test_stalling_stage.py).
"""

from __future__ import annotations

from coordinator.jobs.liveness import InFlight, RowsInFlight, work_ahead


def test_only_other_jobs_frames_on_the_same_epoch_count():
    f = RowsInFlight()
    f.sent("a", 1, epoch=3, rows=1)
    f.sent("b", 1, epoch=3, rows=256)
    f.sent("b", 2, epoch=3, rows=256)
    f.sent("c", 7, epoch=3, rows=4)
    assert f.others(3, "a") == InFlight(3, 516)
    assert f.others(3, "b") == InFlight(2, 5)
    assert f.others(2, "a") == InFlight(0, 0)


def test_a_result_or_the_jobs_end_takes_frames_out():
    f = RowsInFlight()
    f.sent("b", 1, epoch=3, rows=256)
    f.sent("b", 2, epoch=3, rows=256)
    f.sent("c", 1, epoch=3, rows=1)
    f.arrived("b", 1)
    f.arrived("b", 9)  # a round never sent (or already back): nothing happens
    assert f.others(3, "a") == InFlight(2, 257)
    f.job_ended("b")
    assert f.others(3, "a") == InFlight(1, 1) and len(f) == 1


def test_a_new_epoch_drops_the_old_rings_frames():
    f = RowsInFlight()
    f.sent("b", 1, epoch=3, rows=256)
    f.sent("a", 1, epoch=4, rows=1)  # the ring re-formed: epoch 3's frames never come back
    assert len(f) == 1 and f.others(3, "a") == InFlight(0, 0)


def test_a_lone_job_has_nothing_ahead():
    assert work_ahead(InFlight(0, 0), others_open=False, prefill_chunk_tokens=256) == InFlight(0, 0)


def test_another_open_job_may_add_one_chunk_to_the_forward():
    assert work_ahead(InFlight(0, 0), others_open=True, prefill_chunk_tokens=256) == InFlight(1, 256)
    assert work_ahead(InFlight(31, 31), others_open=True, prefill_chunk_tokens=256) == InFlight(32, 287)
