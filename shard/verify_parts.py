"""Verify requests and replies larger than one control frame: cut into VerifyParts, put back together.

A verify request carries every input frame a stage logged for one (job, epoch) and its
reply every row the verifier recomputed, so a long prompt's pass one control frame (2k
tokens of SmolLM2 in f32 are 4.7 MB; the coordinator reads frames of 6.8 MB). `split` cuts
a message's encoding into VerifyParts of at most one frame each (a message that fits goes
whole); `Uploads` puts them back together where they arrive, bounded: a whole message of
at most `cap` bytes (`upload_cap`, derived from the model), parts in order and consistent
with part 0, at most `max_open` uploads open at once per sender, each finished within
`deadline_s` of its first part (an older one is dropped when the next part arrives).
Whatever breaks a rule drops that upload and raises a one-line ShardError naming the limit.

It does not know what the messages mean or who may send them (only the coordinator holds a
node's control stream): it does no replay and no I/O.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shard.errors import ShardError, WireError
from shard.wire.codec import decode, encode
from shard.wire.limits import Limits
from shard.wire.messages import Message
from shard.wire.verify import MAX_VERIFY_FRAMES, MAX_VERIFY_PARTS, VerifyPart, VerifyReply, VerifyRequest

# A VerifyPart's header (msgpack map of five fields, its tensor table, pad) is far below it.
PART_OVERHEAD_BYTES = 1024
# A logged Forward's header and small vectors beyond its hidden and aux rows (nonce, job id,
# positions...): ~1 KB at 2k tokens; 4 KiB a frame leaves room.
FRAME_OVERHEAD_BYTES = 4096
AUX_LAYERS = 3  # Limits.for_model's largest Forward: f32 hidden plus 3 layers of f32 aux
UPLOAD_DEADLINE_S = 60.0
MAX_OPEN_UPLOADS = 2  # per sender, on a verifier node (the coordinator may ask two checks at once)


def upload_cap(limits: Limits) -> int:
    """The most bytes a whole verify message may take under `limits`: every position of the
    context once, in f32 with hidden and AUX_LAYERS of aux (the largest rows a Forward may
    carry), plus each frame's header (SmolLM2: 8192 x 576 x 4 x 4 + 4096 x 4 KiB = 92 MB).
    A stage's frames of one (job, epoch) cover each position once (a resumed job starts a
    new epoch), and a reply's rows are at most those. A model unknown to `limits` (no hidden
    size or context): 16 frames. Never below one frame."""
    if limits.hidden_size is None or limits.max_context_tokens is None:
        return min(16 * limits.max_frame_bytes, (1 << 32) - 1)
    rows = limits.max_context_tokens * limits.hidden_size * 4 * (1 + AUX_LAYERS)
    return min(max(rows + MAX_VERIFY_FRAMES * FRAME_OVERHEAD_BYTES, limits.max_frame_bytes), (1 << 32) - 1)


def whole_limits(limits: Limits, cap: int) -> Limits:
    """`limits` for a whole message of up to `cap` bytes (encoded, or put back together):
    the frame cap raised to it, and the element cap with it (u8 frames: one a byte)."""
    cap = min(cap, (1 << 32) - 1)
    return dataclasses.replace(limits, max_frame_bytes=max(cap, limits.max_frame_bytes),
                               max_tensor_elements=max(limits.max_tensor_elements, cap))


def split(msg: VerifyRequest | VerifyReply, max_part_bytes: int, limits: Limits) -> list[Message]:
    """`msg` as it goes on a control stream whose frames hold `max_part_bytes`: itself when its
    encoding fits, else VerifyParts of it. `limits`: whole_limits for the largest message the
    receiver takes (encoding checks it). Raises ShardError (WireError) for a message over
    them, or past MAX_VERIFY_PARTS parts."""
    data = encode(msg, limits)
    if len(data) <= max_part_bytes:
        return [msg]
    step = max_part_bytes - PART_OVERHEAD_BYTES  # data bytes a part
    if step < 1:
        raise ShardError(f"a control frame of {max_part_bytes} bytes cannot hold a verify part")
    parts = math.ceil(len(data) / step)
    if parts > MAX_VERIFY_PARTS:
        raise WireError("verify parts", MAX_VERIFY_PARTS, parts)
    whole = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # (total_bytes,)
    return [VerifyPart(request_id=msg.request_id, part=i, parts=parts, total_bytes=len(data),
                       data=whole[i * step:(i + 1) * step]) for i in range(parts)]


@dataclass
class _Upload:
    parts: int
    total_bytes: int
    started_s: float
    data: bytearray
    next_part: int = 0


class Uploads:
    """VerifyParts being put back together, per (sender, request id)."""

    def __init__(self, cap: int, max_open: int = MAX_OPEN_UPLOADS, deadline_s: float = UPLOAD_DEADLINE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cap, self.max_open, self.deadline_s, self.clock = cap, max_open, deadline_s, clock
        self._open: dict[tuple[str, int], _Upload] = {}
        self.completed = 0  # uploads put back together

    @property
    def open_bytes(self) -> int:
        """Bytes held by unfinished uploads."""
        return sum(len(u.data) for u in self._open.values())

    def drop(self, sender: str, request_id: int) -> None:
        """Forget `sender`'s upload for `request_id`, if open (its asker gave up on it)."""
        self._open.pop((sender, request_id), None)

    def add(self, sender: str, part: VerifyPart) -> bytes | None:
        """Take `part` from `sender`: the whole message's bytes once its last part is in, else
        None. Raises ShardError (the upload dropped) for a part that breaks a rule."""
        now = self.clock()
        for key in [k for k, u in self._open.items() if now - u.started_s > self.deadline_s]:
            del self._open[key]  # past its deadline: its next part finds no upload
        key, rid = (sender, part.request_id), part.request_id
        up = self._open.pop(key, None)  # put back below while the upload goes on
        if part.part == 0:
            if up is not None:
                raise ShardError(f"verify upload {rid}: part 0 again while the upload was open")
            if part.total_bytes > self.cap:
                raise ShardError(f"verify upload {rid}: {part.total_bytes} bytes, over the cap of {self.cap}")
            if sum(1 for s, _ in self._open if s == sender) >= self.max_open:
                raise ShardError(f"verify upload {rid}: {self.max_open} uploads from this sender are open already")
            up = _Upload(part.parts, part.total_bytes, now, bytearray())
        elif up is None:
            raise ShardError(f"verify upload {rid}: part {part.part} of an upload not open "
                             f"(never started, dropped, or past its {self.deadline_s:g} s deadline)")
        elif part.part != up.next_part or part.parts != up.parts or part.total_bytes != up.total_bytes:
            raise ShardError(f"verify upload {rid}: part {part.part} of {part.parts} ({part.total_bytes} bytes) "
                             f"where part {up.next_part} of {up.parts} ({up.total_bytes} bytes) was due")
        n = int(part.data.shape[0])
        if len(up.data) + n > up.total_bytes:
            raise ShardError(f"verify upload {rid}: parts past its total of {up.total_bytes} bytes")
        up.data += part.data.numpy().tobytes()
        up.next_part += 1
        if up.next_part < up.parts:
            self._open[key] = up
            return None
        if len(up.data) != up.total_bytes:
            raise ShardError(f"verify upload {rid}: {len(up.data)} bytes in its {up.parts} parts, "
                             f"not the {up.total_bytes} declared")
        self.completed += 1
        return bytes(up.data)


def assemble(data: bytes, limits: Limits, cap: int, kind: type, request_id: int) -> VerifyRequest | VerifyReply:
    """The whole message an upload put back together: decoded under whole_limits(limits,
    cap), and of `kind` with `request_id` (its parts'). Raises ShardError otherwise."""
    msg = decode(data, whole_limits(limits, cap))
    if not isinstance(msg, kind) or msg.request_id != request_id:  # type: ignore[attr-defined]
        raise ShardError(f"verify upload {request_id}: its parts make a {type(msg).__name__} "
                         f"{getattr(msg, 'request_id', '')}, not a {kind.__name__} {request_id}")
    return msg  # type: ignore[return-value]
