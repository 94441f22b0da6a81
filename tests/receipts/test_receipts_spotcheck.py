"""compare_outputs against a hand-computed oracle, and signed evidence records."""

from __future__ import annotations

import dataclasses
import math
from array import array

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from receipts_ring import Ring, key

from receipts import (
    BadSignature,
    MalformedError,
    SpotCheck,
    SpotCheckError,
    Tolerance,
    WrongCoordinator,
    compare_outputs,
    decode_evidence,
    encode_evidence,
    sha256_digest,
    sign_evidence,
    verify_evidence,
)

finite = st.floats(-1e4, 1e4, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(finite, finite), min_size=1, max_size=50), st.sampled_from([0.0, 1e-3, 0.1]), st.sampled_from([0.0, 1e-2]))
def test_outlier_count_matches_a_plain_python_oracle(pairs, abs_tol, rel_tol):
    # Bug guarded: a vectorised comparison that disagrees with the documented per-element rule.
    # Sound: the oracle is the rule written out with math, element by element, in float64
    # on the float32 values the bytes hold.
    e = array("f", [p[0] for p in pairs])
    a = array("f", [p[1] for p in pairs])
    tol = Tolerance(abs_tol, rel_tol, 0.0)
    got = compare_outputs(e.tobytes(), a.tobytes(), tol)
    outliers = sum(abs(x - y) > abs_tol + rel_tol * abs(x) for x, y in zip(e, a))
    assert got.num_outliers == outliers and got.num_elements == len(pairs)
    assert got.max_abs_error == max(abs(x - y) for x, y in zip(e, a))
    assert got.passed == (outliers == 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(finite, finite, st.floats(0, 100, allow_nan=False)), min_size=1, max_size=50),
       st.sampled_from([0.0, 1e-3, 0.1]), st.sampled_from([0.0, 1e-2]))
def test_scaled_abs_tol_matches_the_oracle(triples, abs_tol, rel_tol):
    # Bug guarded: the per-element unit of abs_tol (the auditor passes each row's RMS)
    # applied to the wrong elements, or broadcast wrongly. Sound: the rule written out.
    e = array("f", [t[0] for t in triples])
    a = array("f", [t[1] for t in triples])
    unit = np.array([t[2] for t in triples])
    got = compare_outputs(e.tobytes(), a.tobytes(), Tolerance(abs_tol, rel_tol, 0.0), scale=unit)
    assert got.num_outliers == sum(abs(x - y) > abs_tol * u + rel_tol * abs(x) for x, y, u in zip(e, a, unit))


def test_scale_is_checked():
    with pytest.raises(SpotCheckError, match="scale element count"):
        compare_outputs([1.0, 2.0], [1.0, 2.0], scale=np.ones(3))
    with pytest.raises(SpotCheckError, match="scale"):
        compare_outputs([1.0], [1.0], scale=-1.0)
    # A near-zero element beside large ones: off by 1e-4 absolute, within 1e-4 row RMSes.
    row = np.array([0.01, 40.0, -35.0, 0.02])
    rms = float(np.sqrt((row ** 2).mean()))
    off = row + np.array([1e-4, 0, 0, 0])
    assert not compare_outputs(row, off, Tolerance(1e-5, 1e-3, 0.0)).passed
    assert compare_outputs(row, off, Tolerance(1e-5, 1e-3, 0.0), scale=rms).passed


def test_same_values_through_every_input_form_and_dtype():
    x = np.linspace(-3, 3, 64, dtype=np.float32)
    assert compare_outputs(x, x.tolist()).num_outliers == 0
    assert compare_outputs(x.astype("<f2").tobytes(), x.astype(np.float16), dtype="float16").max_abs_error == 0.0
    bf16 = (x.view("<u4") >> 16).astype("<u2")  # truncate float32 to bfloat16
    truncated = (bf16.astype("<u4") << 16).view("<f4")
    assert compare_outputs(bf16.tobytes(), truncated, dtype="bfloat16").max_abs_error == 0.0


