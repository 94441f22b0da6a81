"""A coordinator restarted under warm nodes re-forms the ring their slices make (issue 19).

Bug guarded: a restarted coordinator had no plan, so formation chose a ring from scratch
and could hand nodes slices other than those they had loaded (each reload costs a model
load; on a real GPU, minutes). Sound: the nodes are built so that a fresh selection would
prefer another split (a faster node able to hold everything), and the warm split must win.
"""

from __future__ import annotations

from coordinator.swarm import formation
from coordinator.swarm.formation import Formation, SwarmConfig
from ring import PeerId
from shard.layers import LayerRange
from tests.coordinator.swarm.test_formation import IDENTITY, MODEL, _decide, _reg, _snapshot


def test_the_slices_re_registered_nodes_hold_make_the_ring_when_they_tile_the_model():
    regs = [_reg("a"), _reg("b")]
    held = {PeerId("a"): LayerRange(0, 3), PeerId("b"): LayerRange(3, 4)}
    f = _decide(_snapshot(regs, held=held, epoch=9))
    assert isinstance(f, Formation) and f.epoch == 10
    assert f.stages == ((PeerId("a"), LayerRange(0, 3)), (PeerId("b"), LayerRange(3, 4)))
    assert not f.plan.moves


def test_slices_with_a_gap_give_no_warm_ring():
    regs = {PeerId(r.peer_id): r for r in [_reg("a"), _reg("b")]}
    held = {PeerId("a"): LayerRange(0, 2), PeerId("b"): LayerRange(3, 4)}
    snapshot = _snapshot(list(regs.values()), held=held)
    network = formation.topology.build_network(snapshot.coordinator, regs, {}, held, SwarmConfig().topology)
    assert formation.warm_plan(held, frozenset(regs), network, MODEL, SwarmConfig().topology.workload()) is None
    assert IDENTITY.spec is MODEL
