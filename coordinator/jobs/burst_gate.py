"""The gateway's frames of one LM-head product leave for the head stage in one write.

After a head product (coordinator.jobs.head_batch) each of its jobs commits its tokens,
writes its stream's event and sends its next frame, one job task after another on the
gateway's one trio thread: at 16 streams a product's frames used to leave over tens of
milliseconds, and the head stage, which waits at most `--burst-wait-ms` for a burst's
rest, ran them as several small forwards, a split each group kept ring hop after ring hop
(stage forwards of 3-4 frames where 16 jobs were in flight). Here a frame stamped with
its product's burst waits for the product's other jobs' frames (each job sends one, or
leaves: `leave`, when it ended instead), up to `gather_s` after the burst's first frame,
and the frames that came go in one write per ring (`flush`), re-stamped as a burst of
exactly those frames, so the head stage has the whole group at once and waits for nothing.

A frame without a burst (a lone job's, a prefill chunk after the first, an EndJob) goes
at once, as before. A frame that comes once its burst's write began goes alone. Whatever `flush`
raises reaches every job whose frame was in it (the frames were bound for the same
stream). Knows nothing of rings beyond grouping frames by the one they go to.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from shard.wire.codec import encode_trailer
from shard.wire.messages import Forward

log = logging.getLogger("coordinator.jobs")

# The longest a burst's first frame waits for the others (measured on the 2-core dev VM
# at 16 streams: a product's jobs sent their frames over 5-15 ms after it).
GATHER_S = 0.015
TALLY_EVERY_S = 10.0


@dataclass(eq=False)
class _Gathering:
    size: int  # the product's jobs
    frames: list[tuple[object, bytes, Forward]] = field(default_factory=list)  # (ring, body, forward)
    left: int = 0  # jobs that ended instead of sending
    complete: trio.Event = field(default_factory=trio.Event)
    sent: trio.Event = field(default_factory=trio.Event)
    error: BaseException | None = None
    opened_s: float = 0.0  # trio time of its first frame
    closed: bool = False  # its write took the frames that came: a later one goes alone

    def check(self) -> None:
        if len(self.frames) + self.left >= self.size:
            self.complete.set()


class BurstGate:
    """Holds a head product's frames until all its jobs sent (or `gather_s` passed), then
    hands them to `flush(ring, bodies)` together, one call per ring they go to."""

    def __init__(self, flush: Callable[[object, list[bytes]], Awaitable[None]], gather_s: float = GATHER_S) -> None:
        self.flush, self.gather_s = flush, gather_s
        self._open: dict[int, _Gathering] = {}  # burst id -> its frames so far
        self._stamped = 0  # the last burst id this gate stamped
        self._tally = (0.0, 0, 0, 0)  # since, writes, frames, writes cut short by gather_s

    async def send(self, ring: object, body: bytes, fwd: Forward | None = None) -> None:
        """Send `body` (`fwd`, the Forward it encodes, if one) to `ring`'s head, with the
        rest of its burst when it has one. Raises what `flush` raises for its write."""
        burst = fwd.burst if fwd is not None else ()
        if len(burst) != 2 or burst[1] < 2:
            await self.flush(ring, [body])
            return
        entry = self._open.get(burst[0])
        if entry is not None and entry.closed:  # its burst left or is leaving: alone, announcing no company
            await self.flush(ring, [restamp(body, fwd, ())])
            return
        if entry is None:
            entry = self._open[burst[0]] = _Gathering(burst[1], opened_s=trio.current_time())
            entry.frames.append((ring, body, fwd))
            entry.check()
            await self._lead(entry)
        else:
            entry.frames.append((ring, body, fwd))
            entry.check()
            await entry.sent.wait()
        if entry.error is not None:
            raise entry.error

    def leave(self, burst: tuple[int, ...]) -> None:
        """A job of this burst ended: no frame of it is to come."""
        if len(burst) == 2 and (entry := self._open.get(burst[0])) is not None:
            entry.left += 1
            entry.check()

    async def _lead(self, entry: _Gathering) -> None:
        """The burst's first frame: wait for the rest (bounded), then write them all."""
        cut_short = False
        try:
            with trio.move_on_after(self.gather_s):
                await entry.complete.wait()
            cut_short = not entry.complete.is_set()
        finally:
            # Closed before the write's first await: a frame that came while the write was under
            # way joined a list already taken and was never sent (its job waited out the round's
            # cap for a Result that could not come; tests/coordinator/jobs/test_burst_gate.py).
            entry.closed = True
            with trio.CancelScope(shield=True):  # the others' frames go even if this job is cancelled
                self._forget_old()
                try:
                    await self._write(entry.frames)
                except BaseException as exc:  # noqa: BLE001 - every job of the write gets it
                    entry.error = exc
                finally:
                    entry.sent.set()
            self._count(len(entry.frames), cut_short)

    async def _write(self, frames: list[tuple[object, bytes, Forward]]) -> None:
        """One write per ring, each frame re-stamped as one of exactly the frames in it."""
        by_ring: dict[int, tuple[object, list[tuple[bytes, Forward]]]] = {}
        for ring, body, fwd in frames:
            by_ring.setdefault(id(ring), (ring, []))[1].append((body, fwd))
        for ring, members in by_ring.values():
            stamp = ()
            if len(members) > 1:
                self._stamped = (self._stamped + 1) % (1 << 32)
                stamp = (self._stamped, len(members))
            await self.flush(ring, [restamp(body, fwd, stamp) for body, fwd in members])

    def _forget_old(self) -> None:
        """Bursts that left over a second ago (a frame of one that comes later goes alone anyway)."""
        if len(self._open) > 256:
            now = trio.current_time()
            self._open = {k: v for k, v in self._open.items() if not v.sent.is_set() or now - v.opened_s <= 1.0}

    def _count(self, frames: int, cut_short: bool) -> None:
        now, t = trio.current_time(), self._tally
        if now - t[0] >= TALLY_EVERY_S:
            if t[1]:
                log.info("burst gate: %d writes in %.0f s, %.1f frames each, %d cut short by the %.0f ms bound",
                         t[1], now - t[0], t[2] / t[1], t[3], 1e3 * self.gather_s)
            t = (now, 0, 0, 0)
        self._tally = (t[0], t[1] + 1, t[2] + frames, t[3] + int(cut_short))


def restamp(body: bytes, fwd: Forward, burst: tuple[int, ...]) -> bytes:
    """`body` (fwd's canonical bytes, then its trailer) with the trailer's burst set to `burst`."""
    old = encode_trailer(fwd)
    return body[: len(body) - len(old)] + encode_trailer(dataclasses.replace(fwd, burst=burst))
