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

import torch

from shard.frame_log import FrameLog
from shard.heap import return_freed_heap
from shard.wire.messages import AuditReply, AuditRequest
from shard.wire.release_frames import ReleaseFrames


def answer(frame_log: FrameLog, msg: AuditRequest | ReleaseFrames) -> AuditReply | None:
    """The reply to send the coordinator (None: none is due)."""
    if isinstance(msg, ReleaseFrames):
        freed = sum(frame_log.release(job_id, epoch) for job_id, epoch in zip(msg.job_ids, msg.epochs))
        if freed:  # one message a second at most (the coordinator batches): a trim's walk is affordable
            return_freed_heap()
        return None
    sizes: list[int] = []
    data = bytearray()
    for round_, side in zip(msg.rounds, msg.sides):
        rec = frame_log.get(msg.job_id, msg.epoch, round_)
        frame = None if rec is None else (rec.input_frame if side == "input" else rec.output_frame)
        n = 0 if frame is None else len(frame)
        if sizes and len(data) + n > msg.max_bytes:
            break  # the coordinator asks again for the rest
        sizes.append(n)
        if frame is not None:
            data += frame
    frames = torch.frombuffer(data, dtype=torch.uint8) if data else None  # (sum(sizes),)
    return AuditReply(request_id=msg.request_id, sizes=tuple(sizes), frames=frames)
