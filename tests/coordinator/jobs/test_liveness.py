"""Frames in flight on a ring and the work they put ahead of a round (coordinator.jobs.liveness).

Bug guarded (issue 21): at 32 streams the round deadline knew only the round's own
prediction, and decode rounds queued behind other jobs' batched work at the stages were
declared missed: honest stages were blamed as stalled and requests failed. The deadline
now counts what other jobs have in flight on the same ring; a lone job counts nothing
(its stall detection stays as fast: tests/e2e/test_stalling_stage.py).
"""

from __future__ import annotations

from coordinator.jobs.liveness import InFlight, RowsInFlight, work_ahead
from coordinator.swarm import topology


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


class _Swarm:
    """What Liveness.deadline_s reads of a swarm: the ring's plan on a real network and
    cost model, and the real log of measured rounds."""

    def __init__(self, window: int, rtt_ms: float = 20.0) -> None:
        from ring import ModelSpec, evaluate
        from ring.plan import Stage
        from coordinator.swarm.topology import TopologyConfig, TraversalLog
        from shard.layers import LayerRange
        from shard.wire.messages import Register

        self.config = type("Config", (), {"topology": TopologyConfig()})()
        reg = Register(peer_id="a", model="m", manifest_digest="d", device="cpu", memory_bytes=1 << 30,
                       decode_s_per_layer=1e-3, prefill_s_per_layer_token=1e-5, upload_bytes_per_s=12.5e6,
                       download_bytes_per_s=5 * 12.5e6, rtt_ms={"coord": rtt_ms}, listen_addrs=("/ip4/127.0.0.1/tcp/1",))
        links = topology.record_rtts({}, "a", {"coord": rtt_ms}, "coord")
        network = topology.build_network("coord", {"a": reg}, links, {}, self.config.topology)
        self.model = ModelSpec("m", 4, 1 << 20, 1024, 2048)
        self.planned = (evaluate([Stage("a", LayerRange(0, 4))], network, self.model, self.config.topology.workload()),
                        network)
        self.traversals = TraversalLog(window=window)

    def plan_of(self, epoch: int):
        return self.planned


def test_deadlines_follow_every_round_recorded_and_every_new_plan():
    # Bug guarded: the gateway's per-round deadline work (two cost-model predictions and a
    # pass over 256 measured rounds, ~5% of its CPU at 16 streams) is remembered; a
    # remembered figure must never outlive a round recorded since (a full window drops
    # its oldest) or the plan it was predicted on.
    from dataclasses import replace

    from coordinator.jobs.deadline import round_deadline_s
    from coordinator.jobs.liveness import Liveness
    from coordinator.swarm.topology import Traversal

    swarm = _Swarm(window=3)
    live = Liveness(swarm, frame_timeout_s=60.0, prefill_chunk_tokens=256)
    ring = type("Ring", (), {"epoch": 1})()
    for job in ("a", "b"):
        live.job_opened(job)
    live.in_flight.sent("b", 1, epoch=1, rows=64)
    decode, prefill = Traversal(1, False, 1, 1, 0.0, ()), Traversal(1, True, 2, 512, 0.0, ())

    def expected(shape: Traversal) -> float:
        predict = lambda t: topology.predict(*swarm.planned, swarm.model, swarm.config.topology, t)  # noqa: E731
        queued = predict(replace(shape, prefill=True, frames=2, tokens=64 + 256)).traversal_s
        ratios = [t.traversal_s / p.traversal_s for t, p in swarm.traversals.samples
                  if t.epoch == 1 and t.prefill == shape.prefill]
        return round_deadline_s(predict(shape).traversal_s, ratios, shape.frames, live.policy, queued)

    seen = set()
    for slow in (1.0, 2.5, 1.0, 1.0, 1.0, 1.0):  # the window of 3 holds the 2.5x round, then drops it
        for shape in (decode, prefill, decode):
            got = live.deadline_s(ring, shape, "a")
            assert got == expected(shape)
            seen.add(got)
        p = topology.predict(*swarm.planned, swarm.model, swarm.config.topology, decode)
        swarm.traversals.add(replace(decode, traversal_s=slow * p.traversal_s), p)
    assert len(seen) >= 3  # decode at 1x, decode at 2.5x, prefill
    before = live.deadline_s(ring, decode, "a")
    swarm.planned = _Swarm(window=3, rtt_ms=40.0).planned  # a new ring's plan, on slower links
    assert live.deadline_s(ring, decode, "a") == expected(decode) > before


