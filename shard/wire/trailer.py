"""The fields a frame's trailer carries: what each stage appends or stamps as a frame travels.

The codec writes a message's TRAILER fields after its tensor bytes, outside the canonical
bytes that receipts hash (codec.encode_body), so appending a receipt or stamping a burst
never changes what was signed. `receipts`, `compute_s` and `clock_s` grow by one (two)
entries per stage; `burst` is rewritten by each sender: [id, size] says the frame is one of
`size` frames its sender emitted together for this receiver (a stage's outputs of one
forward, the gateway's next frames for the jobs of one head product), so the receiver may
hold the first ones a moment for the rest (shard.stage_scheduler); () is a lone frame.
Data only: a burst asks nothing a lone frame would not get. Knows nothing of framing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shard.errors import WireError
from shard.wire.fields import Bytes, Float, Int, ListOf
from shard.wire.limits import MAX_RECEIPT_BYTES, MAX_RECEIPTS, Limits

RECEIPTS = ListOf(Bytes(MAX_RECEIPT_BYTES), max_items=MAX_RECEIPTS)
COMPUTE_TIMES = ListOf(Float(), max_items=MAX_RECEIPTS)  # one per stage, like receipts
CLOCK_TIMES = ListOf(Float(), max_items=2 * MAX_RECEIPTS)  # two per stage
# Frames one burst may announce: a stage's forward carries at most a few hundred jobs'
# frames (shard.batch_plan's token budget, 320 rows), the gateway's head product 256 rows.
MAX_BURST_FRAMES = 1024
BURST_ID = Int(0, (1 << 32) - 1)  # a sender's counter, wrapping
TRAILER_FIELDS = ("receipts", "compute_s", "clock_s", "burst")


@dataclass(frozen=True)
class Burst:
    """[id, size] (size in 1..MAX_BURST_FRAMES) or [] (a lone frame); held as a tuple."""

    def check(self, what: str, value: Any, limits: Limits) -> tuple[int, ...]:
        if not isinstance(value, list):
            raise WireError(f"{what} type", "list", type(value).__name__)
        if not value:
            return ()
        if len(value) != 2:
            raise WireError(f"{what} length", "0 or 2 ([id, size])", len(value))
        burst_id = BURST_ID.check(f"{what}[0] (id)", value[0], limits)
        size = Int(1, MAX_BURST_FRAMES).check(f"{what}[1] (size)", value[1], limits)
        return burst_id, size

    def pack(self, value: Any) -> list:
        return [int(v) for v in value]


BURST = Burst()
