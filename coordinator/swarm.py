"""The coordinator's view of its nodes: registry, ring formation, and signed assignments.

Nodes open a control stream and register; when the pool changes, the formation task
plans a ring (coordinator.assign), signs one Assignment per member for a new epoch, and
waits until every member reports Ready. A lost control stream removes the node and
re-forms the ring. Job errors reported by stages are handed to whoever registered for
them. It does not run requests (ring_engine) or speak HTTP.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from coordinator.assign import AssignError, Capacity, split_by_capacity
from shard.errors import WireError
from shard.layers import LayerRange
from shard.node import CONTROL_PROTOCOL
from shard.store import ModelStore
from shard.transport import FramedStream, TransportError
from shard.wire.codec import decode, encode
from shard.wire.limits import Limits
from shard.wire.messages import Assignment, AuditReply, JobError, Ping, Pong, Ready, Register

log = logging.getLogger("shard.coordinator")


@dataclass(frozen=True)
class SwarmConfig:
    min_nodes: int = 1  # form a ring only once this many nodes have registered
    wire_dtype: str = "f32"
    ready_timeout_s: float = 300.0  # loading a slice can take a while on a slow disk


@dataclass
class Member:
    register: Register
    control: FramedStream
    lock: trio.Lock = field(default_factory=trio.Lock)
    ready_epoch: int = -1
    joined_s: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class RingState:
    epoch: int
    stages: tuple[tuple[str, LayerRange], ...]  # in ring order: head first
    assignments: tuple[Assignment, ...]

    @property
    def head(self) -> str:
        return self.stages[0][0]

    @property
    def tail(self) -> str:
        return self.stages[-1][0]


class Swarm:
    def __init__(self, store: ModelStore, signing_key: bytes, config: SwarmConfig) -> None:
        self.store, self.config = store, config
        self._key = Ed25519PrivateKey.from_private_bytes(signing_key)
        self.limits = Limits.for_model(store.config)
        # Audit replies carry a whole canonical frame as a u8 tensor: one element per byte,
        # so the element cap is the frame cap there (memory stays bounded by frame bytes).
        self.control_limits = dataclasses.replace(
            self.limits, max_tensor_elements=max(self.limits.max_tensor_elements, self.limits.max_frame_bytes))
        self.faulty: dict[str, str] = {}  # peer id -> why audits excluded it from rings
        self.audit_reply_handler: Callable[[str, AuditReply], None] = lambda peer, r: None
        self.members: dict[str, Member] = {}
        self.ring: RingState | None = None
        self.epoch = 0
        self._changed = trio.Event()
        self._ring_ready = trio.Event()
        self.job_error_handler: Callable[[JobError], None] = lambda e: None
        self.ring_listeners: list[Callable[[RingState | None], None]] = []

    # -- control streams -------------------------------------------------------------
    async def handle_control(self, stream: FramedStream) -> None:
        """Serve one node's control stream until it closes. Error handling: a node that
        sends garbage or lies about its identity is dropped; others are unaffected."""
        peer = stream.remote_peer_id
        try:
            while True:
                msg = decode(await stream.recv_frame(self.control_limits.max_frame_bytes), self.control_limits)
                if isinstance(msg, Ping):
                    await stream.send_frame(encode(Pong(nonce=msg.nonce, sent_ns=msg.sent_ns, payload=msg.payload)))
                elif isinstance(msg, Register):
                    self._register(peer, msg, stream)
                elif isinstance(msg, Ready):
                    member = self.members.get(peer)
                    if member is not None:
                        member.ready_epoch = msg.epoch
                        self._notify()
                elif isinstance(msg, JobError):
                    self.job_error_handler(msg)
                elif isinstance(msg, AuditReply):
                    self.audit_reply_handler(peer, msg)
                else:
                    log.warning("ignoring %s on %s's control stream", type(msg).__name__, peer)
        except (TransportError, WireError) as exc:
            log.info("node %s left: %s", peer, exc)
        except ValueError as exc:  # Register that fails validation
            log.warning("dropping node %s: %s", peer, exc)
        finally:
            if self.members.pop(peer, None) is not None:
                self._notify()
            await stream.aclose()

    def _register(self, peer: str, msg: Register, stream: FramedStream) -> None:
        if msg.peer_id != peer:
            raise ValueError(f"registered as {msg.peer_id} over a stream authenticated as {peer}")
        if msg.manifest_digest != self.store.digest:
            raise ValueError(f"serves model digest {msg.manifest_digest[:12]}, ring model is {self.store.digest[:12]}")
        self.members[peer] = Member(msg, stream)
        log.info("node %s registered (%s, %.0f MB usable)", peer, msg.device, msg.memory_bytes / 1e6)
        self._notify()

    async def send_control(self, peer: str, msg) -> None:
        """Send one message on a member's control stream. Raises TransportError if the
        peer is not (or no longer) registered or its stream fails."""
        member = self.members.get(peer)
        if member is None:
            raise TransportError(f"{peer} is not registered", peer)
        async with member.lock:
            await member.control.send_frame(encode(msg))

    def mark_faulty(self, peer: str, reason: str) -> None:
        """Exclude `peer` from every later ring (an audit caught it); re-forms now."""
        if peer not in self.faulty:
            log.warning("node %s marked faulty: %s", peer, reason)
            self.faulty[peer] = reason
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- formation -------------------------------------------------------------------
    async def serve_formation(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Re-form the ring whenever membership changes. Never returns."""
        task_status.started()
        while True:
            changed = self._changed
            wanted = set(self.members) - set(self.faulty)
            current = {p for p, _ in self.ring.stages} if self.ring else set()
            if wanted != current and len(wanted) >= self.config.min_nodes:
                await self._form()
            elif self.ring is not None and not current <= wanted:
                self._set_ring(None)
            await changed.wait()

    async def _form(self) -> None:
        members = {p: m for p, m in self.members.items() if p not in self.faulty}
        caps = [Capacity(p, m.register.memory_bytes, m.register.decode_s_per_layer) for p, m in members.items()]
        num_layers = self.store.num_layers
        per_layer = max(self.store.layer_bytes(LayerRange(0, num_layers)) // num_layers, 1)
        try:
            plan = split_by_capacity(caps, num_layers, per_layer)
        except AssignError as exc:
            log.warning("cannot form a ring: %s", exc)
            self._set_ring(None)
            return
        self._set_ring(None)
        self.epoch += 1
        epoch = self.epoch
        assignments = []
        for i, (peer, r) in enumerate(plan):
            a = Assignment(
                epoch=epoch, peer_id=peer, role="stage", layer_start=r.start, layer_end=r.end,
                predecessor=plan[i - 1][0] if i > 0 else None,
                successor=plan[i + 1][0] if i + 1 < len(plan) else None,
                successor_addrs=members[plan[i + 1][0]].register.listen_addrs if i + 1 < len(plan) else (),
                model=self.store.manifest.name, manifest_digest=self.store.digest, wire_dtype=self.config.wire_dtype,
            )
            a = dataclasses.replace(a, signature=self._key.sign(a.signing_bytes()))
            assignments.append(a)
        log.info("forming ring epoch %d: %s", epoch, ", ".join(f"{p[-6:]}{r}" for p, r in plan))
        try:
            for a in assignments:
                member = members[a.peer_id]
                async with member.lock:
                    await member.control.send_frame(encode(a))
            with trio.fail_after(self.config.ready_timeout_s):
                while not all(members[a.peer_id].ready_epoch >= epoch for a in assignments):
                    if any(a.peer_id not in self.members for a in assignments):
                        return  # someone left meanwhile; the formation loop tries again
                    await self._changed.wait()
        except (TransportError, trio.TooSlowError) as exc:
            log.warning("ring epoch %d failed to form: %s", epoch, exc)
            return
        if epoch == self.epoch:
            self._set_ring(RingState(epoch, tuple(plan), tuple(assignments)))
            log.info("ring epoch %d ready", epoch)

    def _set_ring(self, ring: RingState | None) -> None:
        self.ring = ring
        if ring is not None:
            self._ring_ready.set()
        elif self._ring_ready.is_set():
            self._ring_ready = trio.Event()
        for listener in self.ring_listeners:
            listener(ring)

    async def wait_change(self, epoch: int, timeout_s: float) -> None:
        """Wait until the ring is no longer epoch `epoch`, or `timeout_s` passes."""
        with trio.move_on_after(timeout_s):
            while self.ring is not None and self.ring.epoch == epoch:
                await self._changed.wait()

    async def wait_ring(self) -> RingState:
        while self.ring is None:
            await self._ring_ready.wait()
        return self.ring
