"""A stage's waiting frames and the one task that runs them, several jobs per forward (issue 21).

Frames decoded off every ring stream wait here in arrival order. One task takes what is
waiting now (shard.batch_plan.plan_batch: the oldest, at most one frame per job, a token
budget shared by prefill chunks and decode rows, prefill shortest remaining prompt first)
and hands it to `run_batch`, which runs it as one forward and sends each frame's outcome
on its own. A frame never waits for
company: when the task is free and one frame waits, that frame runs alone at once; frames
that arrive while a forward runs share the next one. Frames of an epoch the node no
longer serves are dropped unrun (their outputs would be dropped unsent anyway).
Bursts (shard.wire.trailer): frames a predecessor sent together say so; about to start a
forward while a waiting frame's burst has not all arrived, the task waits for the rest up
to `burst_wait_s` after that burst's latest frame (a burst still arriving keeps the wait
open) and at most `burst_span_s` after its first, so a group's frames stay in one forward
hop after hop. A lone frame (no burst) never waits: it runs at once unless a burst beside
it is still arriving.

A long prefill chunk runs in pieces while decode rows are about (waiting now, or taken
within `busy_window_s` by a job not ended since): each forward carries one piece
(`Waiting.piece`, rows [start, stop) of the frame) beside the decode rows, the frame stays
first among its job's frames until its last piece is taken, and the worker sends its
output once, whole. A piece that fails ends its frame: run_batch names the jobs whose
frame failed and their part-done frames leave the queue.

A job's end (rows 0: its EndJob) takes its job's waiting frames out of the queue unrun (their
outputs are owed to nobody, and run they would hold or re-open its K/V), and a frame of a job
that ended here (same epoch; the last `max_ended_jobs` ends are kept) is refused at `submit`.

Bounded: at most `max_waiting_frames` frames and `max_waiting_bytes` of frame bodies, and
of the outputs a part-done frame's pieces keep, wait (one frame is always let in, however
large); past them `submit` blocks, so the ring stream stops being read and the
predecessor's sends back up (yamux's window).
Does not decode frames, know peers, tensors or streams, or send anything itself.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import trio

from shard.batch_plan import DEFAULT_MAX_PASSES, DEFAULT_PIECE_ROWS, DEFAULT_TOKEN_BUDGET, passed_over, plan_batch

log = logging.getLogger("shard.node")


@dataclass(frozen=True)
class SchedulerConfig:
    """Bounds on a stage's waiting frames and its forwards; the only home of these defaults."""

    # Rows one forward may carry across jobs (shard.batch_plan); 1 runs one frame per forward.
    token_budget: int = DEFAULT_TOKEN_BUDGET
    # Prefill rows per forward while decode rows are about (shard.batch_plan); 0: never split.
    piece_rows: int = DEFAULT_PIECE_ROWS
    # Decode rows taken this recently count as about even when none waits: a ring's decode
    # rows come back within a round trip (well under a second on a loaded loopback ring at
    # 16 streams), and a prefill chunk taken whole in that gap would stall them on return.
    busy_window_s: float = 1.0
    # Which prefill chunk gets a forward's prefill rows first (shard.batch_plan): "shortest"
    # remaining prompt, aged after max_passes forwards passed over; "arrival": oldest first.
    prefill_order: str = "shortest"
    max_passes: int = DEFAULT_MAX_PASSES
    # Enough for every frame of 64 jobs' pipelined rounds (4 in flight each) to wait at once.
    max_waiting_frames: int = 256
    # A few of the largest frames (2048 tokens of a 4096-wide model in f32 is 32 MiB).
    max_waiting_bytes: int = 128 << 20
    # How long after a burst's latest frame a forward waits for the rest of it (0: never): a
    # job that ended upstream sends nothing, so this is what it costs. Counted from the
    # latest frame, so a burst still being read is not cut: at 16 streams (2-core dev VM) a
    # whole burst of 16 frames written at once took ~4.5 ms to be read and queued here, and
    # 2 ms from its first frame split it into forwards of 7-8 (docs/batching.md, Bursts).
    burst_wait_s: float = 0.002
    # ... and never longer than this after the burst's first frame.
    burst_span_s: float = 0.02
    # Ends of jobs remembered, so that a frame arriving after its job's end is refused: a few
    # hundred bytes each, far more than the jobs one stage sees ending within a round trip.
    max_ended_jobs: int = 4096
    # How often the frames and rows per forward are logged (BatchTally), while forwards run.
    tally_every_s: float = 10.0


