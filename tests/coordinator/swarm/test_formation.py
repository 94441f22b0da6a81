"""Ring formation's decision (coordinator/swarm/formation.py): pure, no streams, no keys."""

from __future__ import annotations

import dataclasses

from coordinator.swarm import formation
from coordinator.swarm.formation import Formation, ModelIdentity, NoRing, RingState, Snapshot, SwarmConfig
from ring import ModelSpec, PeerId, Role, RoleKind, Stage, evaluate
from shard.layers import LayerRange
from shard.wire.messages import Register
from shard.wire.roles import ROLE_STAGE

COORD = PeerId("coord")
MODEL = ModelSpec("m", num_layers=4, bytes_per_layer=1 << 20, kv_bytes_per_token_layer=1024,
                  activation_bytes_per_token=256)
IDENTITY = ModelIdentity(MODEL, "digest", "f32", None)


def _reg(peer: str, *, memory: int = 1 << 30, up: float = 12.5e6, decode_s: float = 1e-3) -> Register:
    return Register(peer_id=peer, model="m", manifest_digest="digest", device="cpu", memory_bytes=memory,
                    decode_s_per_layer=decode_s, prefill_s_per_layer_token=1e-5, upload_bytes_per_s=up,
                    download_bytes_per_s=5 * up, listen_addrs=(f"/ip4/127.0.0.1/tcp/{len(peer)}", f"/dns/{peer}"))


def _snapshot(regs: list[Register], **kw) -> Snapshot:
    return Snapshot(COORD, {PeerId(r.peer_id): r for r in regs}, kw.pop("links", {}), kw.pop("held", {}),
                    kw.pop("faulty", {}), **kw)


def _decide(snapshot: Snapshot, config: SwarmConfig = SwarmConfig()) -> Formation | NoRing:
    return formation.decide(snapshot, formation.eligible(snapshot.registrations, snapshot.faulty), config, IDENTITY)


def _chain_is_well_formed(f: Formation) -> None:
    peers = [p for p, _ in f.stages]
    assert [a.peer_id for a in f.assignments] == peers
    assert [(a.layer_start, a.layer_end) for a in f.assignments] == [(r.start, r.end) for _, r in f.stages]
    assert f.stages[0][1].start == 0 and f.stages[-1][1].end == MODEL.num_layers
    assert all(a.end == b.start for (_, a), (_, b) in zip(f.stages, f.stages[1:]))
    assert [a.predecessor for a in f.assignments] == [None, *peers[:-1]]
    assert [a.successor for a in f.assignments] == [*peers[1:], None]
    assert all(a.role == ROLE_STAGE and a.epoch == f.epoch and a.signature == b"" for a in f.assignments)


def test_a_first_ring_gets_the_next_epoch_and_a_linked_chain_of_unsigned_assignments():
    # Bug guarded: an assignment naming the wrong neighbour or epoch, which every stage
    # would refuse frames over. Sound: checks each link of the chain against the stages.
    snapshot = _snapshot([_reg("a"), _reg("b"), _reg("c")], epoch=6)
    f = _decide(snapshot, SwarmConfig(planner="all_nodes"))
    assert isinstance(f, Formation) and f.new_ring and f.epoch == 7
    assert sorted(p for p, _ in f.stages) == ["a", "b", "c"]  # all_nodes: every member a stage
    _chain_is_well_formed(f)
    for a in f.assignments[:-1]:  # where to dial the successor: its own listen addresses
        assert a.successor_addrs == snapshot.registrations[a.successor].listen_addrs
    assert all((a.model, a.manifest_digest, a.wire_dtype) == ("m", "digest", "f32") for a in f.assignments)
    # The open-jobs cap the identity names (the gateway's need, issue 20) goes to every stage and role.
    capped = formation.decide(snapshot, formation.eligible(snapshot.registrations, snapshot.faulty),
                              SwarmConfig(planner="all_nodes"), dataclasses.replace(IDENTITY, max_open_jobs=600))
    assert {a.max_open_jobs for a in (*capped.assignments, *capped.roles)} == {600}
    assert {a.max_open_jobs for a in f.assignments} == {0}


def test_the_same_stages_keep_the_epoch_and_send_no_stage_assignments():
    # Bug guarded: re-forming an unchanged ring under a new epoch, which drops every job's
    # K/V for nothing. Sound: the second decision runs on the first one's outcome.
    snapshot = _snapshot([_reg("a"), _reg("b")], epoch=2)
    first = _decide(snapshot, SwarmConfig(planner="all_nodes"))
    assert isinstance(first, Formation) and first.new_ring
    formed = dataclasses.replace(snapshot, plan=first.plan, ring=RingState(first.epoch, first.stages, first.assignments),
                                 epoch=first.epoch)
    again = _decide(formed, SwarmConfig(planner="all_nodes"))
    assert isinstance(again, Formation) and not again.new_ring
    assert again.epoch == first.epoch == 3 and again.stages == first.stages and again.assignments == ()


