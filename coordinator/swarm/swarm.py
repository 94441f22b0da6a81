"""The coordinator's view of its nodes: registry, link measurements, ring formation, roles.

Nodes open a control stream, measure their links to the coordinator and register; the
coordinator then asks each newcomer to probe the nodes already there (ProbePeers ->
LinkReport), so it keeps a measured pairwise latency matrix. When membership changes the
formation task builds ring inputs from these measurements (coordinator.swarm.topology), chooses
a ring with ring.select_ring (ring.reselect once a ring exists, so survivors keep their
layers), signs one Assignment per stage for a new epoch, waits until every stage reports
Ready, and gives every other node its role. Rounds the engine measured are held against
the plan's predictions. A lost control stream removes the node and re-forms the ring. Job
errors reported by stages are handed to whoever registered for them. It does not run
requests (ring_engine) or speak HTTP, and it does not decide rings itself (ring/).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from coordinator.swarm import topology
from coordinator.swarm.topology import TopologyConfig, Traversal, TraversalLog
from ring.assign import AssignError, Capacity, split_by_capacity
from ring import (ChurnPolicy, Constraints, InfeasibleError, Network, PeerId, Plan, RingError, Stage, evaluate, reselect,
                  select_ring)
from shard.errors import WireError
from shard.identity import peer_id_from_public_key
from shard.layers import LayerRange
from shard.store import ModelStore
from shard.transport import FramedStream, TransportError
from shard.wire.codec import decode, encode
from shard.wire.limits import Limits
from shard.wire.messages import (ROLE_STAGE, Assignment, AuditReply, JobError, LinkReport, Ping, Pong, ProbePeers, Ready,
                                 Register)

log = logging.getLogger("shard.coordinator")


@dataclass(frozen=True)
class SwarmConfig:
    min_nodes: int = 1  # form the first ring only once this many nodes have registered (healing ignores it)
    wire_dtype: str = "f32"
    aux_dtype: str | None = None  # EAGLE aux features on the wire (None: wire_dtype)
    ready_timeout_s: float = 300.0  # loading a slice can take a while on a slow disk
    # Before forming, wait this long at most for newcomers' link reports: a ring chosen
    # on estimated latencies is a worse ring, but a missing report must not stall it.
    probe_wait_s: float = 10.0
    probe_interval_s: float = 300.0  # re-measure every node's links this often
    probe_bandwidth_bytes: int = 256 << 10  # payload of the periodic upload/download probes
    topology: TopologyConfig = TopologyConfig()
    churn: ChurnPolicy = ChurnPolicy()  # how re-selection weighs weight moves against ring speed
    # "select_ring": the upload-aware selector (ring/). "all_nodes": every node is a stage,
    # layers split by speed (ring.assign), still costed by ring.evaluate.
    planner: str = "select_ring"

    def __post_init__(self) -> None:
        if self.planner not in ("select_ring", "all_nodes"):
            raise ValueError(f"planner must be 'select_ring' or 'all_nodes', got {self.planner!r}")


@dataclass
class Member:
    register: Register
    control: FramedStream
    lock: trio.Lock = field(default_factory=trio.Lock)
    ready_epoch: int = -1
    joined_s: float = field(default_factory=time.monotonic)
    assignment: Assignment | None = None  # the latest one sent (stage or other role)


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
        self.peer_id = peer_id_from_public_key(self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))
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
        # Topology: measurements, the chosen plan, and how its rounds actually went.
        self.model = topology.model_spec(store, config.wire_dtype, config.topology.kv_bytes_per_value)
        self.links: dict[tuple[str, str], float] = {}  # measured one-way latency (src, dst) -> s
        self.held: dict[str, LayerRange] = {}  # layers each node reported Ready with
        self.plan: Plan | None = None
        self.network: Network | None = None  # what `plan` was chosen on
        self.traversals = TraversalLog()
        self._awaiting_reports: set[str] = set()
        self._formed_for: frozenset[str] | None = None  # eligible members at the last formation

    # -- control streams -------------------------------------------------------------
    async def handle_control(self, stream: FramedStream) -> None:
        """Serve one node's control stream until it closes. Error handling: a node that
        sends garbage or lies about its identity is dropped; others are unaffected."""
        peer = stream.remote_peer_id
        lock = trio.Lock()  # every send on this stream, shared with the Member
        try:
            while True:
                msg = decode(await stream.recv_frame(self.control_limits.max_frame_bytes), self.control_limits)
                if isinstance(msg, Ping):
                    async with lock:
                        await stream.send_frame(encode(Pong(nonce=msg.nonce, sent_ns=msg.sent_ns,
                                                            payload=bytes(msg.reply_bytes))))
                elif isinstance(msg, Register):
                    self._register(peer, msg, stream, lock)
                    await self._ask_probe(peer, sorted(set(self.members) - {peer}), bandwidth_bytes=0)
                elif isinstance(msg, LinkReport):
                    self._on_link_report(peer, msg)
                elif isinstance(msg, Ready):
                    self._on_ready(peer, msg)
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
            self._awaiting_reports.discard(peer)
            self.links = topology.forget_peer(self.links, peer)
            self.held.pop(peer, None)
            if self.members.pop(peer, None) is not None:
                self._notify()
            await stream.aclose()

    def _register(self, peer: str, msg: Register, stream: FramedStream, lock: trio.Lock) -> None:
        if msg.peer_id != peer:
            raise ValueError(f"registered as {msg.peer_id} over a stream authenticated as {peer}")
        if msg.manifest_digest != self.store.digest:
            raise ValueError(f"serves model digest {msg.manifest_digest[:12]}, ring model is {self.store.digest[:12]}")
        self.members[peer] = Member(msg, stream, lock)
        self.links = topology.record_rtts(self.links, peer, msg.rtt_ms, self.peer_id,
                                          self.config.topology.coordinator_link_latency_s)
        log.info("node %s registered (%s, %.0f MB usable, up %.1f / down %.1f Mbit/s, rtt to coordinator %s ms)",
                 peer, msg.device, msg.memory_bytes / 1e6, msg.upload_bytes_per_s * 8e-6, msg.download_bytes_per_s * 8e-6,
                 msg.rtt_ms.get(self.peer_id, "?"))
        self._notify()

    async def _ask_probe(self, peer: str, targets: list[str], bandwidth_bytes: int) -> None:
        """Ask `peer` to measure its round trips to `targets` (and its bandwidth, if asked)."""
        peers = {t: self.members[t].register.listen_addrs[:16] for t in targets if t in self.members}
        if not peers and not bandwidth_bytes:
            return
        self._awaiting_reports.add(peer)
        try:
            await self.send_control(peer, ProbePeers(peers=peers, bandwidth_bytes=bandwidth_bytes))
        except TransportError as exc:
            self._awaiting_reports.discard(peer)
            log.info("could not ask %s to probe its links: %s", peer, exc)

    def _on_link_report(self, peer: str, msg: LinkReport) -> None:
        member = self.members.get(peer)
        if member is None or msg.peer_id != peer:
            log.warning("ignoring a link report from %s about %s", peer, msg.peer_id)
            return
        self.links = topology.record_rtts(self.links, peer, msg.rtt_ms, self.peer_id,
                                          self.config.topology.coordinator_link_latency_s)
        reg = member.register
        member.register = dataclasses.replace(
            reg, upload_bytes_per_s=msg.upload_bytes_per_s or reg.upload_bytes_per_s,
            download_bytes_per_s=msg.download_bytes_per_s or reg.download_bytes_per_s)
        log.info("node %s measured %d links: %s", peer, len(msg.rtt_ms),
                 ", ".join(f"{p[-6:]} {ms:.1f} ms" for p, ms in sorted(msg.rtt_ms.items())))
        self._awaiting_reports.discard(peer)
        self._notify()

    def _on_ready(self, peer: str, msg: Ready) -> None:
        member = self.members.get(peer)
        if member is None:
            return
        member.ready_epoch = msg.epoch
        a = member.assignment
        if a is not None and a.epoch == msg.epoch and a.layer_start < a.layer_end:
            self.held[peer] = LayerRange(a.layer_start, a.layer_end)
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
        """Re-form the ring whenever the eligible membership changes, and re-measure links
        every `probe_interval_s`. Never returns."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serve_probe_refresh)
            task_status.started()
            while True:
                changed = self._changed
                wanted = self._eligible()
                current = {p for p, _ in self.ring.stages} if self.ring else set()
                if self.ring is not None and not current <= wanted:
                    self._set_ring(None)
                if wanted != self._formed_for and (len(wanted) >= self.config.min_nodes or self.plan is not None):
                    if self._awaiting_reports & wanted:
                        await self._wait_for_reports()
                        continue  # membership may have changed meanwhile
                    await self._form(frozenset(wanted))
                await changed.wait()

    def _eligible(self) -> set[str]:
        return set(self.members) - set(self.faulty)

    async def _wait_for_reports(self) -> None:
        with trio.move_on_after(self.config.probe_wait_s):
            while self._awaiting_reports & self._eligible():
                await self._changed.wait()
        late = self._awaiting_reports & self._eligible()
        if late:
            log.warning("forming without link reports from %s: their links are estimated", sorted(late))
            self._awaiting_reports -= late

    async def _serve_probe_refresh(self) -> None:
        while True:
            await trio.sleep(self.config.probe_interval_s)
            for peer in sorted(self.members):
                await self._ask_probe(peer, sorted(set(self.members) - {peer}), self.config.probe_bandwidth_bytes)

    def choose(self, members: frozenset[str]) -> tuple[Plan, Network]:
        """The ring for `members` on what was measured: ring.reselect when some of the
        current ring survives (moving weights costs more than a slightly slower ring),
        else ring.select_ring. Raises ring.RingError when no ring fits."""
        cfg = self.config.topology
        regs = {p: self.members[p].register for p in members}
        network = topology.build_network(self.peer_id, regs, self.links, self.held, cfg)
        constraints = Constraints(one_per_subnet=cfg.one_per_subnet)
        workload = cfg.workload()
        if self.config.planner == "all_nodes":
            try:
                split = split_by_capacity([Capacity(p, r.memory_bytes, r.decode_s_per_layer) for p, r in regs.items()],
                                          self.model.num_layers, self.model.bytes_per_layer)
            except AssignError as exc:
                raise InfeasibleError(str(exc), len(regs)) from None
            return evaluate([Stage(PeerId(p), r) for p, r in split], network, self.model, workload), network
        if self.plan is not None and set(self.plan.peers) & members:
            return reselect(self.plan, network, self.model, workload, constraints, self.config.churn), network
        return select_ring(network, self.model, workload, constraints), network

    async def _form(self, members: frozenset[str]) -> None:
        try:
            plan, network = self.choose(members)
        except RingError as exc:
            log.warning("cannot form a ring from %d nodes: %s", len(members), exc)
            self._formed_for = members
            self._set_ring(None)
            return
        log.info("plan for %d nodes: %s", len(members), plan.describe())
        for peer, role in sorted(plan.roles.items()):
            log.info("node %s off the ring as %s: %s", peer, role.kind.value, role.reason)
        stages = tuple((s.peer, s.layers) for s in plan.stages)
        if self.ring is not None and self.ring.stages == stages:
            # Same ring: keep the epoch (and every job's KV); only roles may have changed.
            self._formed_for, self.plan, self.network = members, plan, network
            await self._send_roles(plan, self.ring.epoch, members)
            return
        self._set_ring(None)
        self.epoch += 1
        epoch = self.epoch
        assignments = [self._sign(Assignment(
            epoch=epoch, peer_id=peer, role=ROLE_STAGE, layer_start=r.start, layer_end=r.end,
            predecessor=stages[i - 1][0] if i > 0 else None,
            successor=stages[i + 1][0] if i + 1 < len(stages) else None,
            successor_addrs=self.members[stages[i + 1][0]].register.listen_addrs[:16] if i + 1 < len(stages) else (),
            model=self.store.manifest.name, manifest_digest=self.store.digest, wire_dtype=self.config.wire_dtype,
            aux_dtype=self.config.aux_dtype,
        )) for i, (peer, r) in enumerate(stages)]
        log.info("forming ring epoch %d: %s", epoch, ", ".join(f"{p[-6:]}{r}" for p, r in stages))
        try:
            for a in assignments:
                await self._send_assignment(a)
            await self._send_roles(plan, epoch, members)
            with trio.fail_after(self.config.ready_timeout_s):
                while not all(a.peer_id in self.members and self.members[a.peer_id].ready_epoch >= epoch
                              for a in assignments):
                    if any(a.peer_id not in self.members for a in assignments):
                        return  # someone left meanwhile; the formation loop tries again
                    await self._changed.wait()
        except (TransportError, trio.TooSlowError) as exc:
            log.warning("ring epoch %d failed to form: %s", epoch, exc)
            return
        if epoch == self.epoch:
            self._formed_for, self.plan, self.network = members, plan, network
            self.traversals.clear()
            self._set_ring(RingState(epoch, stages, tuple(assignments)))
            log.info("ring epoch %d ready", epoch)

    def _sign(self, a: Assignment) -> Assignment:
        return dataclasses.replace(a, signature=self._key.sign(a.signing_bytes()))

    async def _send_assignment(self, a: Assignment) -> None:
        member = self.members.get(a.peer_id)
        if member is None:
            raise TransportError(f"{a.peer_id} left before its assignment", a.peer_id)
        member.assignment = a
        async with member.lock:
            await member.control.send_frame(encode(a))

    async def _send_roles(self, plan: Plan, epoch: int, members: frozenset[str]) -> None:
        """An Assignment naming its role to every member off the ring: a standby or verifier
        gets the slice of the stage it covers, a decode replica the whole model, a seeder
        what it holds, a relay nothing. A node that cannot be reached just misses its role."""
        on_ring = set(plan.peers)
        for peer in sorted(members - on_ring):
            role = plan.roles.get(peer)
            if role is None:
                continue
            if role.stage_index is not None:
                layers = plan.stages[role.stage_index].layers
            elif role.kind.value == "decode_only_replica":
                layers = LayerRange(0, self.model.num_layers)
            else:
                layers = self.held.get(peer, LayerRange(0, 0))
            a = self._sign(Assignment(
                epoch=epoch, peer_id=peer, role=role.kind.value, layer_start=layers.start, layer_end=layers.end,
                predecessor=None, successor=None, model=self.store.manifest.name, manifest_digest=self.store.digest,
                wire_dtype=self.config.wire_dtype, aux_dtype=self.config.aux_dtype))
            old = self.members[peer].assignment if peer in self.members else None
            if old is not None and dataclasses.replace(old, signature=b"") == dataclasses.replace(a, signature=b""):
                continue
            try:
                await self._send_assignment(a)
            except TransportError as exc:
                log.info("could not send %s its role: %s", peer, exc)

    # -- predictions against measurements ---------------------------------------------
    def record_traversal(self, t: Traversal) -> None:
        """A round the engine measured on ring epoch `t.epoch`: kept with the plan's
        prediction for the same round, and logged (prefill rounds at INFO)."""
        if self.ring is None or t.epoch != self.ring.epoch or self.plan is None or self.network is None:
            return
        try:
            predicted = topology.predict(self.plan, self.network, self.model, self.config.topology, t)
        except RingError as exc:  # e.g. a prompt longer than the plan's memory budget
            log.debug("no prediction for a %d-token round: %s", t.tokens, exc)
            return
        self.traversals.add(t, predicted)
        log.log(logging.INFO if t.prefill else logging.DEBUG,
                "ring epoch %d %s round of %d tokens: measured %.1f ms, predicted %.1f ms",
                t.epoch, "prefill" if t.prefill else "decode", t.tokens, t.traversal_s * 1e3, predicted.traversal_s * 1e3)

    def topology_info(self) -> dict[str, Any]:
        """The plan, its predictions, measured rounds, roles and each node's measured links."""
        plan, cfg = self.plan, self.config.topology
        nodes = {}
        for peer, m in sorted(self.members.items()):
            reg = m.register
            rtt = self.links.get((peer, self.peer_id))
            nodes[peer] = {
                "upload_bytes_per_s": reg.upload_bytes_per_s, "download_bytes_per_s": reg.download_bytes_per_s,
                "decode_s_per_layer": reg.decode_s_per_layer, "prefill_s_per_layer_token": reg.prefill_s_per_layer_token,
                "memory_bytes": reg.memory_bytes, "one_way_to_coordinator_s": rtt,
                "subnet": topology.subnet_of(peer, reg.listen_addrs),
                "held": [self.held[peer].start, self.held[peer].end] if peer in self.held else None,
                "faulty": self.faulty.get(peer),
            }
        return {
            "plan": topology.plan_info(plan) if plan is not None else None,
            "roles": {p: {"role": r.kind.value, "reason": r.reason, "stage_index": r.stage_index}
                      for p, r in sorted(plan.roles.items())} if plan is not None else {},
            "measured": self.traversals.summary(),
            "workload": dataclasses.asdict(cfg.workload()),
            "model": dataclasses.asdict(self.model),
            "nodes": nodes,
            "measured_links": len(self.links),
        }

    def _set_ring(self, ring: RingState | None) -> None:
        self.ring = ring
        if ring is not None:
            self._ring_ready.set()
        elif self._ring_ready.is_set():
            self._ring_ready = trio.Event()
        for listener in self.ring_listeners:
            listener(ring)

    async def wait_change(self, epoch: int, timeout_s: float) -> None:
        """Wait until the ring is no longer epoch `epoch` (no ring counts as changed), or
        `timeout_s` passes. Always a checkpoint, so a caller looping on it yields."""
        await trio.lowlevel.checkpoint()
        with trio.move_on_after(timeout_s):
            while self.ring is not None and self.ring.epoch == epoch:
                await self._changed.wait()

    async def wait_ring(self) -> RingState:
        while self.ring is None:
            await self._ring_ready.wait()
        return self.ring
