"""AuditRequest / AuditReply: an audited stage's logged frames, many in one round trip.

An audit reads back every frame a stage logged for one (job, epoch) (shard.frame_log): both
sides, input and output, of each round. One request names the (round, side) items wanted,
in order; the reply carries the canonical bytes of the longest prefix of them that fits the
request's `max_bytes` (always at least one item, however large: a frame is within the frame
cap, as the single-item reply of protocol 2 was), and the coordinator asks again for the
rest. A 160-round job's audit is one or two round trips instead of the 320 it took with one
item a message (7.7% of the gateway's CPU samples at 16 streams, issue 21). Registered in
shard.wire.messages' allow-list like every other kind. Pure data with its cross-field rules
(`check`): nothing here reads a log or sends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from shard.errors import WireError
from shard.wire.fields import JOB_ID, Int, ListOf, Str, Tensor, spec
from shard.wire.limits import Limits
from shard.wire.shapes import fail_shape

SIDES = ("input", "output")
# Items one request may name: Limits.max_list_len, the cap every list on the wire has.
MAX_AUDIT_ITEMS = 4096
# The smallest reply budget a request may name; a reply still carries one item past it.
MIN_AUDIT_REPLY_BYTES = 1024


@dataclass(frozen=True, kw_only=True)
class AuditRequest:
    """Coordinator -> stage (control stream): send the frames you logged for job `job_id` on
    ring epoch `epoch`, item i being side `sides[i]` of round `rounds[i]`, in this order, as
    many as fit `max_bytes` of frame bytes (at least one)."""

    KIND: ClassVar[str] = "audit_request"
    request_id: int = spec(Int())
    job_id: str = spec(JOB_ID)
    epoch: int = spec(Int())
    rounds: tuple[int, ...] = spec(ListOf(Int(), max_items=MAX_AUDIT_ITEMS))
    sides: tuple[str, ...] = spec(ListOf(Str(8, choices=SIDES), max_items=MAX_AUDIT_ITEMS))
    max_bytes: int = spec(Int(MIN_AUDIT_REPLY_BYTES))

    def check(self, limits: Limits) -> None:
        if not self.rounds:
            raise WireError("field 'rounds' length", f"1..{MAX_AUDIT_ITEMS}", 0)
        if len(self.sides) != len(self.rounds):
            raise WireError("field 'sides' length (one per round)", len(self.rounds), len(self.sides))


@dataclass(frozen=True, kw_only=True, eq=False)
class AuditReply:
    """Stage -> coordinator, for request `request_id`: `sizes[i]` is the length of item i's
    canonical frame bytes (0: no record kept) for the first len(sizes) items of the request;
    `frames` holds those bytes back to back (None when every size is 0)."""

    KIND: ClassVar[str] = "audit_reply"
    request_id: int = spec(Int())
    sizes: tuple[int, ...] = spec(ListOf(Int(), max_items=MAX_AUDIT_ITEMS))
    frames: torch.Tensor | None = spec(Tensor(frozenset({"u8"}), optional=True), default=None)  # (sum(sizes),)

    def check(self, limits: Limits) -> None:
        total = sum(self.sizes)
        if self.frames is None:
            if total:
                raise WireError("tensor 'frames' (the sizes' sum of bytes)", total, "none")
            return
        if self.frames.dim() != 1:
            raise fail_shape("frames", ["nbytes"], self.frames)
        if self.frames.shape[0] != total:
            raise WireError("tensor 'frames' length (the sizes' sum)", total, self.frames.shape[0])


def items(rounds: tuple[int, ...] | list[int]) -> list[tuple[int, str]]:
    """Both sides of each round, in the order an audit reads them: (round, side) pairs."""
    return [(r, side) for r in rounds for side in SIDES]


def read_reply(request: AuditRequest, reply: AuditReply) -> list[bytes | None]:
    """The frames a stage's reply gives for the first items of `request`, in its order (None:
    no record kept). Raises WireError for a reply that covers no item or more than were asked
    (a stage must make progress: an audit would never end on empty replies)."""
    if not 0 < len(reply.sizes) <= len(request.rounds):
        raise WireError("audit reply items (a prefix of the request's)", f"1..{len(request.rounds)}", len(reply.sizes))
    data = b"" if reply.frames is None else reply.frames.numpy().tobytes()
    out: list[bytes | None] = []
    at = 0
    for n in reply.sizes:
        out.append(data[at:at + n] if n else None)
        at += n
    return out
