"""Job bundles (sign, JSON, verify), the append-only BundleStore, and `shard-receipts verify`."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from receipts_ring import Ring, key

from receipts import (
    BadSignature,
    Bundle,
    BundleExistsError,
    BundleNotFoundError,
    BundleStore,
    CoverageGap,
    LayerCountMismatch,
    MalformedError,
    RoundRecord,
    StageAssignment,
    Truncated,
    WrongCoordinator,
    WrongManifest,
    WrongSigner,
    bundle_failures,
    decode_bundle,
    encode_bundle,
    encode_receipt,
    sign_bundle,
    token_digest,
    verify_bundle,
)
from receipts.cli import main

COORD = key(1000)


def make_bundle(ring: Ring, rounds=(0, 1, 2), *, extra_rounds=(), job_id=None, coordinator=COORD) -> Bundle:
    records = [
        RoundRecord(r, ring.epoch, ring.sent(r), ring.received(r), tuple(encode_receipt(x) for x in ring.run(r)))
        for r in rounds
    ]
    assignments = [
        StageAssignment(k.public_bytes(), *ring.ranges[i], ring.weights(i), ring.epoch) for i, k in enumerate(ring.keys)
    ]
    for other_ring, r in extra_rounds:  # rounds run by another ring (e.g. after a heal)
        records.append(RoundRecord(r, other_ring.epoch, other_ring.sent(r), other_ring.received(r),
                                   tuple(encode_receipt(x) for x in other_ring.run(r))))  # fmt: skip
        assignments += [
            StageAssignment(k.public_bytes(), *other_ring.ranges[i], other_ring.weights(i), other_ring.epoch)
            for i, k in enumerate(other_ring.keys)
        ]
    return sign_bundle(
        coordinator,
        job_id=job_id or ring.job_id,
        nonce=ring.nonce,
        manifest_digest=ring.manifest_digest,
        num_layers=ring.num_layers,
        request_digest=token_digest([1, 2, 3]),
        output_digest=token_digest([4, 5]),
        assignments=assignments,
        rounds=records,
    )


BUNDLE = make_bundle(Ring())


def test_honest_bundle_verifies_and_survives_json():
    # Bug guarded: a JSON round trip that changes a byte the coordinator signed.
    verify_bundle(BUNDLE, num_layers=30, manifest_digest=Ring().manifest_digest, coordinator_key=COORD.public_bytes())
    again = decode_bundle(encode_bundle(BUNDLE))
    assert again == BUNDLE
    verify_bundle(again, num_layers=30)


def test_job_spanning_two_epochs_checks_each_round_against_its_epochs_assignments():
    # After a heal the ring (keys and split) changes; each round must be judged by its epoch.
    healed = Ring(epoch=8, stages=3, key_offset=10)
    bundle = make_bundle(Ring(), rounds=(0, 1), extra_rounds=[(healed, 2)])
    verify_bundle(bundle, num_layers=30)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_any_edit_of_the_json_breaks_verification(data):
    # Bug guarded: a bundle field outside the coordinator's signature. Sound: the edit
    # changes one leaf value; either decoding rejects it or a check must fail.
    doc = json.loads(encode_bundle(BUNDLE))
    path, leaf = _pick_leaf(data, doc)
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = _mutate(leaf)
    try:
        edited = decode_bundle(json.dumps(doc).encode())
    except MalformedError:
        return
    assert bundle_failures(edited, num_layers=30), f"edit at {path} went unnoticed"


def _pick_leaf(data, doc, path=()):
    if isinstance(doc, dict):
        k = data.draw(st.sampled_from(sorted(doc)))
        return _pick_leaf(data, doc[k], path + (k,))
    if isinstance(doc, list) and doc:
        i = data.draw(st.integers(0, len(doc) - 1))
        return _pick_leaf(data, doc[i], path + (i,))
    return path, doc


def _mutate(leaf):
    if isinstance(leaf, int):
        return leaf + 1
    if isinstance(leaf, str) and leaf.startswith("job"):
        return leaf + "x"
    if isinstance(leaf, str) and len(leaf) % 4 == 0 and not all(c in "0123456789abcdef" for c in leaf):
        import base64  # an encoded receipt: flip a byte inside it

        raw = bytearray(base64.b64decode(leaf))
        raw[len(raw) // 2] ^= 1
        return base64.b64encode(bytes(raw)).decode()
    return ("1" if leaf[0] != "1" else "2") + leaf[1:]


def test_bundle_level_checks_name_their_reason():
    other = key(2000)
    assert type(bundle_failures(BUNDLE, num_layers=30, coordinator_key=other.public_bytes())[0]) is WrongCoordinator
    forged = dataclasses.replace(BUNDLE, coordinator_key=other.public_bytes())
    assert type(bundle_failures(forged, num_layers=30)[0]) is BadSignature
    assert type(bundle_failures(BUNDLE, num_layers=32)[0]) is LayerCountMismatch
    assert type(bundle_failures(BUNDLE, num_layers=30, manifest_digest=b"\x00" * 32)[0]) is WrongManifest
    empty = make_bundle(Ring(), rounds=())
    assert type(bundle_failures(empty, num_layers=30)[0]) is Truncated


def test_coordinator_cannot_sign_a_round_its_ring_did_not_compute():
    # An honest coordinator signature does not launder a bad chain: a round missing stage 1.
    ring = Ring()
    good = make_bundle(ring)
    r = good.rounds[1]
    gapped = dataclasses.replace(r, receipts=r.receipts[:1] + r.receipts[2:])
    bad = make_bundle(ring)  # re-sign with the gapped round in place
    bad = sign_bundle(
        COORD, job_id=bad.job_id, nonce=bad.nonce, manifest_digest=bad.manifest_digest, num_layers=30,
        request_digest=bad.request_digest, output_digest=bad.output_digest, assignments=bad.assignments,
        rounds=(good.rounds[0], gapped, good.rounds[2]),
    )  # fmt: skip
    failures = bundle_failures(bad, num_layers=30)
    assert [(type(f), f.round, f.stage) for f in failures] == [(CoverageGap, 1, 1)]
    assert str(failures[0]).startswith("coverage_gap: round 1, stage 1, layers [16, 23)")


def test_round_from_an_unassigned_epoch_fails():
    stray = Ring(epoch=99)
    bundle = make_bundle(Ring(), rounds=(0,))
    bundle = sign_bundle(
        COORD, job_id=bundle.job_id, nonce=bundle.nonce, manifest_digest=bundle.manifest_digest, num_layers=30,
        request_digest=bundle.request_digest, output_digest=bundle.output_digest, assignments=bundle.assignments,
        rounds=bundle.rounds + (RoundRecord(5, 99, stray.sent(5), stray.received(5), tuple(encode_receipt(x) for x in stray.run(5))),),
    )  # fmt: skip
    assert [type(f) for f in bundle_failures(bundle, num_layers=30)] == [WrongSigner]


def test_decode_rejects_unknown_keys_and_constants():
    doc = json.loads(encode_bundle(BUNDLE))
    doc["extra"] = 1
    with pytest.raises(MalformedError, match=r"unknown keys \['extra'\]"):
        decode_bundle(json.dumps(doc).encode())
    with pytest.raises(MalformedError, match="JSON constant NaN"):
        decode_bundle(encode_bundle(BUNDLE).replace(b'"num_layers": 30', b'"num_layers": NaN'))
    with pytest.raises(MalformedError, match="not JSON"):
        decode_bundle(b"\xff{")


# --- store -------------------------------------------------------------------------------


def test_store_append_get_and_append_only(tmp_path):
    store = BundleStore(tmp_path / "bundles")
    path = store.append(BUNDLE)
    assert store.get(BUNDLE.job_id) == BUNDLE and BUNDLE.job_id in store
    assert list(store.job_ids()) == [BUNDLE.job_id]
    before = path.read_bytes()
    with pytest.raises(BundleExistsError, match="already stored"):
        store.append(make_bundle(Ring(), rounds=(0,)))
    assert path.read_bytes() == before  # the first record is untouched
    with pytest.raises(BundleNotFoundError):
        store.get("job-unknown")
    assert "../x" not in store
    assert sorted(p.name for p in (tmp_path / "bundles").iterdir()) == [f"{BUNDLE.job_id}.json"]


def test_store_ignores_temp_files_left_by_a_crash(tmp_path):
    # A crash between the temp write and the link leaves only a .tmp- file: no bundle, and
    # the job can still be appended afterwards.
    store = BundleStore(tmp_path)
    (tmp_path / f".tmp-{BUNDLE.job_id}-deadbeef").write_bytes(encode_bundle(BUNDLE)[:50])
    assert list(store.job_ids()) == [] and BUNDLE.job_id not in store
    store.append(BUNDLE)
    assert store.get(BUNDLE.job_id) == BUNDLE


def test_store_detects_a_file_holding_another_job(tmp_path):
    store = BundleStore(tmp_path)
    (tmp_path / "job-9.json").write_bytes(encode_bundle(BUNDLE))
    with pytest.raises(MalformedError, match="job-9.json holds job 'job-1'"):
        store.get("job-9")


# --- CLI ---------------------------------------------------------------------------------


def _write(tmp_path, name, bundle):
    p = tmp_path / name
    p.write_bytes(encode_bundle(bundle))
    return str(p)


def _manifest(tmp_path, num_layers=30, digest=None):
    p = tmp_path / "manifest.json"
    p.write_text(json.dumps({"num_layers": num_layers, "digest": (digest or Ring().manifest_digest).hex()}))
    return str(p)


def test_cli_ok_with_manifest(tmp_path, capsys):
    good = _write(tmp_path, "good.json", BUNDLE)
    assert main(["verify", good, "--manifest", _manifest(tmp_path), "--coordinator-key", COORD.public_bytes().hex()]) == 0
    out, err = capsys.readouterr()
    assert out == f"ok {good}: job job-1\n" and err == ""


def test_cli_without_coordinator_key_says_the_signer_was_not_checked(tmp_path, capsys):
    # Bug guarded (issue 23): "ok" without --coordinator-key read as "signed by my
    # coordinator" though any key that signed the bundle passes. Sound: a valid bundle
    # still verifies (exit 0), with one warning line naming what was not checked.
    good = _write(tmp_path, "good.json", BUNDLE)
    assert main(["verify", good, "--manifest", _manifest(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out == f"ok {good}: job job-1\n"
    assert err.splitlines() == [err.strip()] and err.startswith("warning: no --coordinator-key:")
    assert "who signed it was not checked" in err and "/v1/receipts/key" in err


def test_cli_without_manifest_warns(tmp_path, capsys):
    assert main(["verify", _write(tmp_path, "good.json", BUNDLE)]) == 0
    assert capsys.readouterr().err.startswith("warning: no --manifest")


def test_cli_reports_one_line_per_failure_and_exits_1(tmp_path, capsys):
    # Bug guarded: the manifest's layer count ignored in favour of the bundle's own claim.
    good = _write(tmp_path, "good.json", BUNDLE)
    junk = tmp_path / "junk.json"
    junk.write_text("{}")
    code = main(["verify", good, str(junk), "--manifest", _manifest(tmp_path, num_layers=32)])
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    assert out[0] == f"FAIL {good}: layer_count: bundle records 30 layers, the model manifest 32"
    assert out[1].startswith(f"FAIL {junk}: malformed bundle: missing keys")
    assert len(out) == 2


def test_cli_json_output(tmp_path, capsys):
    good = _write(tmp_path, "good.json", BUNDLE)
    assert main(["verify", good, "--json", "--coordinator-key", key(2000).public_bytes().hex()]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["warnings"]
    assert doc["bundles"][0]["failures"][0]["check"] == "coordinator"


@pytest.mark.parametrize("content", ['{"num_layers": 30}', '{"num_layers": "30", "digest": "00"}', "not json"])
def test_cli_bad_manifest_is_a_usage_error(tmp_path, capsys, content):
    (tmp_path / "m.json").write_text(content)
    assert main(["verify", _write(tmp_path, "b.json", BUNDLE), "--manifest", str(tmp_path / "m.json")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_cli_entry_point_is_declared():
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["scripts"]["shard-receipts"] == "receipts.cli:main"