def test_no_ring_is_a_decision_with_its_reason():
    # Bug guarded: a ring error escaping the formation task (the coordinator would stop
    # forming). Sound: nodes without memory for a single layer cannot form any ring.
    snapshot = _snapshot([_reg("a", memory=0), _reg("b", memory=0)])
    decision = _decide(snapshot)
    assert isinstance(decision, NoRing)
    assert decision.members == {"a", "b"} and "no feasible ring among 2 candidate nodes" in decision.reason


def test_faulty_nodes_are_not_eligible():
    snapshot = _snapshot([_reg("a"), _reg("b"), _reg("c")], faulty={PeerId("b"): "audit output_mismatch"})
    assert formation.eligible(snapshot.registrations, snapshot.faulty) == {"a", "c"}
    f = _decide(snapshot, SwarmConfig(planner="all_nodes"))
    assert isinstance(f, Formation) and "b" not in {p for p, _ in f.stages} and f.members == {"a", "c"}


def test_a_role_that_holds_nothing_names_the_empty_range_instead_of_raising():
    # Bug guarded: the role of a seeder that holds no layers was built as LayerRange(0, 0),
    # which raises, so one such node stopped the coordinator forming; and a node with no
    # memory and a poor uplink was made a relay, a role nothing carries out (issue 24).
    # Sound: a node with no memory can only be a seeder or nothing, and holds nothing.
    snapshot = _snapshot([_reg("a"), _reg("poor", memory=0, up=1e6), _reg("rich", memory=0, up=1e9)])
    f = _decide(snapshot)
    assert isinstance(f, Formation) and f.new_ring
    roles = {a.peer_id: a for a in f.roles}
    assert "poor" not in roles and "poor" not in f.plan.roles and roles["rich"].role == RoleKind.WEIGHT_SEEDER.value
    assert all((a.layer_start, a.layer_end, a.epoch) == (0, 0, f.epoch) for a in roles.values())
    held = dataclasses.replace(snapshot, held={PeerId("rich"): LayerRange(1, 3)})
    f = _decide(held)
    assert isinstance(f, Formation)
    assert {a.peer_id: (a.layer_start, a.layer_end) for a in f.roles}["rich"] == (1, 3)  # a seeder seeds what it holds


def test_role_layers_follow_the_role():
    # Bug guarded: a standby warming the wrong slice (it could not take its stage over).
    # Sound: one plan with one member of each kind, the expected slice written out.
    snapshot = _snapshot([_reg(p) for p in "abcdef"], held={PeerId("e"): LayerRange(2, 4)})
    plan = evaluate([Stage(PeerId("a"), LayerRange(0, 1)), Stage(PeerId("b"), LayerRange(1, 4))],
                    formation.choose(snapshot, frozenset("ab"), SwarmConfig(), MODEL)[1], MODEL,
                    SwarmConfig().topology.workload())
    plan = dataclasses.replace(plan, roles={
        PeerId("c"): Role(RoleKind.HOT_STANDBY, "", 1),
        PeerId("e"): Role(RoleKind.WEIGHT_SEEDER, ""), PeerId("f"): Role(RoleKind.SPOT_CHECK_VERIFIER, "", 0)})
    got = formation.role_assignments(plan, snapshot, frozenset("abcdef"), 9, IDENTITY)
    assert [(a.peer_id, a.role, a.layer_start, a.layer_end, a.epoch) for a in got] == [
        ("c", "hot_standby", 1, 4, 9), ("e", "weight_seeder", 2, 4, 9),
        ("f", "spot_check_verifier", 0, 1, 9)]
    assert all(a.predecessor is None and a.successor is None and a.signature == b"" for a in got)
    # Members not in `members` (left meanwhile) get nothing.
    assert [a.peer_id for a in formation.role_assignments(plan, snapshot, frozenset("abc"), 9, IDENTITY)] == ["c"]


def test_deciding_twice_on_one_snapshot_gives_one_decision():
    # Bug guarded: formation depending on hidden state (set or dict order, a clock).
    # Sound: equal inputs, compared whole.
    snapshot = _snapshot([_reg("a", decode_s=2e-3), _reg("b"), _reg("c", memory=0)], epoch=1)
    assert _decide(snapshot) == _decide(dataclasses.replace(snapshot, registrations=dict(
        reversed(list(snapshot.registrations.items())))))