def test_a_frame_sent_counts_the_same_given_as_bytes_or_as_its_forward():
    # Bug guarded: the engine decoded every frame it had just encoded to count it in
    # flight; handed the Forward it counts the same (job, round, rows), not decoded.
    import dataclasses

    import torch

    from coordinator.jobs.frames import chunk_frame
    from coordinator.jobs.liveness import Liveness
    from shard.wire.codec import encode
    from shard.wire.limits import Limits
    from shard.wire.messages import Result

    fwd = dataclasses.replace(chunk_frame("job-b", 3, bytes(16), 100, [5, 6, 7], decode=False, commit=((), 0),
                                          aux_layers=()), round=4)
    counted = []
    for msg in (None, fwd):
        live = Liveness(type("Swarm", (), {"limits": Limits()})(), frame_timeout_s=60.0, prefill_chunk_tokens=256)
        live.frame_sent(3, encode(fwd), msg)
        counted.append(live.in_flight.others(3, "job-a"))
        live.result_arrived(type("Ring", (), {"epoch": 3, "stages": ()})(),
                            Result(job_id="job-b", epoch=3, round=4, hidden=torch.zeros(3, 8), compute_s=(0.0,)))
        assert len(live.in_flight) == 0  # its result takes it out again
    assert counted == [InFlight(1, 3), InFlight(1, 3)]


def test_a_ring_that_answers_is_busy_not_stalled():
    # Bug guarded (issue 21): at 16 streams with four ~1.9k-token prompts, a short prompt's
    # round waited behind their pieces past its deadline while the ring answered every
    # other job; the tail was blamed as stalled three times in five minutes (re-forming the
    # ring under every job) and excluded for an hour. A ring whose Results keep coming back
    # is busy: no stage is blamed until it misses BUSY_MISSES_BEFORE_BLAME rounds so, and a
    # ring that answers nothing is blamed at its first miss as before.
    from types import SimpleNamespace

    from coordinator.jobs.liveness import ALIVE_WINDOW_S, BUSY_MISSES_BEFORE_BLAME, Liveness

    blamed = []
    rings = {}
    swarm = SimpleNamespace(ring_by_epoch=rings.get, report_unreachable=lambda peer, why, kind: blamed.append(peer))
    now = [100.0]
    live = Liveness(swarm, frame_timeout_s=60.0, prefill_chunk_tokens=256)
    live.clock = lambda: now[0]
    busy = SimpleNamespace(epoch=1, stages=(("head", None), ("tail", None)))
    quiet = SimpleNamespace(epoch=2, stages=(("head", None), ("tail", None)))
    rings.update({1: busy, 2: quiet})
    live.result_arrived(busy, SimpleNamespace(job_id="other", round=7, epoch=1))
    for i in range(BUSY_MISSES_BEFORE_BLAME - 1):
        now[0] += ALIVE_WINDOW_S / 2
        live.round_missed(busy, round=i)
        live.result_arrived(busy, SimpleNamespace(job_id="other", round=8 + i, epoch=1))
        assert blamed == [], i
    now[0] += ALIVE_WINDOW_S / 2
    live.round_missed(busy, round=99)  # still answering, but the misses add up: a selective staller
    assert len(blamed) == 1

    live.result_arrived(quiet, SimpleNamespace(job_id="other", round=1, epoch=2))
    now[0] += ALIVE_WINDOW_S + 0.1  # nothing back since: stalled
    live.round_missed(quiet, round=2)
    assert len(blamed) == 2


