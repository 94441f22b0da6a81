"""A stage's answers to the coordinator's audit messages, from its frame log.

AuditRequest: the logged frames it names, (round, side) items in its order, as one
AuditReply holding as many as fit the request's byte budget (at least one; a size of 0
for an item not kept; shard.wire.audit_frames).
ReleaseFrames: the (job, epoch) entries no audit will ask for are dropped at once
(FrameLog.release) and the freed heap goes back to the OS (shard.heap), so a stage under
load holds only what running jobs and pending audits need. The node hands these only what
arrives on the control stream it opened to its own coordinator (shard.node), so neither a
predecessor nor a stranger can make it drop frames it may be audited on. It knows nothing
of streams, keys or receipts.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import torch
import trio

from shard.frame_log import FrameLog
from shard.heap import return_freed_heap
from shard.wire.codec import encode
from shard.wire.messages import AuditReply, AuditRequest
from shard.wire.release_frames import ReleaseFrames


async def reply(frame_log: FrameLog, msg: AuditRequest | ReleaseFrames, send: Callable[[bytes], Awaitable[None]]) -> None:
    """Answer `msg`, the reply's bytes built in a worker thread, then `send` them. A reply
    holds up to 1 MiB of frames (AuditConfig.fetch_reply_bytes): built and encoded on the
    node's trio thread, it stopped the ring's frames there for up to 13 ms at 16 streams
    (issue 21); the log is thread-safe, and a release's heap trim runs there too."""
    body = await trio.to_thread.run_sync(_encoded_answer, frame_log, msg)
    if body is not None:
        await send(body)


def _encoded_answer(frame_log: FrameLog, msg: AuditRequest | ReleaseFrames) -> bytes | None:
    reply = answer(frame_log, msg)
    return None if reply is None else encode(reply)


def answer(frame_log: FrameLog, msg: AuditRequest | ReleaseFrames) -> AuditReply | None:
    """The reply to send the coordinator (None: none is due)."""
    if isinstance(msg, ReleaseFrames):
        freed = sum(frame_log.release(job_id, epoch) for job_id, epoch in zip(msg.job_ids, msg.epochs))
        if freed:  # one message a second at most (the coordinator batches): a trim's walk is affordable
            return_freed_heap()
        return None
    sizes: list[int] = []
    data = bytearray()
    # The job's log read once (a round is logged once per epoch; the last record wins, as in
    # FrameLog.get): one get per item copied the log and swept the bounds each time, so a
    # 256-round job's request (512 items) took ~10 ms of the node's trio thread (issue 21).
    records = {rec.round: rec for rec in frame_log.frames(msg.job_id, msg.epoch)}
    for round_, side in zip(msg.rounds, msg.sides):
        rec = records.get(round_)
        frame = None if rec is None else (rec.input_frame if side == "input" else rec.output_frame)
        n = 0 if frame is None else len(frame)
        if sizes and len(data) + n > msg.max_bytes:
            break  # the coordinator asks again for the rest
        sizes.append(n)
        if frame is not None:
            data += frame
    frames = torch.frombuffer(data, dtype=torch.uint8) if data else None  # (sum(sizes),)
    return AuditReply(request_id=msg.request_id, sizes=tuple(sizes), frames=frames)
