"""The swarm's operator view (coordinator/swarm/status.py), pure."""

from __future__ import annotations

import dataclasses
import json

from coordinator.swarm import formation, status
from coordinator.swarm.formation import Formation, SwarmConfig
from coordinator.swarm.topology import TraversalLog
from ring import PeerId
from shard.layers import LayerRange
from tests.coordinator.swarm.test_formation import COORD, IDENTITY, MODEL, _reg, _snapshot


def test_topology_info_reports_every_node_with_its_own_facts_as_json():
    # Bug guarded: a node's facts shown under another node, or a value JSON cannot carry
    # (the page would fail for everyone). Sound: each field checked against its source.
    snapshot = _snapshot([_reg("a"), _reg("b", memory=0)], links={(PeerId("a"), COORD): 0.004},
                         held={PeerId("a"): LayerRange(0, 4)}, faulty={PeerId("b"): "audit unanswered"})
    f = formation.decide(snapshot, frozenset({PeerId("a")}), SwarmConfig(), IDENTITY)
    assert isinstance(f, Formation)
    info = status.topology_info(dataclasses.replace(snapshot, plan=f.plan), TraversalLog(), SwarmConfig().topology, MODEL)
    json.dumps(info)
    assert info["nodes"]["a"]["held"] == [0, 4] and info["nodes"]["b"]["held"] is None
    assert info["nodes"]["a"]["one_way_to_coordinator_s"] == 0.004 and info["nodes"]["b"]["one_way_to_coordinator_s"] is None
    assert info["nodes"]["b"]["faulty"] == "audit unanswered" and info["nodes"]["a"]["faulty"] is None
    assert [s["peer_id"] for s in info["plan"]["stages"]] == ["a"] and info["measured_links"] == 1
    assert info["model"]["num_layers"] == MODEL.num_layers and info["measured"] == {}
