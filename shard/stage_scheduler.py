"""A stage's waiting frames and the one task that runs them, several jobs per forward (issue 21).

Frames decoded off every ring stream wait here in arrival order. One task takes what is
waiting now (shard.batch_plan.take_batch: the oldest, at most one frame per job, a token
budget shared by prefill chunks and decode rows) and hands it to `run_batch`, which runs
it as one forward and sends each frame's outcome on its own. A frame never waits for
company: when the task is free and one frame waits, that frame runs alone at once; frames
that arrive while a forward runs share the next one. Frames of an epoch the node no
longer serves are dropped unrun (their outputs would be dropped unsent anyway).

Bounded: at most `max_waiting_frames` frames and `max_waiting_bytes` of frame bodies wait
(one frame is always let in, however large); past them `submit` blocks, so the ring
stream stops being read and the predecessor's sends back up (yamux's window).
Does not decode frames, know peers, tensors or streams, or send anything itself.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from shard.batch_plan import DEFAULT_TOKEN_BUDGET, take_batch

log = logging.getLogger("shard.node")


@dataclass(frozen=True)
class SchedulerConfig:
    """Bounds on a stage's waiting frames and its forwards; the only home of these defaults."""

    # Rows one forward may carry across jobs (shard.batch_plan); 1 runs one frame per forward.
    token_budget: int = DEFAULT_TOKEN_BUDGET
    # Enough for every frame of 64 jobs' pipelined rounds (4 in flight each) to wait at once.
    max_waiting_frames: int = 256
    # A few of the largest frames (2048 tokens of a 4096-wide model in f32 is 32 MiB).
    max_waiting_bytes: int = 128 << 20


@dataclass(frozen=True)
class Waiting:
    """One frame waiting for a forward: the epoch state it arrived under, the decoded
    message, its canonical bytes as received, its rows and the bytes it holds."""

    state: object
    msg: object
    received: memoryview
    job_id: str
    rows: int
    nbytes: int


class StageScheduler:
    """`current()`: the epoch state frames are served under now (None: off the ring).
    `run_batch(state, frames)`: run frames of distinct jobs (arrival order) as one forward
    and deliver each one's outcome; it must not raise for a frame's fault."""

    def __init__(self, current: Callable[[], object], run_batch: Callable[[object, list[Waiting]], Awaitable[None]],
                 config: SchedulerConfig = SchedulerConfig()) -> None:
        self.current, self.run_batch, self.config = current, run_batch, config
        self.waiting: list[Waiting] = []
        self.waiting_bytes = 0
        self._changed = trio.Event()  # set (and replaced) whenever a frame arrives or leaves
        self.forwards = 0  # batches run, and frames they carried (for tests and benchmarks)
        self.frames_run = 0

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _full(self, nbytes: int) -> bool:
        cfg = self.config
        return bool(self.waiting) and (len(self.waiting) >= cfg.max_waiting_frames
                                       or self.waiting_bytes + nbytes > cfg.max_waiting_bytes)

    async def submit(self, frame: Waiting) -> None:
        """Queue a frame; blocks while the bounds are reached (backpressure on its stream)."""
        while self._full(frame.nbytes):
            await self._changed.wait()
        self.waiting.append(frame)
        self.waiting_bytes += frame.nbytes
        self._notify()

    def take_nowait(self) -> tuple[object, list[Waiting]]:
        """The next batch of frames waiting now, removed from the queue, and the state they
        run under; frames of a state no longer current are dropped first. ([], if none.)"""
        state = self.current()
        stale = [w for w in self.waiting if w.state is not state]
        if stale:
            log.info("dropped %d waiting frames of a former epoch", len(stale))
        live = [w for w in self.waiting if w.state is state]
        picked = take_batch([(w.job_id, w.rows) for w in live], self.config.token_budget)
        batch = [live[i] for i in picked]
        chosen = set(picked)
        self.waiting = [w for i, w in enumerate(live) if i not in chosen]
        self.waiting_bytes = sum(w.nbytes for w in self.waiting)
        if stale or batch:
            self._notify()
        return state, batch

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run batches until cancelled, each as soon as the previous one is done and a frame
        waits. Error handling: run_batch owns each frame's failure; an exception escaping
        it is a bug and ends the node's session. Resource handling: none held."""
        task_status.started()
        while True:
            while not self.waiting:
                await self._changed.wait()
            state, batch = self.take_nowait()
            if batch:
                self.forwards += 1
                self.frames_run += len(batch)
                await self.run_batch(state, batch)
