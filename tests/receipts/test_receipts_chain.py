"""verify_chain: an honest ring verifies, and each attack fails with the check that names it.

Each test builds honest receipts (receipts_ring.Ring), applies one attack, and asserts the
exact VerificationError subclass plus the stage index: asserting only "raises" would let a
check that fires for the wrong reason (e.g. a signature failure masking a missing coverage
check) pass unnoticed.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from receipts_ring import Ring, key, resign

from receipts import (
    BadSignature,
    ChainBroken,
    CoverageGap,
    CoverageOverlap,
    DuplicateReceipt,
    LayerOutOfRange,
    MalformedReceipt,
    OutOfOrder,
    Replayed,
    StaleReceipt,
    Truncated,
    VerificationError,
    WrongManifest,
    WrongSigner,
    WrongWeights,
    encode_receipt,
    sha256_digest,
    verify_chain,
)

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def rings(draw) -> Ring:
    num_layers = draw(st.integers(1, 40))
    stages = draw(st.integers(1, min(6, num_layers)))
    return Ring(num_layers=num_layers, stages=stages, epoch=draw(st.integers(0, 2**64 - 1)))


def _raises(cls, receipts, ring: Ring, **overrides) -> VerificationError:
    with pytest.raises(VerificationError) as info:
        verify_chain(receipts, **{**ring.check_kwargs(), **overrides})
    assert type(info.value) is cls, f"expected {cls.__name__}, got {type(info.value).__name__}: {info.value}"
    return info.value


@SETTINGS
@given(rings())
def test_honest_ring_verifies_as_objects_and_bytes(ring):
    # Bug guarded: a check that rejects valid chains (off-by-one in coverage, wrong custody
    # direction). Sound: every stage signs exactly what it did, for any split.
    receipts = ring.run()
    assert verify_chain(receipts, **ring.check_kwargs()) == receipts
    assert verify_chain([encode_receipt(r) for r in receipts], **ring.check_kwargs()) == receipts


SIGNED_FIELD_TAMPERS = {
    "manifest_digest": lambda r: sha256_digest(b"other manifest"),
    "weights_digest": lambda r: sha256_digest(b"other weights"),
    "epoch": lambda r: r.epoch ^ 1,  # stays a u64 at the top of the range
    "job_id": lambda r: "job-2",
    "round": lambda r: r.round + 1,
    "nonce": lambda r: bytes(reversed(r.nonce)),
    "layer_end": lambda r: r.layer_end + 1,
    "input_digest": lambda r: sha256_digest(b"other input"),
    "output_digest": lambda r: sha256_digest(b"other output"),
    "signer": lambda r: key(99).public_bytes(),
    "signature": lambda r: bytes([r.signature[0] ^ 1]) + r.signature[1:],
}


@SETTINGS
@given(rings(), st.data(), st.sampled_from(sorted(SIGNED_FIELD_TAMPERS)))
def test_any_single_field_edit_breaks_the_signature(ring, data, field):
    # Bug guarded: a field left out of the signed bytes (it could then be changed freely).
    receipts = ring.run()
    i = data.draw(st.integers(0, len(receipts) - 1))
    receipts[i] = dataclasses.replace(receipts[i], **{field: SIGNED_FIELD_TAMPERS[field](receipts[i])})
    assert _raises(BadSignature, receipts, ring).stage == i


@SETTINGS
@given(rings(), st.data())
def test_flipped_bit_in_encoded_receipt_never_verifies(ring, data):
    # Bug guarded: a byte of the wire form not covered by the signature or the strict decoder.
    encoded = [encode_receipt(r) for r in ring.run()]
    i = data.draw(st.integers(0, len(encoded) - 1))
    bit = data.draw(st.integers(0, 8 * len(encoded[i]) - 1))
    b = bytearray(encoded[i])
    b[bit // 8] ^= 1 << (bit % 8)
    encoded[i] = bytes(b)
    with pytest.raises((MalformedReceipt, BadSignature)) as info:
        verify_chain(encoded, **ring.check_kwargs())
    assert info.value.stage == i


@pytest.mark.parametrize(
    "field, value, cls",
    [
        ("job_id", "job-other", Replayed),
        ("nonce", b"\xff" * 16, Replayed),
        ("round", 5, Replayed),
        ("epoch", 6, StaleReceipt),
        ("manifest_digest", sha256_digest(b"another model"), WrongManifest),
    ],
)
def test_validly_signed_receipt_from_another_frame_is_a_replay(field, value, cls):
    # Bug guarded: a stage re-sending a genuine receipt from another job/nonce/epoch/round
    # (work it did once, claimed twice). Sound: the replayed receipt is honestly signed by the
    # assigned key, so only the frame binding can catch it.
    ring = Ring()
    receipts = ring.run()
    other = Ring(**{field: value}).run(round=0) if field != "round" else ring.run(round=value)
    receipts[2] = other[2]
    assert _raises(cls, receipts, ring).stage == 2


def test_whole_chain_replayed_into_a_later_round_is_rejected():
    ring = Ring()
    assert _raises(Replayed, ring.run(round=3), ring, round=4, sent_digest=ring.sent(3), received_digest=ring.received(3))


@SETTINGS
@given(rings().filter(lambda r: r.stages >= 2), st.data())
def test_dropped_receipt(ring, data):
    # Bug guarded: a stage skipped (its layers never ran). Dropping the last is a truncation,
    # dropping the first or a middle one leaves a gap at its layers.
    receipts = ring.run()
    i = data.draw(st.integers(0, len(receipts) - 1))
    dropped = receipts.pop(i)
    cls = Truncated if i == len(receipts) else CoverageGap
    err = _raises(cls, receipts, ring)
    assert err.layers[0] == dropped.layer_start if cls is Truncated else err.stage == i


def test_empty_list_is_truncated():
    ring = Ring()
    assert _raises(Truncated, [], ring).layers == (0, ring.num_layers)


@SETTINGS
@given(rings(), st.data())
def test_duplicated_receipt(ring, data):
    # Bug guarded: counting one stage's work twice (e.g. to pad a short chain).
    receipts = ring.run()
    i = data.draw(st.integers(0, len(receipts) - 1))
    receipts.insert(i + 1, receipts[i])
    assert _raises(DuplicateReceipt, receipts, ring).stage == i + 1


@SETTINGS
@given(rings().filter(lambda r: r.stages >= 2), st.data())
def test_reordered_receipts(ring, data):
    receipts = ring.run()
    perm = data.draw(st.permutations(range(len(receipts))).filter(lambda p: list(p) != sorted(p)))
    first_moved = next(j for j, p in enumerate(perm) if p != j)
    assert _raises(OutOfOrder, [receipts[p] for p in perm], ring).stage == first_moved


def test_gap_between_assigned_ranges():
    # Bug guarded: an assignment (or forged one) that leaves layers 10..11 to nobody.
    ring = Ring(num_layers=30, ranges=[(0, 10), (12, 20), (20, 30)])
    err = _raises(CoverageGap, ring.run(), ring)
    assert (err.stage, err.layers) == (1, (12, 20)) and "[10, 12)" in str(err)


def test_overlap_between_assigned_ranges():
    ring = Ring(num_layers=30, ranges=[(0, 12), (10, 20), (20, 30)])
    err = _raises(CoverageOverlap, ring.run(), ring)
    assert err.stage == 1 and "[10, 12)" in str(err)


def test_layer_beyond_the_manifest_count():
    # Bug guarded: trusting the receipts' own idea of how many layers the model has.
    ring = Ring(num_layers=30, ranges=[(0, 10), (10, 20), (20, 31)])
    assert _raises(LayerOutOfRange, ring.run(), ring).stage == 2


def test_chain_short_of_the_manifest_count_is_truncated():
    # The receipts cover [0, 24) perfectly; only the manifest says there are 30 layers.
    ring = Ring(num_layers=24, stages=3)
    err = _raises(Truncated, ring.run(), ring, num_layers=30)
    assert err.layers == (24, 30)


def test_stage_signing_another_stages_range_is_wrong_signer():
    # Bug guarded: two colluding nodes swapping work; each signs honestly, for the wrong range.
    ring = Ring()
    receipts = ring.run()
    receipts[1] = resign(receipts[1], ring.keys[2], weights_digest=ring.weights(2))
    assert _raises(WrongSigner, receipts, ring).stage == 1


@pytest.mark.parametrize("signer", ["outsider", "earlier stage"])
def test_receipt_resigned_by_another_key_is_wrong_signer(signer):
    ring = Ring()
    receipts = ring.run()
    k = key(99) if signer == "outsider" else ring.keys[0]
    receipts[1] = resign(receipts[1], k)
    assert _raises(WrongSigner, receipts, ring).stage == 1


def test_assigned_signer_with_other_weights():
    ring = Ring()
    receipts = ring.run()
    receipts[3] = resign(receipts[3], ring.keys[3], weights_digest=sha256_digest(b"fine-tuned weights"))
    assert _raises(WrongWeights, receipts, ring).stage == 3


@pytest.mark.parametrize("i, which", [(0, "input_digest"), (2, "input_digest"), (1, "output_digest"), (3, "output_digest")])
def test_custody_break_is_detected(i, which):
    # Bug guarded: a stage honestly signing work on bytes other than those it was sent
    # (a man in the middle, or a stage skipping its predecessor). Re-signed by the right key,
    # so only custody can catch it; an output change shows up at the next stage (or the tail).
    ring = Ring()
    receipts = ring.run()
    receipts[i] = resign(receipts[i], ring.keys[i], **{which: sha256_digest(b"substituted")})
    stage = i + 1 if which == "output_digest" and i < 3 else i
    assert _raises(ChainBroken, receipts, ring).stage == stage


def test_tail_output_not_what_coordinator_received():
    ring = Ring()
    assert _raises(ChainBroken, ring.run(), ring, received_digest=sha256_digest(b"x")).stage == 3


def test_message_names_check_stage_and_layers():
    ring = Ring()
    receipts = ring.run()
    receipts[1] = dataclasses.replace(receipts[1], epoch=8)
    err = _raises(BadSignature, receipts, ring)
    assert str(err).startswith("signature: stage 1, layers [8, 16): signature does not verify")
    assert err.check == "signature" and err.layers == (8, 16)


def test_num_layers_must_come_from_a_manifest():
    with pytest.raises(ValueError, match="num_layers must be a positive int"):
        verify_chain([], **{**Ring().check_kwargs(), "num_layers": 0})
