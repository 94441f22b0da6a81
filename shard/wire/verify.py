"""The verifier's two wire messages: an audit's recomputation asked of a node, and its answer.

The coordinator sends a verifier node (control stream) the input frames a stage logged for
one (job, epoch), with the slice and formats the stage served them under; the verifier
replays them on its own copy of that slice (shard.verifier, shard.replay) and answers with
the rows it recomputed. Registered in shard.wire.messages' allow-list like every other kind.
A timing request (`timing_request`, `is_timing`: one frame of one zero byte, which no
Forward can be: its header alone is longer) asks for nothing: the verifier answers it with an
error at once, so the coordinator's speed probe times the round trip and the control path.
Pure data with its cross-field rules (`check`): nothing here replays, compares or sends.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from shard.errors import WireError
from shard.quant import SCHEMES
from shard.wire.dtypes import FLOAT_NAMES
from shard.wire.fields import Int, ListOf, OptionalOf, Str, Tensor, spec
from shard.wire.limits import Limits
from shard.wire.shapes import fail_shape

WIRE_DTYPE = Str(16, choices=tuple(sorted(FLOAT_NAMES)))
# Frames one request may carry (every frame of one stage's (job, epoch)) and rows one
# replay forward may hold (its attention mask is rows x rows: 4096^2 f32 = 64 MiB).
MAX_VERIFY_FRAMES = 4096
MAX_VERIFY_REPLAY_ROWS = 4096
# Parts one verify message may be cut into (shard.verify_parts), and the least frame a
# part may be cut to (an asker's max_part_bytes; tests cut small ones).
MAX_VERIFY_PARTS = 4096
MIN_PART_BYTES = 2048  # above verify_parts.PART_OVERHEAD_BYTES


@dataclass(frozen=True, kw_only=True, eq=False)
class VerifyRequest:
    """Coordinator -> verifier (control stream): recompute layers [layer_start, layer_end)
    under `quant` on these input frames (each a stage's logged canonical Forward bytes,
    concatenated in processing order; `frame_bytes` their lengths) as a stage with wire
    `wire_dtype` (aux in `aux_dtype`, None: the wire's) sent them."""

    KIND: ClassVar[str] = "verify_request"
    request_id: int = spec(Int())
    layer_start: int = spec(Int())
    layer_end: int = spec(Int())
    quant: str = spec(Str(16, choices=tuple(SCHEMES)), default="none")
    wire_dtype: str = spec(WIRE_DTYPE)
    aux_dtype: str | None = spec(OptionalOf(WIRE_DTYPE), default=None)
    max_replay_rows: int = spec(Int(1, MAX_VERIFY_REPLAY_ROWS), default=1024)
    max_reply_bytes: int = spec(Int(1), default=64 << 20)  # the most the asker reads back: larger is an error reply
    # The largest control frame the asker reads: a reply encoding to more comes back in
    # VerifyParts of at most this (None: the verifier's own frame cap).
    max_part_bytes: int | None = spec(OptionalOf(Int(MIN_PART_BYTES)), default=None)
    frame_bytes: tuple[int, ...] = spec(ListOf(Int(1), max_items=MAX_VERIFY_FRAMES))
    frames: torch.Tensor = spec(Tensor(frozenset({"u8"})))  # (sum(frame_bytes),)

    def check(self, limits: Limits) -> None:
        if self.layer_end <= self.layer_start:
            raise WireError("field 'layer_end' vs 'layer_start'", f"> {self.layer_start}", self.layer_end)
        if limits.num_layers is not None and self.layer_end > limits.num_layers:
            raise WireError("field 'layer_end'", f"<= {limits.num_layers} (the model's layers)", self.layer_end)
        if not self.frame_bytes:
            raise WireError("field 'frame_bytes' length", ">= 1", 0)
        if self.frames.dim() != 1 or self.frames.shape[0] != sum(self.frame_bytes):
            raise fail_shape("frames", [sum(self.frame_bytes)], self.frames)


@dataclass(frozen=True, kw_only=True, eq=False)
class VerifyReply:
    """Verifier -> coordinator: what it recomputed for request `request_id`, or why not.

    Per request frame (in order) `frame_rows[i]` rows were recomputed; `keep` (N,) gives
    each one's row index within its frame; `hidden` (N, H) and `aux` (N, k*H) are their
    values in f32 after the wire codec, as the stage would have sent them (before a
    tail's trim). `error` set: nothing was recomputed (no tensors)."""

    KIND: ClassVar[str] = "verify_reply"
    request_id: int = spec(Int())
    error: str | None = spec(OptionalOf(Str(1024)), default=None)
    frame_rows: tuple[int, ...] = spec(ListOf(Int(), max_items=MAX_VERIFY_FRAMES), default=())
    keep: torch.Tensor | None = spec(Tensor(frozenset({"i64"}), optional=True), default=None)  # (N,)
    hidden: torch.Tensor | None = spec(Tensor(frozenset({"f32"}), optional=True), default=None)  # (N, H)
    aux: torch.Tensor | None = spec(Tensor(frozenset({"f32"}), optional=True), default=None)  # (N, k*H)

    def check(self, limits: Limits) -> None:
        if self.error is not None:
            if self.keep is not None or self.hidden is not None or self.aux is not None or self.frame_rows:
                raise WireError("a verify reply with an error carries no rows")
            return
        if self.keep is None or self.hidden is None:
            raise WireError("a verify reply without an error needs tensors 'keep' and 'hidden'")
        n = sum(self.frame_rows)
        if tuple(self.keep.shape) != (n,):
            raise fail_shape("keep", [n], self.keep)
        h = limits.hidden_size
        if self.hidden.dim() != 2 or self.hidden.shape[0] != n or (h is not None and self.hidden.shape[1] != h):
            raise fail_shape("hidden", [n, h or "H"], self.hidden)
        if self.aux is not None and (self.aux.dim() != 2 or self.aux.shape[0] != n or self.aux.shape[1] == 0
                                     or (h is not None and self.aux.shape[1] % h)):
            raise fail_shape("aux", [n, "k*H"], self.aux)
        if n and (int(self.keep.min()) < 0 or int(self.keep.max()) >= limits.max_tokens_per_frame):
            bad = int(self.keep.min()) if int(self.keep.min()) < 0 else int(self.keep.max())
            raise WireError("tensor 'keep' value", f"[0, {limits.max_tokens_per_frame})", bad)


@dataclass(frozen=True, kw_only=True, eq=False)
class VerifyPart:
    """Either way (control stream): part `part` of `parts` of one VerifyRequest or
    VerifyReply too large for one control frame: the next bytes of its encoding, whose
    length is `total_bytes` (cut and put back together by shard.verify_parts)."""

    KIND: ClassVar[str] = "verify_part"
    request_id: int = spec(Int())
    part: int = spec(Int(0, MAX_VERIFY_PARTS - 1))
    parts: int = spec(Int(2, MAX_VERIFY_PARTS))
    total_bytes: int = spec(Int(1))
    data: torch.Tensor = spec(Tensor(frozenset({"u8"})))  # (n,) with 1 <= n <= total_bytes

    def check(self, limits: Limits) -> None:
        if self.part >= self.parts:
            raise WireError("field 'part'", f"< parts ({self.parts})", self.part)
        if self.data.dim() != 1 or not 1 <= self.data.shape[0] <= self.total_bytes:
            raise fail_shape("data", [f"1..{self.total_bytes}"], self.data)


TIMING_ERROR = "a timing request: nothing to recompute"


def timing_request(request_id: int, layer: int, wire_dtype: str) -> VerifyRequest:
    """A request the verifier refuses unread (`TIMING_ERROR`): one frame of one zero byte."""
    return VerifyRequest(request_id=request_id, layer_start=layer, layer_end=layer + 1, wire_dtype=wire_dtype,
                         frame_bytes=(1,), frames=torch.zeros(1, dtype=torch.uint8))


def is_timing(req: VerifyRequest) -> bool:
    return req.frame_bytes == (1,) and int(req.frames[0]) == 0


def control_limits(limits: Limits) -> Limits:
    """`limits` for a control stream: audit and verify messages carry whole canonical frames
    as u8 tensors, one element per byte, so the element cap there is the frame cap (memory
    stays bounded by frame bytes)."""
    return dataclasses.replace(limits, max_tensor_elements=max(limits.max_tensor_elements, limits.max_frame_bytes))