def test_same_assignment_ignores_only_the_signature():
    f = _decide(_snapshot([_reg("a")]))
    a = f.assignments[0]
    assert formation.same_assignment(a, dataclasses.replace(a, signature=b"x" * 64))
    assert not formation.same_assignment(a, dataclasses.replace(a, epoch=a.epoch + 1))
    assert not formation.same_assignment(None, a)


def _formed_with_standby(held_by_standby: LayerRange | None):
    """A formed 2-stage ring a[0,1) b[1,4) whose plan names c hot standby of stage 1."""
    regs = [_reg(p) for p in "abcd"]
    held = {PeerId("a"): LayerRange(0, 1), PeerId("b"): LayerRange(1, 4)}
    if held_by_standby is not None:
        held[PeerId("c")] = held_by_standby
    snapshot = _snapshot(regs, held=held, epoch=5)
    network = formation.choose(snapshot, frozenset("abcd"), SwarmConfig(), MODEL)[1]
    plan = evaluate([Stage(PeerId("a"), LayerRange(0, 1)), Stage(PeerId("b"), LayerRange(1, 4))], network, MODEL,
                    SwarmConfig().topology.workload())
    plan = dataclasses.replace(plan, roles={PeerId("c"): Role(RoleKind.HOT_STANDBY, "", 1),
                                            PeerId("d"): Role(RoleKind.SPOT_CHECK_VERIFIER, "", 0)})
    stages = ((PeerId("a"), LayerRange(0, 1)), (PeerId("b"), LayerRange(1, 4)))
    return dataclasses.replace(snapshot, plan=plan, ring=RingState(5, stages, ()))


def test_a_departed_stages_hot_standby_takes_its_place_with_the_slice_it_holds():
    # Bug guarded: a stage's death re-selecting from scratch (the standby's warm slice
    # wasted, other stages moved and reloaded) instead of seating the standby. Sound: the
    # decision must be exactly the old ring with c for b, and no weight moves.
    snapshot = _formed_with_standby(LayerRange(1, 4))
    excluded = dataclasses.replace(snapshot, faulty={PeerId("b"): "audit output_mismatch"})
    for state in (snapshot, excluded):  # b left the swarm / b was excluded by an audit (still registered)
        members = formation.eligible(set(state.registrations) - ({"b"} if state is snapshot else set()), state.faulty)
        f = formation.decide(state, members, SwarmConfig(), IDENTITY)
        assert isinstance(f, Formation) and f.new_ring and f.epoch == 6
        assert f.stages == ((PeerId("a"), LayerRange(0, 1)), (PeerId("c"), LayerRange(1, 4)))
        assert f.plan.moves == () and f.plan.move_s == 0.0
        _chain_is_well_formed(f)
        assert "c" not in f.plan.roles and "d" in f.plan.roles  # roles re-assigned around the new ring


def test_no_takeover_without_a_standby_holding_the_slice():
    # A standby that never loaded its slice (or holds another) is no faster than anyone:
    # re-selection decides. Sound: standby_takeover alone, on the same plan.
    snapshot = _formed_with_standby(None)
    network = formation.choose(snapshot, frozenset("acd"), SwarmConfig(), MODEL)[1]
    workload = SwarmConfig().topology.workload()
    assert formation.standby_takeover(snapshot.plan, snapshot.held, frozenset("acd"), network, MODEL, workload) is None
    held = {**snapshot.held, PeerId("c"): LayerRange(1, 3)}
    assert formation.standby_takeover(snapshot.plan, held, frozenset("acd"), network, MODEL, workload) is None
    # Nobody left: nothing to take over.
    held = {**snapshot.held, PeerId("c"): LayerRange(1, 4)}
    assert formation.standby_takeover(snapshot.plan, held, frozenset("abcd"), network, MODEL, workload) is None
    assert formation.standby_takeover(snapshot.plan, held, frozenset("acd"), network, MODEL, workload) is not None


def test_whole_model_spares_of_one_ring_get_roles_that_something_carries_out():
    # Bug guarded: a role nothing carries out (a whole-model replica no request reaches)
    # assigned anyway, holding a node's memory idle: with one ring such nodes are standbys,
    # seeders or verifiers (with --max-rings > 1 they are one-stage rings: test_ring_set).
    snapshot = _snapshot([_reg(p, up=1e6) for p in "abcdefg"])
    f = _decide(snapshot)
    assert isinstance(f, Formation) and len(f.roles) == 7 - len(f.stages)
    assert {a.role for a in f.roles} <= {RoleKind.HOT_STANDBY.value, RoleKind.SPOT_CHECK_VERIFIER.value}
