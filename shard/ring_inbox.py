"""A stage's inbound ring edge: which ring streams it reads, and how long a frame may take.

Each stream's remote peer is checked against the current epoch's predecessor before
every frame's length prefix is read, so a stranger's frame is never read, let alone
buffered (its stream is reset unread). A frame's body must follow its prefix within a
`BodyDeadline`, so a trickling sender cannot hold a stream and its half-read frame. A
peer holds at most `max_streams_per_peer` ring streams: a newer one closes its oldest (a
predecessor moves to a new stream each epoch; one that opens streams in a loop only churns
its own). Frames read are handed, in order, to `serve_frame` (the node decodes them and
queues them for its scheduler, which batches the frames of every stream), at most
INBOX_FRAMES ahead; an exception out of `serve_frame` costs that frame alone (logged), never
the stream and the other jobs' frames behind it. Does not decode frames, know jobs or
compute anything.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from shard.errors import ShardError, TransportError, WireError
from shard.transport import BodyDeadline, FramedStream

log = logging.getLogger("shard.node")

# Frames read off a ring stream ahead of the one being computed: the predecessor's upload
# then lands while this stage computes instead of after (a muxed stream's window would
# otherwise stall a large frame until the reader comes back).
INBOX_FRAMES = 2


@dataclass(frozen=True)
class InboxConfig:
    """Bounds on what one peer's ring streams may hold; the only home of these defaults."""

    body_deadline: BodyDeadline = BodyDeadline()
    # One stream per epoch is what a predecessor needs; the second covers the overlap
    # while an epoch changes.
    max_streams_per_peer: int = 2


@dataclass
class RingInbox:
    """`accepts(peer_id)`: whether that peer is this epoch's predecessor now.
    `serve_frame(peer_id, body)`: handle one frame body; False ends the stream (raising does not).
    `max_frame_bytes()`: the current bound on a frame's length."""

    accepts: Callable[[str], bool]
    serve_frame: Callable[[str, bytes], Awaitable[bool]]
    max_frame_bytes: Callable[[], int]
    config: InboxConfig = InboxConfig()
    _streams: dict[str, list[trio.CancelScope]] = field(default_factory=dict)

    async def serve(self, stream: FramedStream) -> None:
        """Serve one incoming ring stream until it ends, breaks, is refused or is displaced.
        Error handling: every failure is logged and ends this stream only. Resource
        handling: the stream is closed (reset when refused or out of sync) on return."""
        remote = stream.remote_peer_id
        if not self.accepts(remote):
            log.warning("refused a ring stream from %s: not this epoch's predecessor", remote)
            await _reset(stream)
            return
        scope = trio.CancelScope()
        mine = self._streams.setdefault(remote, [])
        mine.append(scope)
        while len(mine) > self.config.max_streams_per_peer:
            log.info("ring stream from %s displaced by a newer one", remote)
            mine.pop(0).cancel()
        clean = False
        try:
            with scope:
                clean = await self._serve(stream, remote)
        finally:
            if scope in mine:  # a displaced stream's scope was already taken out
                mine.remove(scope)
            if not mine and self._streams.get(remote) is mine:
                del self._streams[remote]
            if clean:
                await stream.aclose()
            else:
                await _reset(stream)

    async def _serve(self, stream: FramedStream, remote: str) -> bool:
        """Read ahead and serve in order; True if the stream ended at a frame boundary."""
        inbox_send, inbox = trio.open_memory_channel(INBOX_FRAMES)
        ended: list[bool] = [False]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read, stream, remote, inbox_send, ended)
            async for body in inbox:
                if not await self._serve_one(remote, body):
                    nursery.cancel_scope.cancel()
                    return False
        return ended[0]

    async def _serve_one(self, remote: str, body: bytes) -> bool:
        """serve_frame(remote, body); what it raises (a bug, or the node's control stream lost
        mid-answer) is logged and drops that frame only: the frames behind it on this stream
        are other jobs', and resetting the stream would cost them too."""
        try:
            return await self.serve_frame(remote, body)
        except ShardError as exc:
            log.warning("dropped a frame from %s: serving it failed: %s", remote, exc)
        except Exception as exc:  # noqa: BLE001 (a bug: its traceback follows)
            log.exception("dropped a frame from %s: serving it raised %s: %s", remote, type(exc).__name__, exc)
        return True

    async def _read(self, stream: FramedStream, remote: str, inbox: trio.MemorySendChannel, ended: list[bool]) -> None:
        """Read frames into `inbox` while `remote` is the predecessor, until the stream ends
        (ended[0] = True) or breaks; closing `inbox` then ends the serving loop once the
        frames already read are served."""
        async with inbox:
            while True:
                if not self.accepts(remote):
                    log.warning("closing ring stream from %s: no longer the predecessor", remote)
                    return
                try:
                    body = await stream.recv_frame(self.max_frame_bytes(), self.config.body_deadline)
                except WireError as exc:  # a length past the cap: the stream is out of sync
                    log.warning("closing ring stream from %s: %s", remote, exc)
                    return
                except TransportError as exc:
                    log.info("ring stream from %s ended: %s", remote, exc)
                    ended[0] = getattr(exc, "received_bytes", None) == 0
                    return
                await inbox.send(body)


async def _reset(stream: FramedStream) -> None:
    with trio.CancelScope(shield=True):
        try:
            await stream.reset()
        except Exception:  # already gone
            pass
