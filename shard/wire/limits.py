"""Bounds a receiver holds every peer frame to, and the frame's length prefix.

The one definition shared by the codec (frame bodies) and the transport (the stream's
length prefix). Knows nothing of message kinds or of how frames are read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from shard.arch import ModelConfig

# Length prefix of a whole frame body on a stream: u32 big-endian. The transport checks
# the value against Limits.max_frame_bytes before reading the body.
FRAME_PREFIX = struct.Struct(">I")

_MiB = 1 << 20
# Ping/Pong payloads and receipts travel in the header as msgpack bin: the header cap
# must hold a 1 MiB payload plus the rest of the header.
MAX_PAYLOAD_BYTES = 1 * _MiB
MAX_RECEIPT_BYTES = 4096
MAX_RECEIPTS = 64
MAX_RANK = 4
# An Assignment's open-jobs cap (jobs a stage holds KV for at once): past it a stage's
# first KV pages alone (~250 KB a job on a 10-layer SmolLM2 slice) outgrow any node.
MAX_OPEN_JOBS = 1 << 16


@dataclass(frozen=True)
class Limits:
    """Per-edge bounds on a frame. Every length a peer declares is checked against these
    before anything is allocated for it."""

    max_frame_bytes: int = 256 * _MiB
    max_header_bytes: int = 2 * _MiB
    max_tensors: int = 16
    # Total elements over all tensors of one frame.
    max_tensor_elements: int = 1 << 26
    max_tokens_per_frame: int = 4096
    # Width of `hidden` (and the unit of `aux`'s width); None = not checked.
    hidden_size: int | None = None
    # Length of any list or map in the header (commit_src, listen_addrs, rtt_ms...).
    max_list_len: int = 4096
    # Nesting of the msgpack header: the map is depth 1, its tensor table's shapes depth 4.
    max_depth: int = 8
    # The model's context: every rotary position is below it and a frame's committed
    # context (ctx_len) at most it; None = not checked. Bounds what later code sizes by a
    # position (the rotary table, KV slots) before it allocates.
    max_context_tokens: int | None = None
    # Layers of the model: a layer index a peer names (want_aux_layers) is below it.
    num_layers: int | None = None

    def __post_init__(self) -> None:
        if not (0 < self.max_frame_bytes < (1 << 32)):
            raise ValueError(f"max_frame_bytes must fit the u32 prefix, got {self.max_frame_bytes}")
        if not (0 < self.max_header_bytes <= self.max_frame_bytes):
            raise ValueError(f"max_header_bytes must be in (0, max_frame_bytes], got {self.max_header_bytes}")
        if self.max_depth < 4:
            raise ValueError(f"max_depth must be >= 4 (the tensor table needs it), got {self.max_depth}")
        for name in ("max_tensors", "max_tensor_elements", "max_tokens_per_frame", "max_list_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("hidden_size", "max_context_tokens", "num_layers"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {getattr(self, name)}")

    @classmethod
    def for_model(cls, cfg: ModelConfig, max_tokens_per_frame: int = 512, max_aux_layers: int = 3) -> "Limits":
        """Limits sized for one model: the largest legal Forward is f32 hidden (T, H) plus
        f32 aux (T, max_aux_layers*H) plus a handful of (T,) vectors."""
        h, t = cfg.hidden_size, max_tokens_per_frame
        # hidden + aux, plus positions, tree_parents, tokens, hidden_scale, aux_scale.
        elements = t * h * (1 + max_aux_layers) + 5 * t
        header = 2 * _MiB
        tensor_bytes = t * h * (1 + max_aux_layers) * 4 + 5 * t * 8
        return cls(
            max_frame_bytes=min((1 << 32) - 1, 4 + header + tensor_bytes),
            max_header_bytes=header,
            max_tensor_elements=elements,
            max_tokens_per_frame=t,
            hidden_size=h,
            max_context_tokens=cfg.max_context_tokens,
            num_layers=cfg.num_layers,
        )
