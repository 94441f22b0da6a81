"""The auditor's requests that await a reply on a peer's control stream.

An audit asks a stage for its logged frames (AuditRequest) and a verifier for a
recomputation (VerifyRequest, past one control frame in VerifyParts: shard.verify_parts).
Replies arrive on the swarm's control streams, read by one task, which hands each to
`on_reply`: it goes to the request waiting for it by (peer, request id), a reply in parts
once put back together. Replies nobody awaits (late, from another peer, or of another
kind than the request's) are dropped unread. `fetch_logged` is the audit's ranged fetch of a
stage's logged frames; it builds no other request and reads no verify reply's content
(coordinator.trust.audit does).
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import trio

from coordinator.trust.audit_plan import AuditPlan
from ring import PeerId
from shard.errors import ShardError, WireError
from shard.verify_parts import Uploads, assemble, upload_cap
from shard.wire.audit_frames import MAX_AUDIT_ITEMS, AuditReply, AuditRequest, items, read_reply
from shard.wire.limits import Limits
from shard.wire.verify import VerifyPart, VerifyReply

R = TypeVar("R", AuditReply, VerifyReply)
log = logging.getLogger("shard.coordinator")


class AwaitedReplies:
    def __init__(self, send_control: Callable[[PeerId, object], Awaitable[None]],
                 limits: Callable[[], Limits]) -> None:
        """`send_control`: Swarm.send_control; `limits`: the swarm's control limits (read
        when a reply in parts first arrives)."""
        self._send, self._limits = send_control, limits
        self._waiting: dict[tuple[PeerId, int], list] = {}  # (peer, request id) -> [Event, reply, its type]
        self._ids = itertools.count()
        self._parts: Uploads | None = None  # made on first use: `parts`
        # One request in parts at a time per peer: a node holds MAX_OPEN_UPLOADS open.
        self._sending_parts: collections.defaultdict[PeerId, trio.Lock] = collections.defaultdict(trio.Lock)

    def next_id(self) -> int:
        return next(self._ids)

    @property
    def parts(self) -> Uploads:
        """Verify replies past one control frame being put back together (only those awaited)."""
        if self._parts is None:
            self._parts = Uploads(upload_cap(self._limits()), max_open=4)
        return self._parts

    async def ask(self, peer: PeerId, request_id: int, messages: Sequence[object], kind: type[R], timeout_s: float,
                  *, in_parts: bool = False) -> R:
        """Send `messages` (one request, or its parts: `in_parts`, sent one request at a time
        per peer) to `peer`; the reply of type `kind` to `request_id`. Error handling:
        TransportError from sending, trio.TooSlowError when no reply came within timeout_s.
        Resource handling: the wait and any reply parts half put together are dropped
        however it ends."""
        key = (peer, request_id)
        slot = self._waiting[key] = [trio.Event(), None, kind]
        try:
            if in_parts:
                async with self._sending_parts[peer]:
                    for message in messages:
                        await self._send(peer, message)
            else:
                for message in messages:
                    await self._send(peer, message)
            with trio.fail_after(timeout_s):
                await slot[0].wait()
        finally:
            self._waiting.pop(key, None)
            if self._parts is not None:
                self._parts.drop(peer, request_id)  # a reply cut short holds nothing after
        return slot[1]

    def on_reply(self, peer: PeerId, reply: AuditReply | VerifyReply | VerifyPart) -> None:
        if isinstance(reply, VerifyPart):
            if (peer, reply.request_id) not in self._waiting:
                return  # parts nobody awaits are dropped unread
            try:
                data = self.parts.add(peer, reply)
                if data is None:
                    return
                reply = assemble(data, self._limits(), self.parts.cap, VerifyReply, reply.request_id)
            except ShardError as exc:
                reply = VerifyReply(request_id=reply.request_id, error=f"its reply's parts: {exc}"[:1024])
        slot = self._waiting.get((peer, reply.request_id))
        if slot is not None and isinstance(reply, slot[2]):  # others nobody asked for: dropped
            slot[1] = reply
            slot[0].set()


async def fetch_logged(replies: AwaitedReplies, plan: AuditPlan, reply_bytes: int,
                       timeout_s: float) -> dict[int, tuple[bytes, bytes]]:
    """Both logged frames of every round of `plan` from its stage: ranged AuditRequests, each
    answered with as many frames as fit `reply_bytes`, until every item is answered. A
    malformed reply leaves the rest unfetched (the stage kept no record of them, as far as
    the audit is concerned). Error handling: TransportError or TooSlowError is re-raised."""
    wanted, got = items(plan.rounds), []
    while len(got) < len(wanted):
        batch = wanted[len(got):len(got) + MAX_AUDIT_ITEMS]
        req = AuditRequest(request_id=replies.next_id(), job_id=plan.job_id, epoch=plan.epoch,
                           rounds=tuple(r for r, _ in batch), sides=tuple(side for _, side in batch),
                           max_bytes=reply_bytes)
        try:
            reply = await replies.ask(plan.peer_id, req.request_id, [req], AuditReply, timeout_s)
            got += read_reply(req, reply)
        except WireError as exc:
            log.warning("audit of %s on job %s: %s; its other frames count as not kept", plan.peer_id,
                        plan.job_id, exc)
            break
    frames = dict(zip(wanted, got))
    return {r: (frames[r, "input"], frames[r, "output"]) for r in plan.rounds   # type: ignore[misc]
            if frames.get((r, "input")) is not None and frames.get((r, "output")) is not None}
