"""A ring's liveness as the ring engine sees it: how long a round may take, and whom to
blame when one does not come back in that time.

A round's deadline (coordinator.jobs.deadline, pure) is the cost model's time for the
round plus the time of the work that may be ahead of it at the stages: every frame the
other jobs have in flight on the same ring (sent to the head, no Result back yet),
counted here as the engine sends and receives them, and one prefill chunk of another
job that may join the forward the round runs in. Stages batch frames of different jobs
(shard/stage_scheduler.py), so thirty-one decode rows ahead cost much less than thirty-
one forwards; the prediction still counts each frame in flight as its own chunk (what
a stage with batching off does), an over-estimate that costs a busy ring slower stall
detection, never a false one. A lone job has nothing ahead: its deadline is the round's
own (a stalling stage is still out within 10 s, tests/e2e/test_stalling_stage.py).

A missed round blames one stage per ring epoch (coordinator.swarm.unreachable.stall_suspect
over the rounds each peer served and the missed rounds it was part of), unless the ring is
answering: a Result of another round came back through every stage within
`ALIVE_WINDOW_S`. A stall answers nothing; a ring that answers is busy, and blaming one of
its stages re-formed the ring under every job and excluded an honest node (bench_load, 16
streams with four ~1.9k-token prompts, a short prompt's round behind their pieces: the
honest tail blamed three times in five minutes, out for an hour). Only the round's own job
resumes then. A stage that answers some jobs and stalls others is still blamed once a ring
epoch has missed `BUSY_MISSES_BEFORE_BLAME` rounds while answering, misses within
`SAME_EVENT_S` of a counted one counting as that one.

A round's deadline is soft while its ring answers (`Liveness.round_timer`): a Result back
through the ring within `ALIVE_WINDOW_S` (or half the deadline) before it passes moves it one deadline on, and so
on up to the policy's cap (`max_s` a frame); only a deadline that passes with the ring
silent that long, or the cap, misses the round.
Failing it at once resumed its job, whose re-prefill added to the load that made it late:
300 s at 32 streams on the loopback ring (bench_load at 998cd70) had honest stages blamed
after three such misses, the ring re-formed under every job and lost its nodes (236
requests failed, "lost its ring 4 times", "no ring is formed yet"). A stage that stalls
answers nothing, so its round is missed at the first deadline as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import trio

from coordinator.jobs.deadline import DeadlinePolicy, round_deadline_s
from coordinator.swarm import topology
from coordinator.swarm.swarm import RingState, Swarm
from coordinator.swarm.topology import Traversal
from coordinator.swarm.unreachable import stall_suspect
from ring import PeerId, RingError
from shard.errors import WireError
from shard.wire.codec import decode_frame
from shard.wire.messages import Forward, Result

log = logging.getLogger("shard.coordinator")

ALIVE_WINDOW_S = 2.0  # a Result through the whole ring this recently: it answers (deadlines are >= 5 s)
BUSY_MISSES_BEFORE_BLAME = 3  # rounds one ring epoch may miss while answering before a stage is blamed
# Misses on one answering ring this close to the first of them are one event, counted once
# toward BUSY_MISSES_BEFORE_BLAME: a lost write once missed three jobs' rounds in the same
# millisecond and got an honest stage blamed (issue 21, a5c166b); a stage that stalls some
# jobs while answering others misses their rounds at their own deadlines, seconds apart.
SAME_EVENT_S = 0.5


@dataclass(frozen=True)
class InFlight:
    """Frames other jobs have on a ring: how many, and their rows (positions) in all."""

    frames: int = 0
    rows: int = 0


def work_ahead(others: InFlight, others_open: bool, prefill_chunk_tokens: int) -> InFlight:
    """What may run at the stages before a round's last frame: the other jobs' frames in
    flight, and while another job is open one prefill chunk of it that may join the
    forward the round's frame runs in (a stage batches what waits)."""
    if not others_open:
        return others
    return InFlight(others.frames + 1, others.rows + prefill_chunk_tokens)


class RowsInFlight:
    """Frames sent to a ring's head whose Result has not come back, by (job, round)."""

    def __init__(self) -> None:
        self._frames: dict[tuple[str, int], tuple[int, int]] = {}  # (job, round) -> (epoch, rows)
        self._epoch = -1

    def sent(self, job_id: str, round: int, epoch: int, rows: int) -> None:
        if epoch > self._epoch:  # a new ring: the old one's frames will not come back
            self._epoch = epoch
            self._frames = {k: v for k, v in self._frames.items() if v[0] >= epoch}
        self._frames[(job_id, round)] = (epoch, rows)

    def arrived(self, job_id: str, round: int) -> None:
        self._frames.pop((job_id, round), None)

    def job_ended(self, job_id: str) -> None:
        for key in [k for k in self._frames if k[0] == job_id]:
            del self._frames[key]

    def others(self, epoch: int, job_id: str) -> InFlight:
        """What jobs other than `job_id` have in flight on ring `epoch`."""
        mine = [rows for (job, _), (e, rows) in self._frames.items() if e == epoch and job != job_id]
        return InFlight(len(mine), sum(mine))

    def __len__(self) -> int:
        return len(self._frames)


