"""Which verifier nodes check a probation stage's round, and which of a job's frames they replay.

Pure parts of coordinator.trust.round_verifier; the I/O (fetch, VerifyRequest, verdict)
runs against real nodes in tests/e2e/test_probation_verifiers_ring.py.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

from coordinator.jobs.frames import chunk_frame
from coordinator.swarm.formation import RingState
from coordinator.trust.opinions import candidates
from coordinator.trust.receipt_check import ReceiptChecker, VerifiedRound
from coordinator.trust.round_verifier import stage_plan
from shard.layers import LayerRange
from shard.manifest import layer_file
from shard.wire.messages import Forward, Register

SLICE = LayerRange(1, 3)


def _reg(peer: str, held: tuple[int, int] = (0, 0), stored: tuple[int, ...] = ()) -> Register:
    return Register(peer_id=peer, model="m", manifest_digest="d", device="cpu", memory_bytes=1 << 30,
                    decode_s_per_layer=1e-3, prefill_s_per_layer_token=1e-4, upload_bytes_per_s=0.0,
                    download_bytes_per_s=0.0, held_start=held[0], held_end=held[1],
                    stored_files=tuple(layer_file(i) for i in stored))


def test_verifiers_keep_the_whole_slice_and_trusted_nodes_come_first():
    # Bug guarded: a verifier chosen without the slice's every layer fetches or fails (the
    # round waits, or goes out unverified), and a newcomer vouching for a newcomer is the
    # weaker word. Sound: each candidate differs from the next in exactly one property.
    registers = {
        "suspect": _reg("suspect", held=(1, 3)),  # the stage on probation itself
        "faulty": _reg("faulty", held=(1, 3)),
        "half": _reg("half", held=(1, 2)),  # keeps layer 1 only
        "stored": _reg("stored", held=(3, 5), stored=(1, 2)),  # trusted, slice in its store
        "warm": _reg("warm", held=(1, 3)),  # trusted, slice loaded
        "newcomer": _reg("newcomer", held=(1, 3)),  # on probation itself, slice loaded
        "mixed": _reg("mixed", held=(2, 3), stored=(1,)),  # trusted, layer 1 stored, 2 loaded
    }
    got = candidates(registers, SLICE, {"suspect", "faulty"}, lambda p: p == "newcomer")
    assert got == ["warm", "mixed", "stored", "newcomer"]
    assert candidates(registers, SLICE, set(registers), lambda p: False) == []


def test_a_verifier_stays_on_the_slice_it_verified_last():
    # Bug guarded: every slice checked by the same lowest-id node, which keeps one verify
    # slice loaded and so reloaded a 27-layer slice for every round it alternated between
    # two (a SmolLM2 request on probation took 14 s instead of a few). Sound: all three keep
    # the slice and are trusted; only what each verified last differs.
    registers = {p: _reg(p, stored=(1, 2, 3)) for p in ("a", "b", "c")}
    other = LayerRange(3, 4)
    assert candidates(registers, SLICE, set(), lambda p: False, {"a": other, "c": SLICE}) == ["c", "b", "a"]
    assert candidates(registers, SLICE, set(), lambda p: False, {"a": other}) == ["b", "c", "a"]


def _fwd(epoch: int, round: int) -> Forward:
    frame = chunk_frame("job", epoch, bytes(16), 0, [1, 2], decode=False, commit=((), 0), aux_layers=())
    return dataclasses.replace(frame, round=round)


def test_a_check_replays_every_round_sent_on_the_epoch_up_to_it_and_compares_the_verified(tiny_llama_store):
    # Bug guarded: a stage's K/V for the checked round holds every frame it processed of the
    # job on this epoch, in send order, including a round sent ahead and discarded (no
    # receipt: replayed, not compared); rounds sent after the checked one (ahead of it)
    # must not be replayed first, nor frames of another epoch. Sound: the rounds and the
    # stage's receipt per round are read back from the plan.
    job = ReceiptChecker(tiny_llama_store, os.urandom(32)).open_job("job", bytes(16), [1, 2])
    for epoch, r in [(2, 1), (2, 2), (3, 3), (3, 4), (3, 5), (3, 6)]:
        job.sent(_fwd(epoch, r), bytes(32))
    job._verified.update({1: VerifiedRound(2, ["h1", "t1"]), 3: VerifiedRound(3, ["h3", "t3"]),
                          5: VerifiedRound(3, ["h5", "t5"])})  # round 4: sent ahead and discarded
    ring = RingState(3, (("head", LayerRange(0, 2)), ("tail", LayerRange(2, 4))),
                     tuple(SimpleNamespace(wire_dtype="bf16", aux_dtype=None) for _ in range(2)))  # type: ignore[arg-type]
    plan = stage_plan(job, ring, 1, 5, "int8")
    assert plan.rounds == (3, 4, 5) and plan.receipts == {3: "t3", 5: "t5"}
    assert (plan.peer_id, plan.layers, plan.is_tail, plan.epoch, plan.quant) == ("tail", LayerRange(2, 4), True, 3, "int8")
    head = stage_plan(job, ring, 0, 3, "none")
    assert head.rounds == (3,) and head.receipts == {3: "h3"} and not head.is_tail
