"""The wire's message kinds: frozen dataclasses, and the registry that is their allow-list.

Each field is declared with its wire kind (fields.py); `check(limits)` holds the rules
that span fields (shapes, exactly-one-of, orderings). Messages are pure data: nothing
here does I/O or knows how frames are laid out (codec.py) or read (the transport).
List fields are held as tuples; any sequence is accepted when building one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Union

import msgpack
import torch

from receipts.schema import MAX_NONCE_BYTES, MIN_NONCE_BYTES
from shard.errors import WireError
from shard.quant import SCHEMES
from shard.wire.dtypes import FLOAT_NAMES
from shard.wire.fields import JOB_ID, Bytes, Float, Int, ListOf, MapOf, OptionalOf, Str, Tensor, kind_of, spec
from shard.wire.limits import MAX_OPEN_JOBS, MAX_PAYLOAD_BYTES, Limits
from shard.wire.shapes import check_activations, check_context, check_nonnegative, check_tokens_dim, check_vector
from shard.wire.roles import ROLE_STAGE
# The trailer's fields (receipts, compute_s, clock_s, burst): shard.wire.trailer.
from shard.wire.trailer import BURST, CLOCK_TIMES, COMPUTE_TIMES, RECEIPTS, TRAILER_FIELDS
from shard.wire.audit_frames import AuditReply, AuditRequest
from shard.wire.release_frames import ReleaseFrames
from shard.wire.verify import VerifyPart, VerifyReply, VerifyRequest
from shard.wire.weight_messages import WEIGHT_MESSAGES

# 2: per-stage trailer fields (receipts, compute_s) left the header for a trailer after
# the tensor bytes, so a frame's canonical bytes are a prefix of its wire bytes.
# 3: audit_request / audit_reply carry many (round, side) items (shard.wire.audit_frames).
# 4: a job's first Forward may name a prefix source (prefix_job, prefix_len: docs/prefix_cache.md).
PROTOCOL_VERSION = 4
# Header keys the codec owns; no message field may use them. `pad` (bin, 0..7 bytes) makes
# the tensor bytes start 8-aligned in the body so they can be viewed without copying.
RESERVED_KEYS = frozenset({"v", "kind", "tensors", "pad"})

NONCE = Bytes(MAX_NONCE_BYTES, min_bytes=MIN_NONCE_BYTES)
PEER_ID = Str(128)  # a libp2p peer id in text form (base58 / CID), ~52 chars today
NAME = Str(256)  # model names, digests, device descriptions, addresses
EPOCH = Int()
ROUND = Int()
MAX_CLOCK_S = 1e11  # a wall clock past this (year ~5138) is no clock
FLOATS = frozenset(FLOAT_NAMES)
INTS = frozenset({"i32", "i64"})
F32 = frozenset({"f32"})


@dataclass(frozen=True, kw_only=True, eq=False)
class Forward:
    """Coordinator -> head, stage -> next stage: run these T tokens through your layers."""

    KIND: ClassVar[str] = "forward"
    TRAILER: ClassVar[tuple[str, ...]] = TRAILER_FIELDS
    job_id: str = spec(JOB_ID)
    epoch: int = spec(EPOCH)
    round: int = spec(ROUND)
    nonce: bytes = spec(NONCE)
    phase: str = spec(Str(16, choices=("prefill", "decode", "verify")))
    # Valid KV slots once the commit is applied; this frame writes [ctx_len, ctx_len + T).
    ctx_len: int = spec(Int())
    positions: torch.Tensor = spec(Tensor(INTS))  # (T,) rotary positions; tree siblings share one
    # Slots gathered, in order, into [commit_dst, commit_dst + len) before this frame runs.
    commit_src: tuple[int, ...] = spec(ListOf(Int()), default=())
    commit_dst: int = spec(Int(), default=0)
    tree_parents: torch.Tensor | None = spec(Tensor(frozenset({"i32"}), optional=True), default=None)  # (T,)
    tokens: torch.Tensor | None = spec(Tensor(INTS, optional=True), default=None)  # (T,) head only
    hidden: torch.Tensor | None = spec(Tensor(FLOATS, optional=True), default=None)  # (T, H)
    hidden_scale: torch.Tensor | None = spec(Tensor(F32, optional=True), default=None)  # (T,) fp8 only
    aux: torch.Tensor | None = spec(Tensor(FLOATS, optional=True), default=None)  # (T, k*H) EAGLE features
    aux_scale: torch.Tensor | None = spec(Tensor(F32, optional=True), default=None)  # (T,) fp8 only
    want_aux_layers: tuple[int, ...] = spec(ListOf(Int()), default=())
    receipts: tuple[bytes, ...] = spec(RECEIPTS, default=())
    # Seconds each stage so far spent computing this frame (one entry per stage, in ring
    # order): lets the coordinator split a traversal into transport and compute.
    compute_s: tuple[float, ...] = spec(COMPUTE_TIMES, default=())
    # Wall-clock (Unix) seconds each stage so far took this frame off its stream and handed
    # its output on, two per stage in ring order: the coordinator splits the traversal into
    # each hop's transfer (coordinator.gateway.hop_times). Clocks of different machines
    # differ: a hop's figure carries the offset between its two ends, their sum none.
    clock_s: tuple[float, ...] = spec(CLOCK_TIMES, default=())
    burst: tuple[int, ...] = spec(BURST, default=())  # (id, size): sent with others for one receiver
    # A job's first frame on a stage may start from another job's K/V there (a prefix cache):
    # slots [0, prefix_len) are copied from job `prefix_job`'s cache before this frame runs.
    prefix_job: str | None = spec(OptionalOf(JOB_ID), default=None)
    prefix_len: int = spec(Int(), default=0)

    def check(self, limits: Limits) -> None:
        n = check_tokens_dim("positions", self.positions, limits)
        check_vector("positions", self.positions, n)
        check_nonnegative("positions", self.positions)
        check_context(self.positions, self.ctx_len, self.want_aux_layers, limits)
        if (self.tokens is None) == (self.hidden is None):
            raise WireError("exactly one of tensors 'tokens', 'hidden'", 1, int(self.tokens is not None) + int(self.hidden is not None))
        check_vector("tokens", self.tokens, n)
        check_nonnegative("tokens", self.tokens)
        check_activations("hidden", self.hidden, self.hidden_scale, n, limits, multiple=False)
        check_activations("aux", self.aux, self.aux_scale, n, limits, multiple=True)
        if self.tree_parents is not None:
            check_vector("tree_parents", self.tree_parents, n)
            p = self.tree_parents.to(torch.int64)  # (T,)
            bad = (p < -1) | (p >= torch.arange(n, device=p.device))
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise WireError(f"tensor 'tree_parents'[{i}] value", f"[-1, {i})", int(p[i]))
        committed = self.commit_dst + len(self.commit_src)
        if committed > self.ctx_len:
            raise WireError("field 'commit_dst' + len(commit_src) vs 'ctx_len'", self.ctx_len, committed)
        self._check_prefix()

    def _check_prefix(self) -> None:
        """A prefix starts the frame's context: it covers exactly [0, ctx_len), moves no slot,
        and names another job."""
        if self.prefix_job is None:
            if self.prefix_len:
                raise WireError("field 'prefix_len' without 'prefix_job'", 0, self.prefix_len)
            return
        if self.prefix_len != self.ctx_len or self.prefix_len < 1:
            raise WireError("field 'prefix_len' (must equal 'ctx_len', >= 1)", max(self.ctx_len, 1), self.prefix_len)
        if self.commit_src:
            raise WireError("field 'commit_src' beside a prefix", 0, len(self.commit_src))
        if self.prefix_job == self.job_id:
            raise WireError("field 'prefix_job' (another job's id)", "not " + self.job_id, self.prefix_job)


@dataclass(frozen=True, kw_only=True, eq=False)
class Result:
    """Tail -> coordinator: the final hidden states of a frame (and EAGLE aux features)."""

    KIND: ClassVar[str] = "result"
    TRAILER: ClassVar[tuple[str, ...]] = TRAILER_FIELDS
    job_id: str = spec(JOB_ID)
    epoch: int = spec(EPOCH)
    round: int = spec(ROUND)
    hidden: torch.Tensor = spec(Tensor(FLOATS))  # (T, H)
    hidden_scale: torch.Tensor | None = spec(Tensor(F32, optional=True), default=None)  # (T,)
    aux: torch.Tensor | None = spec(Tensor(FLOATS, optional=True), default=None)  # (T, k*H)
    aux_scale: torch.Tensor | None = spec(Tensor(F32, optional=True), default=None)  # (T,)
    receipts: tuple[bytes, ...] = spec(RECEIPTS, default=())
    compute_s: tuple[float, ...] = spec(COMPUTE_TIMES, default=())  # as in Forward
    clock_s: tuple[float, ...] = spec(CLOCK_TIMES, default=())  # as in Forward
    burst: tuple[int, ...] = spec(BURST, default=())  # as in Forward: a tail's outputs of one forward

    def check(self, limits: Limits) -> None:
        n = check_tokens_dim("hidden", self.hidden, limits)
        check_activations("hidden", self.hidden, self.hidden_scale, n, limits, multiple=False)
        # On prefill the tail returns only the last hidden row but aux for every token
        # (a drafter needs the whole prompt's features), so aux has its own row count.
        n_aux = check_tokens_dim("aux", self.aux, limits) if self.aux is not None else n
        check_activations("aux", self.aux, self.aux_scale, n_aux, limits, multiple=True)


@dataclass(frozen=True, kw_only=True)
class EndJob:
    """Coordinator -> stages: the job is over; free its KV cache (keep = 1: keep it, and its
    logged frames, for later jobs to fork from: a prefix source, docs/prefix_cache.md)."""

    KIND: ClassVar[str] = "end_job"
    job_id: str = spec(JOB_ID)
    epoch: int = spec(EPOCH)
    keep: int = spec(Int(0, 1), default=0)

    def check(self, limits: Limits) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class JobError:
    """Stage -> coordinator: a frame of this job could not be processed."""

    KIND: ClassVar[str] = "job_error"
    job_id: str = spec(JOB_ID)
    epoch: int = spec(EPOCH)
    round: int = spec(ROUND)
    code: str = spec(Str(64))
    message: str = spec(Str(1024))
    stage: str = spec(PEER_ID)

    def check(self, limits: Limits) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class Register:
    """Node -> coordinator: who I am and what I can do (measured, not claimed-by-config)."""

    KIND: ClassVar[str] = "register"
    peer_id: str = spec(PEER_ID)
    model: str = spec(NAME)
    manifest_digest: str = spec(NAME)
    device: str = spec(NAME)
    memory_bytes: int = spec(Int())
    decode_s_per_layer: float = spec(Float())
    prefill_s_per_layer_token: float = spec(Float())
    upload_bytes_per_s: float = spec(Float())
    download_bytes_per_s: float = spec(Float())
    rtt_ms: dict[str, float] = spec(MapOf(PEER_ID, Float()), default_factory=dict)  # peer id -> ms
    listen_addrs: tuple[str, ...] = spec(ListOf(NAME, max_items=64), default=())
    # A node re-registering keeps what it holds: its last epoch (-1: none) and its loaded
    # layers [held_start, held_end) ([0, 0): none), so the ring re-forms warm.
    held_epoch: int = spec(Int(-1), default=-1)
    held_start: int = spec(Int(), default=0)
    held_end: int = spec(Int(), default=0)
    # The role it held them in ("": none): of a stage and a standby holding one slice, the stage is re-seated.
    held_role: str = spec(Str(32), default="")
    # The weight quantisation the node runs its layers in (shard.quant), and what one layer
    # then holds in memory: the selector seats layers by it, the auditor replays under it.
    quant: str = spec(Str(16, choices=tuple(SCHEMES)), default="none")
    bytes_per_layer: int = spec(Int(0), default=0)  # 0: the store's own bytes per layer
    # Weight files of the manifest this node holds on disk (present at their full size), which
    # it serves to fetching peers (shard.weight_server) once it has verified them.
    stored_files: tuple[str, ...] = spec(ListOf(Str(128), max_items=4096), default=())

    def check(self, limits: Limits) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class Refused:
    """Coordinator -> node: registration refused (`code`), `reason` one line to act on."""

    KIND: ClassVar[str] = "refused"
    code: str = spec(Str(64))
    reason: str = spec(Str(1024))

    def check(self, limits: Limits) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class Assignment:
    """Coordinator -> node: your place in ring epoch `epoch`, signed by the coordinator.

    `role` is ROLE_STAGE for ring members; a node given any other role (hot standby,
    verifier, seeder... named by the coordinator) serves no ring frames that epoch."""

    KIND: ClassVar[str] = "assignment"
    epoch: int = spec(EPOCH)
    peer_id: str = spec(PEER_ID)
    role: str = spec(Str(32))
    layer_start: int = spec(Int())
    layer_end: int = spec(Int())  # half-open: layers [layer_start, layer_end)
    predecessor: str | None = spec(OptionalOf(PEER_ID))  # None = the coordinator feeds me
    successor: str | None = spec(OptionalOf(PEER_ID))  # None = tail, returns to coordinator
    successor_addrs: tuple[str, ...] = spec(ListOf(NAME, max_items=16), default=())  # where to dial it
    # Where this node, not dialable, reserves a relay slot (a node's addrs; empty: the coordinator's).
    relay_addrs: tuple[str, ...] = spec(ListOf(NAME, max_items=16), default=())
    # The peers this node relays for: it starts relaying and accepts their reservations only.
    relay_for: tuple[str, ...] = spec(ListOf(PEER_ID, max_items=64), default=())
    model: str = spec(NAME)
    manifest_digest: str = spec(NAME)
    wire_dtype: str = spec(Str(16, choices=tuple(sorted(FLOAT_NAMES))))
    # The EAGLE aux features' own dtype (None: wire_dtype). fp8 aux on a 16-bit wire halves
    # what every draft row carries at no measured cost in acceptance (docs/benchmarks.md).
    aux_dtype: str | None = spec(OptionalOf(Str(16, choices=tuple(sorted(FLOAT_NAMES)))), default=None)
    max_open_jobs: int = spec(Int(hi=MAX_OPEN_JOBS), default=0)  # jobs a stage holds KV for at once (0: none named)
    signature: bytes = spec(Bytes(64), default=b"")  # Ed25519 over signing_bytes()

    def check(self, limits: Limits) -> None:
        # A stage serves at least one layer; other roles (ROLE_STAGE aside) may name the
        # slice they keep warm or check, or none at all (layer_start == layer_end).
        if self.layer_start > self.layer_end or (self.role == ROLE_STAGE and self.layer_start == self.layer_end):
            raise WireError("field 'layer_end' must exceed 'layer_start'", self.layer_start, self.layer_end)
        if limits.num_layers is not None and self.layer_end > limits.num_layers:
            raise WireError("field 'layer_end'", f"<= {limits.num_layers} (the model's layers)", self.layer_end)

    def signing_bytes(self) -> bytes:
        """Deterministic msgpack of every field but the signature, keys sorted, with the
        version and kind included so a signature cannot be replayed as another message."""
        body = {"kind": self.KIND, "v": PROTOCOL_VERSION}
        for f in dataclasses.fields(self):
            if f.name != "signature":
                body[f.name] = kind_of(f).pack(getattr(self, f.name))
        return msgpack.packb(dict(sorted(body.items())), use_bin_type=True)


@dataclass(frozen=True, kw_only=True)
class Ready:
    """Node -> coordinator: my slice is loaded and I serve epoch `epoch`."""

    KIND: ClassVar[str] = "ready"
    peer_id: str = spec(PEER_ID)
    epoch: int = spec(EPOCH)

    def check(self, limits: Limits) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class Ping:
    """Liveness / RTT probe. A payload times the sender's upload; `reply_bytes` asks for a
    Pong carrying that many bytes, which times the sender's download."""

    KIND: ClassVar[str] = "ping"
    nonce: int = spec(Int())
    sent_ns: int = spec(Int())
    payload: bytes = spec(Bytes(MAX_PAYLOAD_BYTES), default=b"")
    reply_bytes: int = spec(Int(0, MAX_PAYLOAD_BYTES), default=0)

    def check(self, limits: Limits) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class Pong:
    """Answer to a Ping: echoes its nonce and sent_ns; payload is `reply_bytes` zero bytes.
    `clock_s`: the answerer's wall clock (Unix s) when it answered, for the coordinator's
    clock-offset estimate (coordinator.swarm.clock_offset); None from a node predating it."""

    KIND: ClassVar[str] = "pong"
    nonce: int = spec(Int())
    sent_ns: int = spec(Int())
    payload: bytes = spec(Bytes(MAX_PAYLOAD_BYTES), default=b"")
    clock_s: float | None = spec(OptionalOf(Float()), default=None)

    def check(self, limits: Limits) -> None:
        if self.clock_s is not None and self.clock_s > MAX_CLOCK_S:
            raise WireError("field 'clock_s'", f"<= {MAX_CLOCK_S:.0f} (Unix seconds)", self.clock_s)


