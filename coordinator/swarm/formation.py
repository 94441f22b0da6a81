"""Ring formation's decision: which ring, what each stage is assigned, what role the rest get.

Pure: a snapshot of the registry (registrations, measured links, layers held, faulty
nodes, the plan and ring in force, the last epoch handed out) and the swarm's config in;
a `Formation` out (the stages in ring order, one unsigned stage Assignment each for the
epoch it names, one unsigned role Assignment for every member off the ring that has a
role) or a `NoRing` saying why none fits. The ring itself is chosen by ring/
(select_ring, reselect once a ring exists so survivors keep their layers, or the
capacity split). Knows nothing of streams, signing keys, who has acknowledged what, or
when to form (the swarm does those).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from coordinator.swarm import relay_choice, seeding, topology
from coordinator.swarm.speed_probe import ProbeConfig
from coordinator.swarm.topology import TopologyConfig
from ring import (AssignError, Capacity, ChurnPolicy, Constraints, InfeasibleError, ModelSpec, Network, PeerId, Plan,
                  RingError, RoleKind, Stage, assign_roles, evaluate, plan_moves, reselect, select_ring,
                  split_by_capacity, with_moves)
from shard.layers import LayerRange
from shard.options import option
from shard.wire.dtypes import BY_CLI_NAME, BY_NAME, from_cli_name
from shard.wire.messages import Assignment, Register

MAX_SUCCESSOR_ADDRS = 16  # Assignment.successor_addrs' wire bound

# Wire dtypes are flags by their CLI names ("fp8"), fields by their table names.
WIRE_DTYPE_FLAG = dict(parse=from_cli_name, show=lambda name: BY_NAME[name].cli_name, choices=tuple(BY_CLI_NAME))


@dataclass(frozen=True)
class SwarmConfig:
    min_nodes: int = 1  # form the first ring only once this many nodes have registered (healing ignores it)
    wire_dtype: str = option("f32", "activation dtype on the wire", **WIRE_DTYPE_FLAG)
    aux_dtype: str | None = option(None, "dtype of the EAGLE aux features on the wire (default: the wire dtype; fp8 "
                                         "halves a draft row's aux bytes on a 16-bit wire)", **WIRE_DTYPE_FLAG)
    # Loading a slice can take a while on a slow disk; a ring whose plan has stages fetch
    # weights first waits twice the predicted fetch time (plan.move_s) on top.
    ready_timeout_s: float = 300.0
    # Before forming, wait this long at most for newcomers' link reports: a ring chosen
    # on estimated latencies is a worse ring, but a missing report must not stall it.
    probe_wait_s: float = 10.0
    probe_interval_s: float = 300.0  # re-measure every node's links this often
    # A restarted coordinator waits this long at most for nodes holding slices to
    # re-register (they retry within shard.reconnect's 5 s) before forming a ring that
    # would make them reload.
    rejoin_wait_s: float = 10.0
    probe_bandwidth_bytes: int = 256 << 10  # payload of the periodic upload/download probes
    topology: TopologyConfig = option(TopologyConfig(), "")  # a component: its option fields are flags
    churn: ChurnPolicy = ChurnPolicy()  # how re-selection weighs weight moves against ring speed
    # "select_ring": the upload-aware selector (ring/). "all_nodes": every node is a stage,
    # layers split by speed (ring.assign), still costed by ring.evaluate.
    planner: str = "select_ring"
    speed_probe: ProbeConfig = ProbeConfig()  # a newcomer's speed measured with real frames before it is seated
    # Replica rings (coordinator.swarm.ring_set): 1 forms one ring however large the pool.
    max_rings: int = option(0, "form up to this many rings over disjoint nodes when the pool holds more than one "
                               "ring's worth beside the spares (0: as many as it holds; 1: one ring)")
    ring_spares: int | None = option(None, "nodes kept off every ring for the first ring's roles before another "
                                           "ring forms (default: one hot standby per stage of the first ring)")
    # Jobs a stage may hold K/V for at once, sent with every Assignment: derived from the
    # gateway's concurrency at assembly (coordinator.assembly.open_jobs_per_stage); 0 names none.
    max_open_jobs: int = 0
    drain_s: float = option(60.0, "with one ring, a re-form that a join asks for waits at most this long for the "
                                  "ring's running jobs to finish (they would re-prefill on the new ring); so does a "
                                  "replica ring draining a newcomer no longer needed")

    def __post_init__(self) -> None:
        if self.planner not in ("select_ring", "all_nodes"):
            raise ValueError(f"planner must be 'select_ring' or 'all_nodes', got {self.planner!r}")
        if self.max_rings < 0 or (self.ring_spares is not None and self.ring_spares < 0):
            raise ValueError(f"max_rings must be >= 0 (0: no limit) and ring_spares >= 0, got {self.max_rings} "
                             f"and {self.ring_spares}")


@dataclass(frozen=True)
class RingState:
    """A formed ring: every stage acknowledged its Assignment for `epoch`."""

    epoch: int
    stages: tuple[tuple[PeerId, LayerRange], ...]  # in ring order: head first
    assignments: tuple[Assignment, ...]
    ring_id: int = 0  # which of the swarm's rings (coordinator.swarm.ring_set); epochs are unique across rings

    @property
    def head(self) -> PeerId:
        return self.stages[0][0]

    @property
    def tail(self) -> PeerId:
        return self.stages[-1][0]


@dataclass(frozen=True)
class Snapshot:
    """What formation decides on: the registry as it stands."""

    coordinator: PeerId
    registrations: Mapping[PeerId, Register]  # every registered node
    links: Mapping[tuple[PeerId, PeerId], float]  # measured one-way latency (src, dst) -> s
    held: Mapping[PeerId, LayerRange]  # layers each node reported Ready with
    faulty: Mapping[PeerId, str]  # peer -> why audits excluded it
    plan: Plan | None = None  # the plan in force
    ring: RingState | None = None  # the ring in force
    epoch: int = 0  # the last epoch handed out (formed or not)


@dataclass(frozen=True)
class ModelIdentity:
    """What every Assignment names about the model, its wire format and the jobs a stage holds."""

    spec: ModelSpec
    manifest_digest: str
    wire_dtype: str
    aux_dtype: str | None
    max_open_jobs: int = 0  # jobs a stage may hold K/V for at once (SwarmConfig.max_open_jobs; 0: none named)


@dataclass(frozen=True)
class Formation:
    """A ring to form (or keep) and the roles around it. Assignments are unsigned."""

    members: frozenset[PeerId]  # the eligible members it was decided for
    plan: Plan
    network: Network  # what `plan` was chosen on
    epoch: int
    # False: the same stages as the ring in force, which keeps its epoch (and every job's
    # K/V); `assignments` is then empty and only roles may have changed.
    new_ring: bool
    stages: tuple[tuple[PeerId, LayerRange], ...]  # ring order
    assignments: tuple[Assignment, ...]  # one per stage, ring order
    roles: tuple[Assignment, ...]  # members off the ring with a role, by peer id


@dataclass(frozen=True)
class NoRing:
    members: frozenset[PeerId]
    reason: str


def eligible(registered: Iterable[PeerId], faulty: Mapping[PeerId, str]) -> frozenset[PeerId]:
    """Registered nodes an audit has not excluded: the members a ring is formed for."""
    return frozenset(registered) - frozenset(faulty)


def choose(snapshot: Snapshot, members: frozenset[PeerId], config: SwarmConfig, model: ModelSpec) -> tuple[Plan, Network]:
    """The ring for `members` on what was measured: ring.reselect when some of the ring in
    force survives (moving weights costs more than a slightly slower ring), else
    ring.select_ring (or the capacity split, planner "all_nodes"). Raises ring.RingError
    when no ring fits."""
    cfg = config.topology
    regs = {p: snapshot.registrations[p] for p in members}
    held = seeding.held_or_stored(regs, snapshot.held, model.num_layers)  # on disk counts: moving it costs no network
    network = topology.build_network(snapshot.coordinator, regs, snapshot.links, held, cfg, model)
    constraints = Constraints(one_per_subnet=cfg.one_per_subnet, trusted_ends=bool(cfg.trusted_peers))
    workload = cfg.workload()
    if config.planner == "all_nodes":
        try:
            split = split_by_capacity([Capacity(p, r.memory_bytes, r.decode_s_per_layer) for p, r in regs.items()],
                                      model.num_layers, model.bytes_per_layer, cfg.speed_tolerance)
        except AssignError as exc:
            raise InfeasibleError(str(exc), len(regs)) from None
        return evaluate([Stage(PeerId(p), r) for p, r in split], network, model, workload), network
    takeover = standby_takeover(snapshot.plan, snapshot.held, members, network, model, workload, config.churn)
    if takeover is not None:
        return takeover, network
    if snapshot.plan is not None and set(snapshot.plan.peers) & members:
        return reselect(snapshot.plan, network, model, workload, constraints, config.churn), network
    if snapshot.plan is None:  # a restarted coordinator: the ring that was serving, as it was
        warm = warm_plan(snapshot.held, members, network, model, workload, stage_holders(snapshot.registrations))
        if warm is not None:
            return warm, network
    return select_ring(network, model, workload, constraints), network


def standby_takeover(plan: Plan | None, held: Mapping[PeerId, LayerRange], members: frozenset[PeerId],
                     network: Network, model: ModelSpec, workload, churn: ChurnPolicy = ChurnPolicy()) -> Plan | None:
    """The plan in force with every stage that left (or was excluded) replaced by its hot
    standby, which already holds that slice warm: nobody reloads, nobody else moves, and
    the ring serves again as soon as the standbys acknowledge. None when no stage left,
    when a departed stage has no standby among `members` holding exactly its slice (then
    re-selection decides), or when the standby's ring does not fit (ring.RingError).
    Standbys are taken in peer order where a stage has several."""
    if plan is None or not plan.roles or all(s.peer in members for s in plan.stages):
        return None
    stages = []
    for index, s in enumerate(plan.stages):
        if s.peer in members:
            stages.append(s)
            continue
        standby = next((p for p, role in sorted(plan.roles.items()) if role.kind is RoleKind.HOT_STANDBY
                        and role.stage_index == index and p in members and held.get(p) == s.layers), None)
        if standby is None:
            return None
        stages.append(Stage(standby, s.layers))
    try:
        seated = evaluate(stages, network, model, workload)
    except RingError:
        return None
    moves, move_s = plan_moves(stages, network, model, churn)
    return dataclasses.replace(seated, roles=assign_roles(seated, network, model, workload), moves=moves, move_s=move_s)


def warm_plan(held: Mapping[PeerId, LayerRange], members: frozenset[PeerId], network: Network, model: ModelSpec,
              workload, stage_holders: Collection[PeerId] = ()) -> Plan | None:
    """The ring the members' loaded slices already make, when they tile [0, L) in order
    (a coordinator restarted under warm nodes has no plan, only what each re-registered
    holding): kept as it is, so nobody reloads; the next membership change re-selects
    from it. Where two members hold the same slice the one that held it as a stage
    (`stage_holders`) is taken, then the lower peer id. The rest get roles
    (ring.assign_roles, which keeps a standby on the slice it holds). None when the
    slices leave a gap or the ring does not fit (ring.RingError)."""
    stages = held_ring(held, members, model.num_layers, stage_holders)
    if stages is None:
        return None
    try:
        plan = evaluate([Stage(p, r) for p, r in stages], network, model, workload)
    except RingError:
        return None
    return dataclasses.replace(plan, roles=assign_roles(plan, network, model, workload))


def stage_holders(registrations: Mapping[PeerId, Register]) -> frozenset[PeerId]:
    """Nodes that re-registered holding a slice they served as a stage (not kept warm for a role)."""
    return frozenset(p for p, reg in registrations.items() if reg.held_role == RoleKind.STAGE.value)


def rejoining(snapshot: Snapshot, members: frozenset[PeerId], model: ModelSpec) -> bool:
    """Whether warm nodes are still re-registering with a restarted coordinator: no plan
    yet, members hold slices, and the slices held as stages do not make a ring yet
    (forming now would reload, or seat a standby where its stage is about to return)."""
    held = {p: r for p, r in snapshot.held.items() if p in members}
    staged = {p: r for p, r in held.items() if p in stage_holders(snapshot.registrations)}
    return snapshot.plan is None and bool(held) and held_ring(staged, members, model.num_layers) is None


def held_ring(held: Mapping[PeerId, LayerRange], members: frozenset[PeerId], num_layers: int,
              preferred: Collection[PeerId] = ()) -> list[tuple[PeerId, LayerRange]] | None:
    """The members' held slices in ring order when they tile [0, num_layers), else None;
    of two holding one slice, one in `preferred` first, then the lower peer id."""
    stages, end = [], 0
    for start, stop, _, peer in sorted((r.start, r.end, p not in preferred, p) for p, r in held.items() if p in members):
        if start == end:
            stages.append((peer, LayerRange(start, stop)))
            end = stop
    return stages if end == num_layers else None


def decide(snapshot: Snapshot, members: frozenset[PeerId], config: SwarmConfig,
           model: ModelIdentity) -> Formation | NoRing:
    """The formation for `members`. A ring with the stages of the one in force keeps its
    epoch; any other ring gets the next epoch after `snapshot.epoch`."""
    try:
        plan, network = choose(snapshot, members, config, model.spec)
    except RingError as exc:
        return NoRing(members, str(exc))
    in_force = snapshot.ring.assignments if snapshot.ring is not None else ()  # a stage keeps its relay
    plan, network, relays = relay_choice.place(plan, network, {p: snapshot.registrations[p] for p in members},
                                               snapshot.links, config.topology, model.spec, in_force)
    plan = with_moves(plan, network, model.spec, config.churn)  # what each stage must fetch first, predicted
    stages = tuple((s.peer, s.layers) for s in plan.stages)
    ring, epoch = snapshot.ring, snapshot.epoch + 1
    assignments = stage_assignments(stages, snapshot, epoch, model, relays)
    if ring is not None and ring.stages == stages and relay_choice.in_force(ring.assignments) == relays:
        return Formation(members, plan, network, ring.epoch, False, stages, (),
                         role_assignments(plan, snapshot, members, ring.epoch, model, relays))
    return Formation(members, plan, network, epoch, True, stages, assignments,
                     role_assignments(plan, snapshot, members, epoch, model, relays))


def stage_assignments(stages: tuple[tuple[PeerId, LayerRange], ...], snapshot: Snapshot, epoch: int,
                      model: ModelIdentity, relays: Mapping[PeerId, PeerId] | None = None) -> tuple[Assignment, ...]:
    """One stage Assignment per stage: its layers, its neighbours (None: the coordinator),
    where to dial its successor (through its relay first) and, for a stage nobody can
    dial, the relay-role node to reserve on (`relays`, coordinator.swarm.relay_choice)."""
    out, relays = [], relays or {}
    for i, (peer, layers) in enumerate(stages):
        successor = stages[i + 1][0] if i + 1 < len(stages) else None
        addrs = relay_choice.successor_addrs(successor, relays.get(successor), snapshot.registrations,
                                             MAX_SUCCESSOR_ADDRS) if successor is not None else ()
        out.append(_assignment(model, epoch, peer, RoleKind.STAGE, layers, predecessor=stages[i - 1][0] if i > 0 else None,
                               successor=successor, successor_addrs=addrs,
                               relay_addrs=relay_choice.relay_addrs(relays.get(peer), snapshot.registrations),
                               relay_for=relay_choice.relay_for(peer, relays)))
    return tuple(out)


def role_layers(plan: Plan, peer: PeerId, held: Mapping[PeerId, LayerRange], num_layers: int) -> LayerRange | None:
    """The slice a member off the ring keeps warm or checks: a standby's or verifier's
    stage, a decode replica's whole model, what a seeder or relay holds. None: nothing."""
    role = plan.roles[peer]
    if role.stage_index is not None:
        return plan.stages[role.stage_index].layers
    return held.get(peer)


