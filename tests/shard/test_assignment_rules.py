"""Which assignments a node takes (shard.assignment_rules.decide): pure, no node needed.

Bug guarded: a node took any assignment its coordinator had signed, so an old one
replayed, or one meant for another node, re-seated it. Each case pins the decision and,
for refusals, the exact message.
"""

from __future__ import annotations

import dataclasses

import pytest

from shard.assignment_rules import ACKNOWLEDGE, TAKE, AssignmentRefused, decide
from shard.wire.messages import Assignment

ME, OTHER, DIGEST = "12D3KooWme", "12D3KooWother", "ab" * 32


def assignment(epoch: int = 2, role: str = "stage", **fields) -> Assignment:
    layers = (0, 4) if role == "stage" else (0, 0)
    return Assignment(**{**dict(epoch=epoch, peer_id=ME, role=role, layer_start=layers[0], layer_end=layers[1],
                                predecessor=None, successor=None, model="tiny", manifest_digest=DIGEST,
                                wire_dtype="f32"), **fields})


def test_a_first_or_newer_assignment_is_taken():
    assert decide(assignment(), ME, DIGEST, None) == TAKE
    assert decide(assignment(epoch=3), ME, DIGEST, assignment(epoch=2)) == TAKE
    assert decide(assignment(epoch=3, role="hot_standby"), ME, DIGEST, assignment(epoch=2)) == TAKE


def test_the_held_assignment_resent_is_acknowledged_only():
    held = assignment()
    assert decide(dataclasses.replace(held), ME, DIGEST, held) == ACKNOWLEDGE


def test_an_off_ring_role_may_change_within_its_epoch():
    # The coordinator re-sends roles without a new epoch when only roles changed.
    assert decide(assignment(role="verifier"), ME, DIGEST, assignment(role="hot_standby")) == TAKE


REFUSED = {
    "another node's": (assignment(peer_id=OTHER), None,
                       f"assignment for epoch 2 names peer {OTHER}, not this node {ME}"),
    "another model's": (assignment(manifest_digest="cd" * 32), None,
                        "assignment names model digest cdcdcdcdcdcd, this node holds abababababab"),
    "an older epoch (replay)": (assignment(epoch=1), assignment(epoch=2),
                                "assignment for epoch 1 is older than epoch 2, which this node holds (a replay)"),
    "a changed stage in the same epoch": (assignment(layer_end=2), assignment(),
                                          "assignment for epoch 2 changes this node's place in an epoch it already "
                                          "holds (a ring change takes a new epoch)"),
    "a stage demoted in the same epoch": (assignment(role="hot_standby"), assignment(),
                                          "assignment for epoch 2 changes this node's place in an epoch it already "
                                          "holds (a ring change takes a new epoch)"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refusals_say_which_rule_broke(case):
    a, held, text = REFUSED[case]
    with pytest.raises(AssignmentRefused) as info:
        decide(a, ME, DIGEST, held)
    assert str(info.value) == text


def test_the_open_jobs_cap_is_the_coordinators_under_the_volunteers_ceiling():
    # Bug guarded (issue 20): --max-open-jobs was a node flag only, so a gateway running
    # more than 128 jobs failed jobs until every volunteer raised it. The coordinator's
    # need now rules, the volunteer's own flag stays a ceiling, 0 names none.
    from shard.assignment_rules import open_jobs_cap
    from shard.stage_worker import WorkerConfig

    assert open_jobs_cap(0, 600) == 600  # the volunteer set nothing: the gateway's need
    assert open_jobs_cap(200, 600) == 200  # the volunteer's ceiling holds
    assert open_jobs_cap(200, 50) == 50
    assert open_jobs_cap(200, 0) == 200  # a coordinator naming none
    assert open_jobs_cap(0, 0) == WorkerConfig.max_open_jobs == 128


def test_a_negative_open_jobs_flag_is_refused():
    from shard.node_config import NodeConfig

    with pytest.raises(ValueError, match=r"max_open_jobs must be >= 0 \(0: the coordinator's\), got -1"):
        NodeConfig(coordinator="/ip4/127.0.0.1/tcp/1", max_open_jobs=-1)