def test_misses_at_one_instant_on_an_answering_ring_are_one_event():
    # Bug guarded (issue 21, a5c166b): one lost write left three jobs' rounds waiting; their
    # deadlines passed in the same millisecond while the ring answered every other job, which
    # counted as three misses and blamed an honest stage (the ring re-formed under 16 jobs).
    from types import SimpleNamespace

    from coordinator.jobs.liveness import BUSY_MISSES_BEFORE_BLAME, SAME_EVENT_S, Liveness

    blamed = []
    ring = SimpleNamespace(epoch=1, stages=(("head", None), ("tail", None)))
    swarm = SimpleNamespace(ring_by_epoch={1: ring}.get, report_unreachable=lambda peer, why, kind: blamed.append(peer))
    now = [100.0]
    live = Liveness(swarm, frame_timeout_s=60.0, prefill_chunk_tokens=256)
    live.clock = lambda: now[0]
    live.result_arrived(ring, SimpleNamespace(job_id="other", round=7, epoch=1))
    for i in range(2 * BUSY_MISSES_BEFORE_BLAME):
        now[0] += SAME_EVENT_S / 10
        live.round_missed(ring, round=i)
    assert blamed == []
    for i in range(BUSY_MISSES_BEFORE_BLAME - 1):  # events apart, the ring still answering: they add up
        now[0] += SAME_EVENT_S
        live.result_arrived(ring, SimpleNamespace(job_id="other", round=20 + i, epoch=1))
        live.round_missed(ring, round=30 + i)
    assert blamed == ["head"] or blamed == ["tail"]


def test_a_rounds_deadline_is_soft_while_its_ring_answers_up_to_the_cap():
    # Bug guarded (issue 21): 300 s at 32 streams on the loopback ring (bench_load at
    # 998cd70): rounds behind long prompts' pieces passed their deadlines while the ring
    # answered every other job; each miss resumed its job (re-prefill: more load), three
    # such misses blamed an honest stage, the ring re-formed under every job and 236
    # requests failed. A deadline now moves one step on for every Result back through the
    # ring within ALIVE_WINDOW_S before it passes, up to the cap; a silent ring misses the
    # round at its first deadline, as a stall must.
    from types import SimpleNamespace

    import trio
    import trio.testing

    from coordinator.jobs.liveness import ALIVE_WINDOW_S, Liveness

    swarm = SimpleNamespace(ring_by_epoch=lambda e: None, plan_of=lambda e: None,
                            traversals=SimpleNamespace(samples=[]))
    live = Liveness(swarm, frame_timeout_s=30.0, prefill_chunk_tokens=256)
    ring = SimpleNamespace(epoch=5, stages=(("head", None),))
    shape = topology.Traversal(5, prefill=False, frames=1, tokens=1, traversal_s=0.0, compute_s=())
    step = []

    async def wait_round(answer_every_s: float | None) -> float:
        start = trio.current_time()

        async def answers():
            while True:
                await trio.sleep(answer_every_s)
                live.result_arrived(ring, SimpleNamespace(job_id="other", round=1, epoch=5))

        async with trio.open_nursery() as nursery:
            if answer_every_s is not None:
                nursery.start_soon(answers)
            try:
                with live.round_timer(ring, shape, "job"):
                    step.append(live.deadline_s(ring, shape, "job"))
                    await trio.sleep(1e6)  # the round's Result never comes
            except trio.TooSlowError:
                nursery.cancel_scope.cancel()
                return trio.current_time() - start
        raise AssertionError("the round never timed out")

    def run(answer_every_s):
        return trio.run(wait_round, answer_every_s, clock=trio.testing.MockClock(autojump_threshold=0))

    silent = run(None)
    assert silent == step[0]  # no plan here: the deadline is the cap, 30 s a frame
    live2 = Liveness(swarm, frame_timeout_s=30.0, prefill_chunk_tokens=256)
    live2.policy = SimpleNamespace(max_s=30.0 * 4)  # a cap of four deadlines
    live, step[:] = live2, []
    live.deadline_s = lambda ring, shape, job_id: 30.0
    answering = run(ALIVE_WINDOW_S / 2)
    assert answering == 120.0  # moved on three times, then the cap
    live3 = Liveness(swarm, frame_timeout_s=30.0, prefill_chunk_tokens=256)
    live3.policy, live3.deadline_s = live2.policy, live2.deadline_s
    live = live3
    assert run(ALIVE_WINDOW_S * 20) == 30.0  # answers, but none near the deadline: missed there
    # Answers 9 s apart: none within 2 s of a 30 s deadline, but within half of it (the
    # 32-stream ring went > 2 s without a Result while long prompts' pieces ran).
    live4 = Liveness(swarm, frame_timeout_s=30.0, prefill_chunk_tokens=256)
    live4.policy, live4.deadline_s = live2.policy, live2.deadline_s
    live = live4
    assert run(9.0) == 120.0