def role_assignments(plan: Plan, snapshot: Snapshot, members: frozenset[PeerId], epoch: int,
                     model: ModelIdentity, relays: Mapping[PeerId, PeerId] | None = None) -> tuple[Assignment, ...]:
    """An Assignment naming its role for every member off the ring the plan gave one, in
    peer order (a relay's naming whom it relays for, `relays`: stage -> relay). A role that
    holds nothing names the empty range [0, 0) on the wire."""
    on_ring = set(plan.peers)
    return tuple(_assignment(model, epoch, peer, plan.roles[peer].kind,
                             role_layers(plan, peer, snapshot.held, model.spec.num_layers),
                             relay_for=relay_choice.relay_for(peer, relays))
                 for peer in sorted(members - on_ring) if peer in plan.roles)


def same_assignment(a: Assignment | None, b: Assignment) -> bool:
    """Whether `b` says what `a` said (signatures aside): no need to send it again."""
    return a is not None and dataclasses.replace(a, signature=b"") == dataclasses.replace(b, signature=b"")


def _assignment(model: ModelIdentity, epoch: int, peer: PeerId, kind: RoleKind, layers: LayerRange | None, *,
                predecessor: PeerId | None = None, successor: PeerId | None = None,
                successor_addrs: tuple[str, ...] = (), relay_addrs: tuple[str, ...] = (),
                relay_for: tuple[str, ...] = ()) -> Assignment:
    start, end = (layers.start, layers.end) if layers is not None else (0, 0)
    return Assignment(epoch=epoch, peer_id=peer, role=kind.value, layer_start=start, layer_end=end,
                      predecessor=predecessor, successor=successor, successor_addrs=successor_addrs, relay_addrs=relay_addrs,
                      relay_for=relay_for,
                      model=model.spec.name, manifest_digest=model.manifest_digest, wire_dtype=model.wire_dtype,
                      aux_dtype=model.aux_dtype, max_open_jobs=model.max_open_jobs)