@dataclass(frozen=True, kw_only=True)
class ProbePeers:
    """Coordinator -> node (control stream): measure your round trip to each of these peers
    (peer id -> addresses to dial) and answer with a LinkReport. `bandwidth_bytes` > 0
    also asks for your upload and download to the coordinator, probed with that many bytes."""

    KIND: ClassVar[str] = "probe_peers"
    peers: dict[str, tuple[str, ...]] = spec(MapOf(PEER_ID, ListOf(NAME, max_items=16)), default_factory=dict)
    bandwidth_bytes: int = spec(Int(0, MAX_PAYLOAD_BYTES), default=0)

    def check(self, limits: Limits) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class LinkReport:
    """Node -> coordinator: measured round trips in ms (peer id -> ms; peers it could not
    reach are left out) and, when asked, its upload/download to the coordinator."""

    KIND: ClassVar[str] = "link_report"
    peer_id: str = spec(PEER_ID)
    rtt_ms: dict[str, float] = spec(MapOf(PEER_ID, Float()), default_factory=dict)
    upload_bytes_per_s: float | None = spec(OptionalOf(Float()), default=None)
    download_bytes_per_s: float | None = spec(OptionalOf(Float()), default=None)

    def check(self, limits: Limits) -> None:
        pass


# How a ring stream reaches the next stage (shard.relay names them; a test holds the two together).
HOP_PATHS = ("direct", "hole_punched", "relayed")