@dataclass(frozen=True)
class Waiting:
    """One frame waiting for a forward: the epoch state it arrived under, the decoded
    message, its canonical bytes as received, its rows (0: the job's end) and the bytes it
    holds; split_row_bytes: the output bytes per row its worker keeps while it runs in
    pieces (0: it runs whole). In a batch, `piece` is the rows [start, stop) to run now
    (None: the whole frame)."""

    state: object
    msg: object
    received: memoryview
    job_id: str
    rows: int
    nbytes: int
    split_row_bytes: int = 0
    piece: tuple[int, int] | None = None


@dataclass
class BatchTally:
    """How full a stage's forwards were since `since`: forwards by frames carried, rows
    (a job's end has none), and seconds in run_batch (forward, encode, sign, hand-off)."""

    since: float
    by_frames: dict[int, int] = dataclasses.field(default_factory=dict)  # frames per forward -> forwards
    rows: int = 0
    busy_s: float = 0.0
    waits: int = 0  # forwards that waited for a burst's rest, and for how long in all
    waited_s: float = 0.0
    by_phase: dict[str, int] = dataclasses.field(default_factory=dict)  # rows by the frame's phase (prefill, decode, verify)

    def add(self, batch: list[Waiting], busy_s: float) -> None:
        self.by_frames[len(batch)] = self.by_frames.get(len(batch), 0) + 1
        for w in batch:
            rows = w.rows if w.piece is None else w.piece[1] - w.piece[0]
            self.rows += rows
            if rows:
                phase = getattr(w.msg, "phase", "?")
                self.by_phase[phase] = self.by_phase.get(phase, 0) + rows
        self.busy_s += busy_s

    def summary(self, now: float) -> str:
        forwards = sum(self.by_frames.values())
        frames = sum(n * k for n, k in self.by_frames.items())
        spread = " ".join(f"{n}:{k}" for n, k in sorted(self.by_frames.items()))
        phases = ", ".join(f"{phase} {n}" for phase, n in sorted(self.by_phase.items())) or "no rows"
        return (f"{forwards} in {now - self.since:.0f} s, busy {self.busy_s:.1f} s; {frames / max(forwards, 1):.1f} "
                f"frames and {self.rows / max(forwards, 1):.1f} rows each ({phases}); frames per forward:count {spread}; "
                f"waited for bursts {self.waits} times, {1e3 * self.waited_s / max(self.waits, 1):.2f} ms each")


# run_batch(state, frames) -> the ids of the jobs whose frame failed (None: none).
RunBatch = Callable[[object, list[Waiting]], Awaitable[Iterable[str] | None]]


