"""FrameLog bounds: audits need whole jobs, and a volunteer's memory must stay bounded.

Guards: eviction drops whole (job, epoch) entries (a partial job cannot be replayed),
prefers ended jobs over running ones, honours the grace period on a fake clock (no
sleeps), and keeps the byte count exact so the bound is real.
"""

from __future__ import annotations

from shard.frame_log import FrameLog, FrameLogConfig


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_frames_kept_in_order_and_last_round_wins():
    log = FrameLog()
    log.record("j", 1, 1, b"in1", b"out1")
    log.record("j", 1, 2, b"in2", b"out2")
    log.record("j", 1, 2, b"in2b", b"out2b")  # a round re-sent on the same epoch
    assert [r.round for r in log.frames("j", 1)] == [1, 2, 2]
    assert log.get("j", 1, 2).input_frame == b"in2b"
    assert log.get("j", 2, 1) is None and log.frames("k", 1) == []
    assert log.nbytes == 3 + 4 + 3 + 4 + 4 + 5


def test_byte_bound_evicts_ended_jobs_first_and_whole():
    log = FrameLog(FrameLogConfig(max_bytes=100, max_jobs=10))
    log.record("running", 1, 1, b"x" * 30, b"y" * 10)
    log.record("ended", 1, 1, b"x" * 30, b"y" * 10)
    log.end_job("ended")
    log.record("new", 1, 1, b"x" * 20, b"y" * 10)  # 110 bytes > 100: one job must go
    assert log.frames("ended", 1) == []  # the ended one, although "running" is older
    assert len(log.frames("running", 1)) == 1 and log.nbytes == 70


def test_job_count_bound_and_grace_period():
    clock = Clock()
    log = FrameLog(FrameLogConfig(max_jobs=2, grace_s=10.0), clock=clock)
    log.record("a", 1, 1, b"i", b"o")
    log.record("a", 2, 1, b"i", b"o")  # a second epoch of the same job is its own entry
    log.end_job("a")
    clock.now = 9.0
    assert log.frames("a", 1) and log.frames("a", 2)
    clock.now = 10.5
    assert log.frames("a", 1) == [] and log.frames("a", 2) == [] and log.nbytes == 0
    for job in ("b", "c", "d"):
        log.record(job, 1, 1, b"i", b"o")
    assert log.frames("b", 1) == [] and log.frames("d", 1)  # oldest running job dropped at 3 > 2


def test_an_idle_stage_drops_ended_jobs_after_their_grace():
    # Bug guarded (issue 21): eviction ran only inside record/end_job/frames, so a node
    # whose traffic stopped kept every ended job's frames (up to 512 MB) for good. Sound:
    # after the job ends, no call but sweep is made; sweep before the grace keeps the
    # frames (audits need them), sweep after it drops them.
    now = [0.0]
    log = FrameLog(FrameLogConfig(grace_s=300.0), clock=lambda: now[0])
    log.record("j", 1, 1, b"i" * 1000, b"o" * 1000)
    log.end_job("j")
    now[0] = 299.0
    assert log.sweep() == 2000
    now[0] = 301.0
    assert log.sweep() == 0 and log.frames("j", 1) == []


def test_abandoned_jobs_are_kept_only_within_their_own_small_bound():
    # Bug guarded (issue 20): a predecessor that opened jobs and never ended them filled
    # the log to max_jobs (16 MB of 1-6 token jobs on a SmolLM2 stage) and, once the idle
    # sweep ended them, kept them for the whole grace period. Sound: abandoned jobs past
    # max_abandoned_bytes go oldest first while an ended job of the same age stays, the
    # byte counts stay exact (a late frame of an abandoned job counts against it too).
    log = FrameLog(FrameLogConfig(max_bytes=10_000, max_abandoned_bytes=100))
    log.record("ended", 1, 1, b"x" * 40, b"y" * 10)
    log.end_job("ended")
    for job in ("a", "b", "c"):
        log.record(job, 1, 1, b"x" * 40, b"y" * 10)
        log.abandon(job)
    assert log.frames("a", 1) == [] and log.frames("b", 1) and log.frames("c", 1)
    assert log.frames("ended", 1) and log.nbytes == 150
    log.record("c", 1, 2, b"x" * 40, b"y" * 10)  # late: "c" now holds 100, "b" must go
    assert log.frames("b", 1) == [] and len(log.frames("c", 1)) == 2 and log.nbytes == 150
    log.abandon("ended")  # an ended job is not abandoned after the fact
    log.record("d", 1, 1, b"i", b"o")
    assert log.frames("ended", 1) and log.nbytes == 152


def test_release_drops_an_ended_job_at_once_and_only_that_epoch():
    # Issue 21: an ended job's frames stayed grace_s (300 s) although the coordinator had
    # already drawn its audits; release is how it says so. Sound: the clock never moves, so
    # only release can have dropped them; the other epoch and job keep theirs, bytes exact.
    log = FrameLog(FrameLogConfig(grace_s=300.0), clock=Clock())
    log.record("a", 1, 1, b"in", b"out")
    log.record("a", 2, 1, b"in", b"out")
    log.record("b", 1, 1, b"in", b"out")
    log.end_job("a")
    assert log.release("a", 1) == 5
    assert log.frames("a", 1) == [] and log.frames("a", 2) and log.frames("b", 1) and log.nbytes == 10
    assert log.release("a", 1) == 0 and log.release("nobody", 7) == 0 and log.nbytes == 10


def test_a_job_released_before_its_end_keeps_no_late_frames_and_its_end_clears_it():
    # The coordinator's ReleaseFrames travels on the control stream and may overtake the
    # job's EndJob or a round still in flight on the ring. Sound: a frame recorded after
    # the release adds no bytes; the end removes the empty entry (the job id may be reused).
    log = FrameLog()
    log.record("a", 1, 1, b"in", b"out")
    assert log.release("a", 1) == 5 and log.nbytes == 0
    log.record("a", 1, 2, b"late-in", b"late-out")
    assert log.frames("a", 1) == [] and log.nbytes == 0
    log.end_job("a")
    log.record("a", 1, 1, b"in", b"out")  # a new job of the same id and epoch is logged again
    assert len(log.frames("a", 1)) == 1 and log.nbytes == 5


def test_released_entries_are_evicted_before_running_jobs():
    # A released entry waiting for its EndJob holds no bytes but counts against max_jobs;
    # it must go before a running job's frames, which an audit may still need.
    log = FrameLog(FrameLogConfig(max_jobs=2))
    log.record("released", 1, 1, b"i", b"o")
    log.release("released", 1)
    log.record("running", 1, 1, b"i", b"o")
    log.record("new", 1, 1, b"i", b"o")
    assert log.frames("running", 1) and log.frames("new", 1) and log.nbytes == 4
