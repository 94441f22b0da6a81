"""The coordinator's view of its nodes: registry, link measurements, and formation's effects.

Nodes open a control stream, measure their links to the coordinator and register; the
coordinator then asks each newcomer to probe the nodes already there (ProbePeers ->
LinkReport), so it keeps a measured pairwise latency matrix. When the eligible membership
changes, the formation task asks coordinator.swarm.formation (pure) for a decision on a
snapshot of all that, then carries it out: signs the stage Assignments of the new epoch,
sends them and every other node its role, waits until every stage reports Ready and
commits the RingState. Rounds the engine measured are held against the plan's
predictions. A lost control stream removes the node and re-forms the ring. What others
listen for leaves on channels given to the constructor (job errors, ring changes, audit
replies), never blocking. It does not run requests (jobs), speak HTTP, or decide rings
itself (formation, ring/).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from coordinator.swarm import (admission, clock_offset, formation, forming, ring_drain, ring_set, seeding, speed_probe,
                               status, topology, unreachable)
from coordinator.swarm.formation import ModelIdentity, RingState, Snapshot, SwarmConfig
from coordinator.swarm.topology import Traversal, TraversalLog
from ring import Network, PeerId, Plan, RingError
from shard.addresses import dialable_from_elsewhere
from shard.errors import WireError
from shard.identity import peer_id_from_public_key
from shard.layers import LayerRange
from shard.store import ModelStore
from shard.transport import FramedStream, TransportError
from shard.wire.codec import decode, encode
from shard.wire.limits import Limits
from shard.wire.messages import (Assignment, AuditReply, HopPath, JobError, LinkReport, Ping, Pong, ProbePeers, Ready,
                                 Register, VerifyReply)
from shard.wire.verify import VerifyPart, control_limits

__all__ = ["REPORT_BUFFER", "Member", "RingState", "Swarm", "SwarmConfig"]

log = logging.getLogger("shard.coordinator")

# Buffer of each channel the swarm reports on (job errors, ring changes, audit replies):
# reports come a few at a time and their readers only hand them on at once, so a full
# channel means its reader is gone, not slow.
REPORT_BUFFER = 64

# Probation credit moves with every verified round and tells the swarm nothing: while the
# last formation kept off (or seated) a newcomer nothing trusted could check, its loop
# looks this often whether a member left probation (it may make that newcomer checkable,
# coordinator.swarm.forming.prefer_verifiable), and forms again if one did. Also the
# debounce: credits landing within one look re-form once. A set over the members: cheap.
TRUST_POLL_S = 1.0


@dataclass
class Member:
    register: Register
    control: FramedStream
    lock: trio.Lock = field(default_factory=trio.Lock)
    ready_epoch: int = -1
    joined_s: float = field(default_factory=time.monotonic)
    assignment: Assignment | None = None  # the latest one sent (stage or other role)


def _offer(channel: trio.MemorySendChannel | None, item: object, what: str) -> None:
    """Hand `item` to whoever listens on `channel` without ever blocking the swarm: a full
    or closed channel drops it (and says so)."""
    if channel is None:
        return
    try:
        channel.send_nowait(item)
    except trio.WouldBlock:
        log.warning("dropped %s: its channel is full", what)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        log.info("dropped %s: nobody listens any more", what)


class Swarm:
    def __init__(self, store: ModelStore, signing_key: bytes, config: SwarmConfig, *,
                 job_errors: trio.MemorySendChannel[JobError] | None = None,
                 ring_changes: trio.MemorySendChannel[RingState | None] | None = None,
                 audit_replies: trio.MemorySendChannel[tuple[PeerId, AuditReply | VerifyReply]] | None = None) -> None:
        """`job_errors` gets every JobError a stage reports, `ring_changes` the new RingState
        (None: no ring) whenever the ring changes, `audit_replies` (peer, AuditReply or VerifyReply).
        None: nobody listens. A full channel drops what it cannot take."""
        self.store, self.config = store, config
        self._job_errors, self._ring_changes, self._audit_replies = job_errors, ring_changes, audit_replies
        self._key = Ed25519PrivateKey.from_private_bytes(signing_key)
        self.peer_id = PeerId(peer_id_from_public_key(self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)))
        self.limits = Limits.for_model(store.config)
        self.control_limits = control_limits(self.limits)  # audit and verify replies carry frames as u8
        self.faulty: dict[PeerId, str] = {}  # peer id -> why audits excluded it from rings
        self.unreachable = unreachable.Exclusions()  # unreachable or stalling nodes sit out a while
        self.registrations, self.probes = admission.RegistrationRate(), speed_probe.SpeedProbes(store, config.speed_probe, config.wire_dtype, self.control_limits.max_frame_bytes, self.send_control, self._notify)  # how often an address, a key, may register; newcomers' measured speeds
        self.members: dict[PeerId, Member] = {}
        self.ring: RingState | None = None  # the lowest-id ring formed (coordinator.swarm.ring_set)
        self.rings: dict[int, RingState] = {}  # every ring formed, by id
        self.ring_plans: dict[int, tuple[Plan, Network]] = {}  # every ring's plan, also while it re-forms
        self.epoch = 0
        self._changed = trio.Event()
        self._ring_ready = trio.Event()
        # Topology: measurements, the chosen plan, and how its rounds actually went.
        self.model = topology.model_spec(store, config.wire_dtype, config.topology.kv_bytes_per_value)
        self.identity = ModelIdentity(self.model, store.digest, config.wire_dtype, config.aux_dtype,
                                      config.max_open_jobs)
        self.links: dict[tuple[PeerId, PeerId], float] = {}  # measured one-way latency (src, dst) -> s
        self.held: dict[PeerId, LayerRange] = {}  # layers each node reported Ready with
        self.plan: Plan | None = None
        self.network: Network | None = None  # what `plan` was chosen on
        self.traversals, self.fetches, self.clocks = TraversalLog(), seeding.FetchLog(), clock_offset.ClockOffsets()  # measured against predicted; nodes' clocks against ours
        self.predictions = topology.Predictions()
        self._awaiting_reports: set[PeerId] = set()
        self._formed_for: frozenset[PeerId] | None = None  # eligible members at the last formation
        self.busy: Callable[[int], int] = lambda epoch: 0  # jobs running on ring `epoch` (the engine's router sets it)
        self.drain_until: float | None = None  # a join's re-form waits for running jobs until then (forming.drain)
        self.draining: dict[int, ring_drain.Drain] = {}  # replica rings taking no new jobs (forming.drain_rings)
        self.unverifiable = None  # the engine's: stages on probation nothing trusted could check (forming.prefer_verifiable)
        self.trusted: Callable[[], frozenset[PeerId]] | None = None  # the engine's: members off probation
        self._formed_trusted: frozenset[PeerId] = frozenset()  # of the eligible members, those trusted at the last formation
        self.seat_for_capacity: Callable[[], bool] = lambda: True  # the engine's: unchecked rings serve (ring_set)
        self.trust_matters = False  # the last formation kept off or seated a newcomer nothing trusted could check
        self.seated_unverified: str | None = None  # why the ring seats such a newcomer anyway

    # -- control streams -------------------------------------------------------------
    async def handle_control(self, stream: FramedStream) -> None:
        """Serve one node's control stream until it closes. Error handling: a node that
        sends garbage or lies about its identity is dropped; others are unaffected."""
        peer = PeerId(stream.remote_peer_id)
        lock = trio.Lock()  # every send on this stream, shared with the Member
        try:
            while True:
                msg = decode(await stream.recv_frame(self.control_limits.max_frame_bytes), self.control_limits)
                if isinstance(msg, Ping):
                    async with lock:
                        await stream.send_frame(encode(Pong(nonce=msg.nonce, sent_ns=msg.sent_ns, payload=bytes(msg.reply_bytes))))
                elif isinstance(msg, Pong):  # answers our clock Ping (clock_offset.keep_measuring)
                    self.clocks.pong(peer, msg)
                elif isinstance(msg, Register):
                    in_use = (held := self.members.get(peer)) is not None and held.control is not stream
                    refused = admission.refusal(msg, identity_in_use=in_use, model_name=self.store.manifest.name,
                                                model_digest=self.store.digest) or self.registrations.admit(peer, getattr(stream, "remote_ip", None))
                    if refused is not None:
                        log.warning("refused node %s: %s", peer, refused.reason)
                        async with lock:
                            await stream.send_frame(encode(refused))
                        return
                    self._register(peer, msg, stream, lock)
                    await self._ask_probe(peer, sorted(set(self.members) - {peer}), bandwidth_bytes=0)
                elif isinstance(msg, LinkReport):
                    self._on_link_report(peer, msg)
                elif isinstance(msg, Ready):
                    self._on_ready(peer, msg)
                elif isinstance(msg, JobError):
                    if (blamed := unreachable.blamed(msg, peer, self.ring_by_epoch(msg.epoch))) is not None:
                        self.report_unreachable(blamed, f"{peer[-6:]} could not reach it: {msg.message}")
                    _offer(self._job_errors, msg, f"job {msg.job_id}'s error from {peer}")
                elif isinstance(msg, HopPath) and msg.peer_id == peer:  # the path its ring stream crosses
                    self.traversals.record_path(peer, PeerId(msg.successor), msg.path, msg.via)
                elif isinstance(msg, (AuditReply, VerifyReply, VerifyPart)):  # VerifyPart: a reply in parts
                    self.probes.answer(peer, msg) or _offer(self._audit_replies, (peer, msg), f"an audit reply from {peer}")
                else:
                    log.warning("ignoring %s on %s's control stream", type(msg).__name__, peer)
        except (TransportError, WireError) as exc:
            log.info("node %s left: %s", peer, exc)
        except ValueError as exc:  # Register that fails validation
            log.warning("dropping node %s: %s", peer, exc)
        finally:
            member = self.members.get(peer)
            if member is None or member.control is stream:  # a refused duplicate's stream leaves the member be
                self._awaiting_reports.discard(peer)
                self.links = topology.forget_peer(self.links, peer)
                self.held.pop(peer, None)
                if self.members.pop(peer, None) is not None:
                    self._notify()
            await stream.aclose()

    def _register(self, peer: PeerId, msg: Register, stream: FramedStream, lock: trio.Lock) -> None:
        if msg.peer_id != peer:
            raise ValueError(f"registered as {msg.peer_id} over a stream authenticated as {peer}")
        # Peers are told only addresses they can dial (no 0.0.0.0; loopback only from this machine).
        msg = dataclasses.replace(msg, listen_addrs=dialable_from_elsewhere(msg.listen_addrs, getattr(stream, "remote_ip", None)))
        self.members[peer] = Member(msg, stream, lock)
        self.epoch = max(self.epoch, msg.held_epoch)  # a node that outlived its coordinator: epochs keep growing
        if msg.held_end > msg.held_start:
            self.held[peer] = LayerRange(msg.held_start, msg.held_end)
        self.links = topology.record_rtts(self.links, peer, msg.rtt_ms, self.peer_id,
                                          self.config.topology.coordinator_link_latency_s)
        log.info("node %s registered (%s, %.0f MB usable, up %.1f / down %.1f Mbit/s, rtt to coordinator %s ms)",
                 peer, msg.device, msg.memory_bytes / 1e6, msg.upload_bytes_per_s * 8e-6, msg.download_bytes_per_s * 8e-6,
                 msg.rtt_ms.get(self.peer_id, "?"))
        self._notify()

    async def _ask_probe(self, peer: PeerId, targets: list[PeerId], bandwidth_bytes: int) -> None:
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

    def _on_link_report(self, peer: PeerId, msg: LinkReport) -> None:
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
        self.unreachable.readmit(msg.rtt_ms)  # a peer measured a round trip to them: dialable after all
        self._notify()

    def report_unreachable(self, peer: PeerId, reason: str, kind: str = "unreachable") -> None:
        """`peer` could not be reached by its ring predecessor (or `kind` "stalled"): it sits out, the ring re-forms."""
        if self.unreachable.strike(peer, reason, kind):
            self._notify()

    def readmit(self, peers: Iterable[PeerId], kind: str) -> None:
        """`peers`, sitting out as `kind` ("disputed": their partner was found the liar), may join rings again."""
        self.unreachable.readmit(peers, kind)
        self._notify()

    def _on_ready(self, peer: PeerId, msg: Ready) -> None:
        member = self.members.get(peer)
        if member is None:
            return
        member.ready_epoch = msg.epoch
        a = member.assignment
        if a is not None and a.epoch == msg.epoch and a.layer_start < a.layer_end:
            self.held[peer] = LayerRange(a.layer_start, a.layer_end)
        self._notify()

    async def send_control(self, peer: PeerId | str, msg) -> None:
        """Send one message on a member's control stream. Raises TransportError if the
        peer is not (or no longer) registered or its stream fails."""
        member = self.members.get(peer)
        if member is None:
            raise TransportError(f"{peer} is not registered", peer)
        async with member.lock:
            await member.control.send_frame(encode(msg))

    def mark_faulty(self, peer: PeerId, reason: str) -> None:
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
        """Re-form the ring whenever the eligible membership changes, re-measure links every
        `probe_interval_s` and nodes' clocks every few seconds (clock_offset). Never returns."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serve_probe_refresh)
            nursery.start_soon(self.probes.serve)
            nursery.start_soon(clock_offset.keep_measuring, self.clocks, lambda: list(self.members), self.send_control)
            task_status.started()
            rejoin_until = trio.current_time() + self.config.rejoin_wait_s
            while True:
                changed = self._changed
                wanted = self._eligible()
                for rid, ring in list(self.rings.items()):
                    if not ring_set.peers_of(ring) <= wanted:
                        self._set_ring(None, rid)  # it lost a stage: its jobs move or wait while it re-forms
                trusted = self.trusted() & wanted if self.trusted is not None else frozenset()
                if (wanted != self._formed_for or self.trust_matters and trusted != self._formed_trusted) and (
                        len(wanted) >= self.config.min_nodes or self.plan is not None):
                    if self._awaiting_reports & wanted:
                        await self._wait_for_reports()
                        continue  # membership may have changed meanwhile
                    if trio.current_time() < rejoin_until and formation.rejoining(self.snapshot(), wanted, self.model):
                        with trio.move_on_at(rejoin_until):
                            await changed.wait()
                        continue
                    self._formed_trusted = trusted  # a node leaving probation may seat a newcomer kept off
                    await forming.form(self, wanted)
                poll_at = trio.current_time() + TRUST_POLL_S if self.trust_matters else math.inf
                with trio.move_on_at(min(self.unreachable.next_return_s(), poll_at)):
                    await changed.wait()  # or an excluded node's sit-out ends, or it is time to look at trust again

    def _eligible(self) -> frozenset[PeerId]:
        return formation.eligible(self.members, {**self.faulty, **self.unreachable.sitting_out(), **self.probes.hold_back(self.members)})

    async def _wait_for_reports(self) -> None:
        with trio.move_on_after(self.config.probe_wait_s):
            while self._awaiting_reports & self._eligible():
                await self._changed.wait()
        if late := self._awaiting_reports & self._eligible():
            log.warning("forming without link reports from %s: their links are estimated", sorted(late))
            self._awaiting_reports -= late

    async def _serve_probe_refresh(self) -> None:
        while True:
            await trio.sleep(self.config.probe_interval_s)
            for peer in sorted(self.members):
                await self._ask_probe(peer, sorted(set(self.members) - {peer}), self.config.probe_bandwidth_bytes)

    def snapshot(self) -> Snapshot:
        """The registry as formation decides on it."""
        return Snapshot(self.peer_id, {p: self.probes.seated(p, m.register) for p, m in self.members.items()}, dict(self.links),
                        dict(self.held), dict(self.faulty), self.plan, self.ring, self.epoch)

    def current_rings(self) -> dict[int, ring_set.Current]:
        """Every ring by id with its plan: formed (`rings`), or broken / still forming (ring None)."""
        return {rid: ring_set.Current(self.rings.get(rid), plan, network) for rid, (plan, network) in self.ring_plans.items()}

    def ring_by_epoch(self, epoch: int) -> RingState | None:
        """The formed ring of `epoch`, None once it is gone (epochs are unique across rings)."""
        return next((r for r in self.rings.values() if r.epoch == epoch), None)

    def plan_of(self, epoch: int) -> tuple[Plan, Network] | None:
        """The plan (and the network it was chosen on) of the formed ring of `epoch`."""
        ring = self.ring_by_epoch(epoch)
        return self.ring_plans.get(ring.ring_id) if ring is not None else None

    # -- predictions against measurements ---------------------------------------------
    def record_traversal(self, t: Traversal) -> None:
        """A round the engine measured on ring epoch `t.epoch`: kept with the plan's
        prediction for the same round, and logged (prefill rounds at INFO)."""
        if (planned := self.plan_of(t.epoch)) is None:
            return
        try:
            predicted = self.predictions.predict(planned, self.model, self.config.topology, t)
        except RingError as exc:  # e.g. a prompt longer than the plan's memory budget
            log.debug("no prediction for a %d-token round: %s", t.tokens, exc)
            return
        self.traversals.add(t, predicted)
        log.log(logging.INFO if t.prefill else logging.DEBUG,
                "ring epoch %d %s round of %d tokens: measured %.1f ms, predicted %.1f ms",
                t.epoch, "prefill" if t.prefill else "decode", t.tokens, t.traversal_s * 1e3, predicted.traversal_s * 1e3)

    def topology_info(self) -> dict[str, Any]:
        """The plan, its predictions, measured rounds, roles and each node's measured links."""
        info = status.topology_info(self.snapshot(), self.traversals, self.config.topology, self.model)
        return {**info, "fetches": self.fetches.summary(), "clocks": self.clocks.summary(), "speed_probes": self.probes.summary()}  # weight fetches (seeding), clock offsets

    def _set_ring(self, ring: RingState | None, ring_id: int = 0) -> None:
        """Ring `ring_id` is now `ring` (None: gone); `ring` is the lowest-id ring formed."""
        if ring is not None:
            self.rings[ring_id] = ring
        else:
            self.rings.pop(ring_id, None)
        self.ring = self.rings[min(self.rings)] if self.rings else None
        if self.ring is not None:
            self._ring_ready.set()
        elif self._ring_ready.is_set():
            self._ring_ready = trio.Event()
        _offer(self._ring_changes, ring, "a ring change")

    async def wait_change(self, epoch: int, timeout_s: float) -> None:
        """Wait until no ring is epoch `epoch` any more (it re-formed or broke), or
        `timeout_s` passes. Always a checkpoint, so a caller looping on it yields."""
        await trio.lowlevel.checkpoint()
        with trio.move_on_after(timeout_s):
            while self.ring_by_epoch(epoch) is not None:
                await self._changed.wait()

    async def wait_ring(self) -> RingState:
        while self.ring is None:
            await self._ring_ready.wait()
        return self.ring