@dataclass(frozen=True, kw_only=True)
class HopPath:
    """Node -> coordinator: the path of the libp2p connection its ring stream to `successor`
    crosses (a relayed one's address holds /p2p-circuit; a direct one that replaced a relay
    was hole-punched)."""

    KIND: ClassVar[str] = "hop_path"
    peer_id: str = spec(PEER_ID)
    successor: str = spec(PEER_ID)
    path: str = spec(Str(16, choices=HOP_PATHS))
    via: str | None = spec(OptionalOf(PEER_ID), default=None)  # the relay a "relayed" path crosses

    def check(self, limits: Limits) -> None:
        pass


Message = Union[Forward, Result, EndJob, JobError, Register, Refused, Assignment, Ready, Ping, Pong, ProbePeers,
                LinkReport, HopPath, AuditRequest, AuditReply, ReleaseFrames, VerifyRequest, VerifyReply]
# The allow-list: the only classes a peer's `kind` can name.
REGISTRY: dict[str, type] = {c.KIND: c for c in (Forward, Result, EndJob, JobError, Register, Refused, Assignment, Ready,
                                                 Ping, Pong, ProbePeers, LinkReport, HopPath, AuditRequest, AuditReply,
                                                 ReleaseFrames, VerifyRequest, VerifyReply)}

REGISTRY.update({c.KIND: c for c in WEIGHT_MESSAGES})  # weights from peers (shard.wire.weight_messages)
REGISTRY[VerifyPart.KIND] = VerifyPart  # a verify message cut in parts (shard.verify_parts)
for _cls in REGISTRY.values():
    _clash = {f.name for f in dataclasses.fields(_cls)} & RESERVED_KEYS
    if _clash:
        raise TypeError(f"{_cls.__name__} uses reserved header keys {sorted(_clash)}")
