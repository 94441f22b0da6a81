"""A stage's bounded log of the canonical bytes it received and sent, for audits.

Receipts bind a stage to digests of its input and output frames; an audit asks the stage
for those bytes later (shard.wire.codec defines them: a frame up to its trailer), hashes them against the signed
receipt, and recomputes the slice. Recomputing a decode frame needs the KV state the
stage had, so the log keeps every frame of a (job, epoch) in processing order until the
job ends plus `grace_s`, and the auditor replays them on a fresh cache.

Bounded by total bytes and by number of jobs: past either bound the oldest job (ended
ones first) is dropped whole, since a partial job cannot be replayed. A job the stage
abandoned (freed for idleness: it never got an EndJob, so no coordinator finished it) is
kept only within the much smaller `max_abandoned_bytes`: a predecessor opening jobs it
never ends otherwise filled the log to max_jobs and kept it there for grace_s. A dropped record is
what an audit reports as missing, so bounds must cover the audit window: the coordinator
does not audit a job that waited longer than its max_job_age_s (240 s), which must stay
below grace_s, and max_bytes must hold every job ended within that window
(docs/receipts.md). Once the coordinator has decided a job's audits, it tells the stage which
(job, epoch) no audit will ask for (ReleaseFrames, shard.audit_answers) and `release` drops
them at once, so under load the log holds the jobs running and those awaiting an audit,
not five minutes of every job; grace_s stays the bound for a coordinator that never says.

Thread-safe: the stage's worker thread records while the node's trio task answers
audits. Knows nothing of keys, receipts, streams or models.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FrameLogConfig:
    max_bytes: int = 512 << 20  # input + output bytes of all logged frames
    max_jobs: int = 1024  # (job, epoch) entries
    grace_s: float = 300.0  # how long an ended job stays auditable
    # Frames of abandoned jobs kept (oldest dropped first). 1024 never-ended 1-6 token
    # jobs of a 10-layer SmolLM2 stage held 16 MB here.
    max_abandoned_bytes: int = 4 << 20


@dataclass(frozen=True)
class FrameRecord:
    round: int
    input_frame: bytes  # canonical bytes received (shard.wire.codec)
    output_frame: bytes  # canonical bytes sent


@dataclass
class _JobLog:
    frames: list[FrameRecord] = field(default_factory=list)
    nbytes: int = 0
    ended_s: float | None = None  # clock time EndJob arrived; None while running
    abandoned: bool = False  # ended by the stage for idleness, not by an EndJob
    # Released by the coordinator before the stage saw the job end (its ReleaseFrames raced
    # the EndJob or a round still in flight): frames of it are not kept, and its end drops it.
    released: bool = False


class FrameLog:
    def __init__(self, config: FrameLogConfig = FrameLogConfig(), clock=time.monotonic) -> None:
        self.config, self._clock = config, clock
        self._jobs: OrderedDict[tuple[str, int], _JobLog] = OrderedDict()  # oldest first
        self._nbytes = 0
        self._abandoned_bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def record(self, job_id: str, epoch: int, round: int, input_frame: bytes, output_frame: bytes) -> None:
        """Append one processed frame. A single frame larger than max_bytes is not kept."""
        size = len(input_frame) + len(output_frame)
        with self._lock:
            key = (job_id, epoch)
            log = self._jobs.get(key)
            if log is None:
                log = self._jobs[key] = _JobLog()
            if log.released:  # a round in flight when the coordinator finished the job: no audit asks for it
                return
            log.frames.append(FrameRecord(round, input_frame, output_frame))
            log.nbytes += size
            self._nbytes += size
            if log.abandoned:  # a late frame of a job the stage already gave up on
                self._abandoned_bytes += size
            self._evict_locked()

    def end_job(self, job_id: str) -> None:
        """Start the grace period of every epoch of `job_id`."""
        now = self._clock()
        with self._lock:
            for key, log in list(self._jobs.items()):
                if key[0] == job_id and log.released:
                    self._drop_locked(key)
                elif key[0] == job_id and log.ended_s is None:
                    log.ended_s = now
            self._evict_locked()

    def release(self, job_id: str, epoch: int) -> int:
        """Drop the job's frames on `epoch` now: the coordinator will not audit them. A job
        not ended here yet keeps an empty entry until its end, so late frames of it are not
        kept either; an unknown job changes nothing (no entry is made for it). Returns the
        bytes freed."""
        with self._lock:
            key = (job_id, epoch)
            log = self._jobs.get(key)
            if log is None:
                return 0
            freed = log.nbytes
            if log.ended_s is not None:
                self._drop_locked(key)
                return freed
            self._nbytes -= freed
            log.frames, log.nbytes, log.released = [], 0, True
            return freed

    def abandon(self, job_id: str) -> None:
        """end_job for a job the stage gave up on (no EndJob came): its frames count
        against max_abandoned_bytes from now on."""
        now = self._clock()
        with self._lock:
            for (jid, _), log in self._jobs.items():
                if jid == job_id and log.ended_s is None:  # a released one holds 0 bytes: ages out as abandoned
                    log.ended_s, log.abandoned = now, True
                    self._abandoned_bytes += log.nbytes
            self._evict_locked()

    def sweep(self) -> int:
        """Drop what is past its grace or bounds now, and return the bytes still held.
        record and end_job do it too, but a stage with no traffic calls neither, and an
        idle node kept every ended job's frames (up to max_bytes) for good (issue 21)."""
        with self._lock:
            self._evict_locked()
            return self._nbytes

    def frames(self, job_id: str, epoch: int) -> list[FrameRecord]:
        """The job's frames on this epoch in processing order ([] if none are kept)."""
        with self._lock:
            self._evict_locked()
            log = self._jobs.get((job_id, epoch))
            return list(log.frames) if log is not None else []

    def get(self, job_id: str, epoch: int, round: int) -> FrameRecord | None:
        """The last frame of `round` (a round is processed once per epoch; last wins)."""
        for rec in reversed(self.frames(job_id, epoch)):
            if rec.round == round:
                return rec
        return None

    def _evict_locked(self) -> None:
        now, cfg = self._clock(), self.config
        for key in [k for k, log in self._jobs.items() if log.ended_s is not None and now - log.ended_s > cfg.grace_s]:
            self._drop_locked(key)
        while self._abandoned_bytes > cfg.max_abandoned_bytes:
            self._drop_locked(next(k for k, log in self._jobs.items() if log.abandoned))
        while self._jobs and (self._nbytes > cfg.max_bytes or len(self._jobs) > cfg.max_jobs):
            ended = [k for k, log in self._jobs.items() if log.ended_s is not None or log.released]
            self._drop_locked(ended[0] if ended else next(iter(self._jobs)))

    def _drop_locked(self, key: tuple[str, int]) -> None:
        log = self._jobs.pop(key)
        self._nbytes -= log.nbytes
        if log.abandoned:
            self._abandoned_bytes -= log.nbytes