class StageScheduler:
    """`current()`: the epoch state frames are served under now (None: off the ring).
    `run_batch(state, frames)`: run frames (or pieces) of distinct jobs (arrival order) as
    one forward and deliver each one's outcome; it must not raise for a frame's fault.
    `clock()`: seconds (trio's clock by default)."""

    def __init__(self, current: Callable[[], object], run_batch: RunBatch, config: SchedulerConfig = SchedulerConfig(),
                 clock: Callable[[], float] = trio.current_time) -> None:
        self.current, self.run_batch, self.config, self.clock = current, run_batch, config, clock
        self.waiting: list[Waiting] = []
        self.waiting_bytes = 0
        self.done: dict[str, int] = {}  # job id -> rows run of its first waiting frame (part done)
        self.decoding: dict[str, float] = {}  # job id -> when its last decode or verify rows were taken
        self.passed: dict[str, int] = {}  # job id -> forwards its waiting chunk was passed over (batch_plan)
        self._changed = trio.Event()  # set (and replaced) whenever a frame arrives or leaves
        self.forwards = 0  # batches run, the frames (or pieces) they carried, and how many were pieces
        self.frames_run = 0  # (for tests and benchmarks)
        self.pieces_run = 0
        self.tally = BatchTally(self.clock())  # frames and rows per forward, logged every tally_every_s
        self.bursts: dict[tuple[int, int], list] = {}  # (id(state), burst id) -> [size, frames seen, first seen, last seen]
        self.ended: OrderedDict[tuple, None] = OrderedDict()  # (epoch, job id) of the jobs ended here, oldest first
        self.dropped_after_end = 0  # frames taken out at their job's end, or refused after it
        self.running = False  # a forward runs now (`idle`)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _full(self, nbytes: int) -> bool:
        cfg = self.config
        return bool(self.waiting) and (len(self.waiting) >= cfg.max_waiting_frames
                                       or self.waiting_bytes + nbytes > cfg.max_waiting_bytes)

    def _count_bytes(self) -> None:
        """Bodies waiting, plus the outputs part-done frames keep at their worker."""
        firsts: dict[str, Waiting] = {}
        for w in self.waiting:
            firsts.setdefault(w.job_id, w)
        kept = sum(rows * firsts[job].split_row_bytes for job, rows in self.done.items() if job in firsts)
        self.waiting_bytes = sum(w.nbytes for w in self.waiting) + kept

    def _end(self, key: tuple, end: Waiting) -> None:
        """A job's end arrived: remember it, and take its waiting frames (same epoch) out."""
        self.ended[key] = None
        self.ended.move_to_end(key)
        while len(self.ended) > self.config.max_ended_jobs:
            self.ended.popitem(last=False)
        gone = [w for w in self.waiting if w.rows and (getattr(w.msg, "epoch", None), w.job_id) == key]
        if gone:
            log.info("job %s ended: %d of its frames dropped unrun", end.job_id, len(gone))
            self.dropped_after_end += len(gone)
            self.waiting = [w for w in self.waiting if not any(w is g for g in gone)]
            self.done.pop(end.job_id, None)
            self._count_bytes()
        self._notify()  # also wakes a frame of the job waiting for room: it is refused now

    async def submit(self, frame: Waiting) -> bool:
        """Queue a frame; blocks while the bounds are reached (backpressure on its stream).
        False: refused, its job ended here (logged; nothing is queued)."""
        key = (getattr(frame.msg, "epoch", None), frame.job_id)
        if not frame.rows:
            self._end(key, frame)
        while self._full(frame.nbytes) and key not in self.ended:
            await self._changed.wait()
        if frame.rows and key in self.ended:  # arrived, or ended while it waited for room
            log.info("job %s: a frame after its end refused (its K/V stays freed)", frame.job_id)
            self.dropped_after_end += 1
            return False
        while self._full(frame.nbytes):
            await self._changed.wait()
        self.waiting.append(frame)
        self.waiting_bytes += frame.nbytes
        burst = getattr(frame.msg, "burst", ())
        if len(burst) == 2 and burst[1] > 1:
            now = self.clock()
            if len(self.bursts) > 4 * self.config.max_waiting_frames:  # long complete or given up
                horizon = max(1.0, 10 * self.config.burst_wait_s)
                self.bursts = {k: v for k, v in self.bursts.items() if now - v[2] <= horizon}
            entry = self.bursts.setdefault((id(frame.state), burst[0]), [burst[1], 0, now, now])
            entry[1] += 1
            entry[3] = now
        self._notify()
        return True

    def burst_deadline(self) -> float | None:
        """When the wait for the rest of the waiting frames' incomplete bursts ends (the
        earliest of their latest frame + burst_wait_s, capped at first frame + burst_span_s);
        None: no waiting frame's burst lacks frames."""
        deadlines = []
        for w in self.waiting:
            burst = getattr(w.msg, "burst", ())
            entry = self.bursts.get((id(w.state), burst[0])) if len(burst) == 2 else None
            if entry is not None and entry[1] < entry[0]:
                deadlines.append(min(entry[3] + self.config.burst_wait_s,
                                     entry[2] + max(self.config.burst_span_s, self.config.burst_wait_s)))
        return min(deadlines) if deadlines else None

    async def gather_bursts(self) -> None:
        """Wait until every waiting frame's burst is complete or its bound is past."""
        if self.config.burst_wait_s <= 0:
            return
        started, waited = self.clock(), False
        while (deadline := self.burst_deadline()) is not None and (left := deadline - self.clock()) > 0:
            waited = True  # one clock reading: a second one could be past the deadline (a negative wait raised)
            with trio.move_on_after(left):
                await self._changed.wait()
        if waited:
            self.tally.waits += 1
            self.tally.waited_s += self.clock() - started

    def take_nowait(self) -> tuple[object, list[Waiting]]:
        """The next batch of frames (or pieces) waiting now and the state they run under; a
        frame leaves the queue once its last piece is taken. Frames of a state no longer
        current are dropped first, part done or not. ([], if none.)"""
        state, now = self.current(), self.clock()
        stale = [w for w in self.waiting if w.state is not state]
        if stale:
            log.info("dropped %d waiting frames of a former epoch", len(stale))
            for w in stale:
                self.done.pop(w.job_id, None)
        live = [w for w in self.waiting if w.state is state]
        window = self.config.busy_window_s
        self.decoding = {job: t for job, t in self.decoding.items() if now - t <= window}
        firsts: set[str] = set()
        queued = []
        for w in live:  # only a job's first waiting frame can be part done
            done = self.done.get(w.job_id, 0) if w.job_id not in firsts else 0
            firsts.add(w.job_id)
            queued.append((w.job_id, w.rows - done, w.split_row_bytes > 0))
        ending = {w.job_id for w in live if w.rows == 0}  # a job whose end waits sends no more rows
        busy = any(job not in ending for job in self.decoding)
        cfg = self.config
        picked = plan_batch(queued, cfg.token_budget, cfg.piece_rows, busy, self.passed, cfg.prefill_order,
                            cfg.max_passes)
        self.passed = passed_over(queued, picked, self.passed)
        batch, finished = [], set()
        for i, n in picked:
            w = live[i]
            start = self.done.pop(w.job_id, 0)
            if start + n < w.rows:
                self.done[w.job_id] = start + n
            else:
                finished.add(i)
            batch.append(w if (start, n) == (0, w.rows) else dataclasses.replace(w, piece=(start, start + n)))
            if w.rows == 0:
                self.decoding.pop(w.job_id, None)  # the job ended
            elif not w.split_row_bytes:
                self.decoding[w.job_id] = now
        self.waiting = [w for i, w in enumerate(live) if i not in finished]
        for w in batch:  # the wait for these bursts is over: a straggler of one runs at once
            burst = getattr(w.msg, "burst", ())
            if len(burst) == 2 and (entry := self.bursts.get((id(w.state), burst[0]))) is not None:
                entry[0] = min(entry[0], entry[1])
        self._count_bytes()
        if stale or batch:
            self._notify()
        return state, batch

    def drop_failed(self, job_ids: Iterable[str]) -> None:
        """A failed piece ends its frame: the rest of a part-done frame of these jobs leaves."""
        for job_id in job_ids:
            if self.done.pop(job_id, None) is None:
                continue  # its frame ran whole, or its last piece was taken: nothing waits
            del self.waiting[next(i for i, w in enumerate(self.waiting) if w.job_id == job_id)]  # its first frame
            self._count_bytes()
            self._notify()

    def clear(self) -> int:
        """Drop every waiting frame, part done or not, and what the plan keeps of them (the
        node's session failed: their jobs resume elsewhere); the ends remembered stay.
        Returns how many frames were dropped."""
        dropped = len(self.waiting)
        self.waiting, self.waiting_bytes = [], 0
        self.done, self.decoding, self.passed, self.bursts = {}, {}, {}, {}
        self._notify()  # a submit waiting for room gets it
        return dropped

    async def idle(self, max_wait_s: float) -> None:
        """Return once no frame waits here and no forward runs (background work, an audit's
        replay step, may take the node's compute now without delaying a frame that waits),
        or after max_wait_s, so that such work is never starved by a stage that is never idle."""
        with trio.move_on_after(max_wait_s):
            while self.waiting or self.running:
                await self._changed.wait()

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run batches until cancelled, each as soon as the previous one is done and a frame
        waits. Error handling: run_batch owns each frame's failure and names the jobs whose
        frame failed; an exception escaping it (or this loop) is a bug: it ends the node's
        session, which starts again with the frames waiting here dropped (clear, shard.reconnect).
        Resource handling: none held."""
        task_status.started()
        while True:
            while not self.waiting:
                await self._changed.wait()
            await self.gather_bursts()
            state, batch = self.take_nowait()
            if batch:
                self.forwards += 1
                self.frames_run += len(batch)
                self.pieces_run += sum(w.piece is not None for w in batch)
                started, self.running = self.clock(), True
                try:
                    self.drop_failed(await self.run_batch(state, batch) or ())
                finally:
                    self.running = False
                    self._notify()
                self.tally.add(batch, self.clock() - started)
                if self.clock() - self.tally.since >= self.config.tally_every_s:
                    log.info("stage forwards: %s", self.tally.summary(self.clock()))
                    self.tally = BatchTally(self.clock())