class Liveness:
    """Deadlines and stall blame for the rounds of every job on the swarm's rings."""

    def __init__(self, swarm: Swarm, frame_timeout_s: float, prefill_chunk_tokens: int) -> None:
        self.swarm = swarm
        self.policy = DeadlinePolicy(max_s=frame_timeout_s)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.in_flight = RowsInFlight()
        self._open: set[str] = set()  # jobs that may send a frame at any moment
        self.served: dict[PeerId, int] = {}  # rounds each peer served as a stage
        self.missed: dict[PeerId, int] = {}  # missed rounds each peer was part of
        self._blamed_epoch = -1  # one stage sits out per ring that misses, however many jobs missed
        self.clock = time.monotonic
        self._answered: dict[int, float] = {}  # ring epoch -> when a Result last came back on it
        self._timers: dict[int, set[tuple]] = {}  # ring epoch -> (scope, step s, cap at) of rounds awaited
        self._busy_misses: dict[int, int] = {}  # ring epoch -> rounds missed while it answered (events)
        self._busy_event: dict[int, float] = {}  # ring epoch -> when the latest counted miss came
        self._predicted: tuple[object, dict] = (None, {})  # (plan, shape -> predicted traversal s)
        # prefill -> ((epoch, samples), the newest sample, the ratios of those samples)
        self._measured: dict[bool, tuple[tuple[int, int], object, list[float]]] = {}

    def job_opened(self, job_id: str) -> None:
        self._open.add(job_id)

    def job_ended(self, job_id: str) -> None:
        """The job closed: its frames still in flight no longer count (their results are
        not awaited by anyone, and a stage drops what it has of an ended job)."""
        self._open.discard(job_id)
        self.in_flight.job_ended(job_id)

    def frame_sent(self, epoch: int, body: bytes, msg: Forward | None = None) -> None:
        """A frame body the engine sent to ring `epoch`'s head (our own: it decodes), or
        the Forward `msg` it encodes (then not decoded again: ~0.1 ms a frame here)."""
        if msg is None:
            try:
                msg, _ = decode_frame(body, self.swarm.limits)
            except WireError:
                return
        if isinstance(msg, Forward):
            self.in_flight.sent(msg.job_id, msg.round, epoch, int(msg.positions.shape[0]))

    def result_arrived(self, ring: RingState, result: Result) -> None:
        self.in_flight.arrived(result.job_id, result.round)
        if result.epoch == ring.epoch:
            if ring.epoch not in self._answered:  # a new epoch: forget the old ones' (not per Result)
                self._answered = {e: t for e, t in self._answered.items() if e >= ring.epoch - 8}
                self._busy_misses = {e: n for e, n in self._busy_misses.items() if e >= ring.epoch - 8}
                self._busy_event = {e: t for e, t in self._busy_event.items() if e >= ring.epoch - 8}
            self._answered[ring.epoch] = self.clock()
            self._extend(ring.epoch)
            for peer, _ in ring.stages:
                self.served[peer] = self.served.get(peer, 0) + 1

    def deadline_s(self, ring: RingState, shape: Traversal, job_id: str) -> float:
        """The cost model's time for a round of `shape` on `ring` and for the work ahead of
        it (see the module doc), scaled by how this ring's rounds measured against it."""
        predicted, queued = None, 0.0
        if (planned := self.swarm.plan_of(ring.epoch)) is not None:
            try:
                predicted = self._predict(planned, shape)
                ahead = work_ahead(self.in_flight.others(ring.epoch, job_id), len(self._open) > 1,
                                   self.prefill_chunk_tokens)
                if ahead.rows:
                    queued = self._predict(planned, replace(shape, prefill=True, frames=ahead.frames, tokens=ahead.rows))
            except RingError:
                pass
        return round_deadline_s(predicted, self._ratios(ring.epoch, shape.prefill), shape.frames, self.policy, queued)

    def _predict(self, planned: tuple, shape: Traversal) -> float:
        """topology.predict's traversal time for `shape` on the plan (pure in what it reads:
        remembered per plan and shape, as every round of every job asks it anew)."""
        if planned is not self._predicted[0] or len(self._predicted[1]) > 4096:
            self._predicted = (planned, {})
        key = (shape.prefill, shape.frames, shape.tokens)
        got = self._predicted[1].get(key)
        if got is None:
            swarm = self.swarm
            got = self._predicted[1][key] = topology.predict(*planned, swarm.model, swarm.config.topology,
                                                             shape).traversal_s
        return got

    def _ratios(self, epoch: int, prefill: bool) -> list[float]:
        """Measured / predicted traversal time of the recent rounds of this kind on ring
        `epoch`, recomputed only when a round was recorded since."""
        samples = self.swarm.traversals.samples
        last = samples[-1] if samples else None
        got = self._measured.get(prefill)
        if got is None or got[0] != (epoch, len(samples)) or got[1] is not last:
            ratios = [t.traversal_s / p.traversal_s for t, p in samples
                      if t.epoch == epoch and t.prefill == prefill and p.traversal_s > 0]
            got = self._measured[prefill] = ((epoch, len(samples)), last, ratios)
        return got[2]

    def _extend(self, epoch: int) -> None:
        """A Result came back through ring `epoch`: the rounds awaited there whose deadline
        falls within ALIVE_WINDOW_S, or half their deadline if longer, get one more deadline
        (round_timer). Half: at 32 streams a ring that answered every job went more than
        2 s without a Result while long prompts' pieces ran, and an honest stage was blamed
        twice in 90 s (bench_load at 4c6d32a); a stalled stage's ring stops answering within
        a traversal, far less than half a deadline (>= 5 s), so it is still missed at the
        deadline after."""
        timers = self._timers.get(epoch)
        if not timers:
            return
        now = trio.current_time()
        for scope, step_s, cap_at in timers:
            if now <= scope.deadline <= now + max(ALIVE_WINDOW_S, step_s / 2):
                scope.deadline = min(scope.deadline + step_s, cap_at)

    def answering(self, epoch: int) -> bool:
        """Whether a Result came back through ring `epoch` within ALIVE_WINDOW_S."""
        answered = self._answered.get(epoch)
        return answered is not None and self.clock() - answered <= ALIVE_WINDOW_S

    @contextmanager
    def round_timer(self, ring: RingState, shape: Traversal, job_id: str) -> Iterator[None]:
        """trio.fail_after for a round of `shape` on `ring` (raises trio.TooSlowError out of
        the block): its deadline (deadline_s), soft while the ring answers (module doc):
        a Result through the ring shortly before the deadline moves it one deadline on
        (_extend), never past the policy's cap from the start."""
        step_s, now = self.deadline_s(ring, shape, job_id), trio.current_time()
        timer = (trio.CancelScope(deadline=now + step_s), step_s, now + max(step_s, self.policy.max_s * max(shape.frames, 1)))
        timers = self._timers.setdefault(ring.epoch, set())
        timers.add(timer)
        try:
            with timer[0]:
                yield
        finally:
            timers.discard(timer)
            if not timers:
                self._timers.pop(ring.epoch, None)
        if timer[0].cancelled_caught:
            raise trio.TooSlowError

    def round_missed(self, ring: RingState, round: int) -> None:
        """A round on `ring` missed its deadline: unless the ring changed meanwhile (its
        stages were told to stop), one stage sits out and the ring re-forms."""
        if self.swarm.ring_by_epoch(ring.epoch) is None or ring.epoch <= self._blamed_epoch:
            return
        answered = self._answered.get(ring.epoch)
        if self.answering(ring.epoch):
            last = self._busy_event.get(ring.epoch)
            if last is not None and self.clock() - last < SAME_EVENT_S:
                log.warning("round %d missed its deadline on ring epoch %d %.3f s after another miss there: the same "
                            "event, counted once", round, ring.epoch, self.clock() - last)
                return
            self._busy_event[ring.epoch] = self.clock()
            misses = self._busy_misses[ring.epoch] = self._busy_misses.get(ring.epoch, 0) + 1
            if misses < BUSY_MISSES_BEFORE_BLAME:
                log.warning("round %d missed its deadline on ring epoch %d, which answered another round %.1f s ago: "
                            "busy, not stalled; no stage blamed (%d of %d such misses)", round, ring.epoch,
                            self.clock() - answered, misses, BUSY_MISSES_BEFORE_BLAME)
                return
        self._blamed_epoch = ring.epoch
        stages = [p for p, _ in ring.stages]
        for peer in stages:
            self.missed[peer] = self.missed.get(peer, 0) + 1
        suspect = stall_suspect(stages, self.served, self.missed)
        self.swarm.report_unreachable(suspect, f"round {round} on ring epoch {ring.epoch} missed its deadline "
                                      f"({len(stages)} stages; it served {self.served.get(suspect, 0)} rounds)", "stalled")