def test_outlier_budget():
    # 1 element of 1000 off: passes with a 0.1% budget, fails with none.
    e = np.zeros(1000, dtype=np.float32)
    a = e.copy()
    a[7] = 1.0
    assert compare_outputs(e, a, Tolerance(1e-3, 0.0, 1e-3)).passed
    verdict = compare_outputs(e, a, Tolerance(1e-3, 0.0, 0.0))
    assert not verdict.passed and verdict.outlier_fraction == 1e-3 and verdict.max_abs_error == 1.0


def test_nan_and_infinities():
    inf, nan = math.inf, math.nan
    v = compare_outputs([1.0, inf, -inf, nan], [1.0, inf, inf, nan], Tolerance(0.0, 0.0, 1.0))
    assert v.num_outliers == 2 and v.max_abs_error == inf and v.max_rel_error == inf


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((b"\x00" * 8, b"\x00" * 4), {}, "element count \\(expected 2, got 1\\)"),
        ((b"\x00" * 6, b"\x00" * 6), {}, "expected byte length \\(expected a multiple of 4, got 6\\)"),
        ((b"", b""), {}, "element count \\(expected at least 1, got 0\\)"),
        ((b"\x00" * 4, b"\x00" * 4), {"dtype": "int8"}, "dtype"),
    ],
)
def test_incomparable_inputs(args, kwargs, message):
    with pytest.raises(SpotCheckError, match=message):
        compare_outputs(*args, **kwargs)


def test_tolerance_rejects_negative_and_nan():
    for bad in (dict(abs_tol=-1.0), dict(rel_tol=math.nan), dict(max_outlier_fraction=2.0)):
        with pytest.raises(SpotCheckError):
            Tolerance(**bad)


# --- evidence ----------------------------------------------------------------------------

COORD = key(1000)
RECEIPT = Ring().run()[2]
CHECK = compare_outputs([0.0, 1.0], [0.0, 3.0])


def _evidence():
    return sign_evidence(COORD, receipt=RECEIPT, recomputed_digest=sha256_digest(b"recomputed"), check=CHECK)


def test_evidence_round_trip_and_verify():
    ev = _evidence()
    again = decode_evidence(encode_evidence(ev))
    assert again == ev and not again.check.passed
    verify_evidence(again, coordinator_key=COORD.public_bytes())
    assert (again.node_key, again.layers, again.claimed_output_digest) == (RECEIPT.signer, RECEIPT.layers, RECEIPT.output_digest)


def test_evidence_tampering_is_rejected_with_its_reason():
    # Bug guarded: evidence whose numbers or accused stage can be changed after signing,
    # or which accuses a stage with a receipt that stage never signed.
    ev = _evidence()
    softened = dataclasses.replace(ev, check=dataclasses.replace(CHECK, num_outliers=0))
    with pytest.raises(BadSignature, match="coordinator signature"):
        verify_evidence(softened)
    with pytest.raises(WrongCoordinator):
        verify_evidence(ev, coordinator_key=key(2000).public_bytes())
    framed = sign_evidence(COORD, receipt=dataclasses.replace(RECEIPT, epoch=1), recomputed_digest=ev.recomputed_digest, check=CHECK)
    with pytest.raises(BadSignature, match="embedded receipt is not signed") as info:
        verify_evidence(framed)
    assert info.value.layers == RECEIPT.layers


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=800))
def test_evidence_decoder_raises_only_malformed(data):
    try:
        decode_evidence(data)
    except MalformedError:
        pass


def test_evidence_decoder_checks_numbers():
    fields = msgpack.unpackb(encode_evidence(_evidence()), raw=False)
    fields[7] = fields[6] + 1  # more outliers than elements
    with pytest.raises(MalformedError, match="outside"):
        decode_evidence(msgpack.packb(fields, use_bin_type=True))
    fields = msgpack.unpackb(encode_evidence(_evidence()), raw=False)
    fields[8] = math.nan
    with pytest.raises(MalformedError, match="NaN not"):
        decode_evidence(msgpack.packb(fields, use_bin_type=True))


def test_spotcheck_is_a_plain_value():
    assert SpotCheck(Tolerance(), 4, 1, 0.5, 0.5).outlier_fraction == 0.25
