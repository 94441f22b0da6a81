"""A stage its predecessor cannot reach sits out of rings, then is tried again (issue 19).

Bug guarded: a node behind a NAT (it dials out, nobody can dial it) was seated again and
again: `successor_unreachable` did not count against it, so every request failed until a
probe refresh 300 s later happened to dial out. Sound: the pure table is checked at exact
times, and the swarm's own eligibility is read after a real JobError report.
"""

from __future__ import annotations

import trio

from coordinator.swarm import unreachable
from coordinator.swarm.formation import RingState
from coordinator.swarm.speed_probe import ProbeConfig
from coordinator.swarm.swarm import Member, Swarm, SwarmConfig
from coordinator.swarm.unreachable import BackoffPolicy, Strike
from ring import PeerId
from shard.layers import LayerRange
from shard.wire.messages import JobError, LinkReport, Register

A, B, C = PeerId("a"), PeerId("b"), PeerId("c")


def test_each_strike_doubles_the_sit_out_up_to_its_cap():
    policy = BackoffPolicy(first_s=10.0, max_s=30.0)
    table = unreachable.strike({}, B, 100.0, "dial failed", policy)
    assert table == {B: Strike(1, 110.0, "dial failed")}
    assert unreachable.sitting_out(table, 109.9) == {B: "unreachable: dial failed"}
    assert unreachable.sitting_out(table, 110.0) == {} and unreachable.next_return_s(table, 105.0) == 110.0
    table = unreachable.strike(table, B, 120.0, "again", policy)  # tried again, failed again
    assert table[B] == Strike(2, 140.0, "again")
    table = unreachable.strike(table, B, 150.0, "again", policy)
    assert table[B].until_s == 180.0  # 40 s capped at 30 s


def test_reports_of_the_same_failure_while_it_sits_out_add_no_strike():
    # Several jobs fail on one unreachable hop at once: one strike, not one per job.
    table = unreachable.strike({}, B, 0.0, "x")
    assert unreachable.strike(table, B, 5.0, "x") == table


def test_a_measured_round_trip_readmits_at_once_and_keeps_the_strikes():
    table = unreachable.strike({}, B, 0.0, "x")
    table = unreachable.readmit(table, [B, C], 3.0)
    assert table == {B: Strike(1, 3.0, "x")} and unreachable.sitting_out(table, 3.0) == {}


def register(peer: PeerId, digest: str) -> Register:
    return Register(peer_id=peer, model="m", manifest_digest=digest, device="cpu", memory_bytes=1 << 30,
                    decode_s_per_layer=1e-3, prefill_s_per_layer_token=1e-5, upload_bytes_per_s=1e6,
                    download_bytes_per_s=1e6)


def test_a_successor_unreachable_report_blames_the_reporters_successor_on_the_ring_in_force():
    ring = RingState(4, ((A, LayerRange(0, 2)), (B, LayerRange(2, 5))), ())

    def error(epoch: int, code: str = "successor_unreachable") -> JobError:
        return JobError(job_id="j", epoch=epoch, round=1, code=code, message="m", stage=A)

    assert unreachable.blamed(error(4), A, ring) == B
    assert unreachable.blamed(error(3), A, ring) is None  # another epoch's report
    assert unreachable.blamed(error(4), B, ring) is None  # the tail reached the coordinator to report
    assert unreachable.blamed(error(4, "stale_epoch"), A, ring) is None
    assert unreachable.blamed(error(4), A, None) is None


def test_the_swarm_excludes_an_unreachable_node_until_a_peer_measures_it(tiny_llama_store):
    async def main():
        swarm = Swarm(tiny_llama_store, bytes(32), SwarmConfig(speed_probe=ProbeConfig(enabled=False)))  # members with no node
        for p in (A, B, C):
            swarm.members[p] = Member(register(p, tiny_llama_store.digest), control=None)
        swarm.report_unreachable(B, "a could not reach it: no connection within 10 s")
        excluded = swarm._eligible()
        swarm._on_link_report(C, LinkReport(peer_id=C, rtt_ms={B: 3.0}))  # C reached B: B is dialable
        return excluded, swarm._eligible(), swarm.unreachable.table[B].strikes

    excluded, readmitted, strikes = trio.run(main)
    assert excluded == {A, C}
    assert readmitted == {A, B, C} and strikes == 1


# -- stalls (issue 20) --------------------------------------------------------------------

def test_a_stall_strike_sits_out_is_not_readmitted_by_a_round_trip_and_excludes_on_the_third():
    # Bug guarded: a stage that answers pings but not frames readmitted by the next link
    # report, or seated again forever. Sound: exact times under a stated policy.
    policy = unreachable.StallPolicy(first_s=10.0, exclude_after=3, excluded_s=3600.0)
    table = unreachable.strike({}, B, 0.0, "missed", policy, "stalled")
    assert table == {B: Strike(1, 10.0, "missed", "stalled")}
    assert unreachable.readmit(table, [B], 3.0) == table
    assert unreachable.sitting_out(table, 3.0) == {B: "stalled: missed"}
    table = unreachable.strike(table, B, 10.0, "missed", policy, "stalled")
    assert table[B].until_s == 30.0
    table = unreachable.strike(table, B, 30.0, "missed", policy, "stalled")
    assert table[B] == Strike(3, 3630.0, "missed", "stalled")


def test_the_stall_suspect_is_the_newcomer_then_the_one_in_most_missed_rounds():
    # Bug guarded: blaming a stage with a long clean history for a newcomer's stall.
    # Sound: each rule decides one case with the others tied.
    stages = [A, B, C]
    assert unreachable.stall_suspect(stages, {A: 50, B: 0, C: 50}, {}) == B
    assert unreachable.stall_suspect(stages, {}, {A: 1, B: 3, C: 2}) == B
    assert unreachable.stall_suspect(stages, {}, {}) == C  # all tied: the latest in ring order


def test_a_staller_in_a_fresh_swarm_is_found_within_as_many_misses_as_stages():
    # Bug guarded: blame cycling among honest stages while the staller stays seated.
    # Sound: simulate every seating order of 4 new nodes, one stalling: each missed ring
    # blames one stage, which sits out (the others stay); the staller must be blamed
    # before every honest node has been blamed.
    import itertools

    peers = [PeerId(f"p{i}") for i in range(4)]
    for order in itertools.permutations(peers):
        for staller in peers:
            missed: dict[PeerId, int] = {}
            seated, blamed = list(order), []
            while True:
                for p in seated:
                    missed[p] = missed.get(p, 0) + 1
                suspect = unreachable.stall_suspect(seated, {}, missed)
                blamed.append(suspect)
                if suspect == staller:
                    break
                seated.remove(suspect)
            assert len(blamed) <= len(peers)
