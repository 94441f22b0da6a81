"""Keys, digests, and the receipt record's canonical bytes and strict decoder."""

from __future__ import annotations

import os
import stat

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from receipts_ring import Ring

from receipts import (
    MAX_RECEIPT_BYTES,
    KeyFileError,
    MalformedError,
    NodeKey,
    UnknownSchemaVersion,
    decode_receipt,
    encode_receipt,
    sha256_digest,
    token_digest,
    verify_signature,
)
from receipts.receipt import RECEIPT_DOMAIN

RECEIPT = Ring().run()[1]


def test_key_file_round_trip_is_private(tmp_path):
    # Bug guarded: a node identity written world-readable (umask 022 would give 0644).
    k = NodeKey.generate()
    path = tmp_path / "node.key"
    old = os.umask(0o022)
    try:
        k.save(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert NodeKey.load(path).public_bytes() == k.public_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["node.key"]  # no temp file left behind


def test_key_save_refuses_to_overwrite_an_identity(tmp_path):
    path = tmp_path / "node.key"
    NodeKey.generate().save(path)
    before = path.read_bytes()
    with pytest.raises(KeyFileError, match="already exists"):
        NodeKey.generate().save(path)
    assert path.read_bytes() == before


def test_key_load_refuses_group_readable_file(tmp_path):
    path = tmp_path / "node.key"
    NodeKey.generate().save(path)
    path.chmod(0o640)
    with pytest.raises(KeyFileError, match="permissions 640 let others read it"):
        NodeKey.load(path)


@pytest.mark.parametrize("size", [0, 31, 33, 63])
def test_key_load_rejects_wrong_size(tmp_path, size):
    path = tmp_path / "k"
    path.write_bytes(b"\x01" * size)
    path.chmod(0o600)
    with pytest.raises(KeyFileError, match="must be 32 \\(or 64\\) bytes"):
        NodeKey.load(path)


def test_libp2p_64_byte_form_is_accepted_and_checked():
    # libp2p marshals Ed25519 private keys as seed || public; the same node identity.
    k = NodeKey.generate()
    assert NodeKey.from_private_bytes(k.private_bytes() + k.public_bytes()).public_bytes() == k.public_bytes()
    with pytest.raises(ValueError, match="public half does not match"):
        NodeKey.from_private_bytes(k.private_bytes() + bytes(32))


def test_signature_round_trip_and_rejections():
    k, msg = NodeKey.generate(), b"hello"
    sig = k.sign(msg)
    assert verify_signature(k.public_bytes(), msg, sig)
    assert not verify_signature(k.public_bytes(), b"hellp", sig)
    assert not verify_signature(NodeKey.generate().public_bytes(), msg, sig)
    assert not verify_signature(k.public_bytes()[:31], msg, sig)
    assert "private" not in repr(k) and k.private_bytes().hex() not in repr(k)


def test_receipt_signature_is_domain_separated():
    # Bug guarded: the stage's libp2p identity key signing a receipt whose bytes could be
    # presented as some other signed statement (or vice versa). Sound: the signed message
    # must start with the receipt domain tag, and the bare field list must not verify.
    msg = RECEIPT.signed_message()
    assert msg.startswith(RECEIPT_DOMAIN)
    assert not verify_signature(RECEIPT.signer, msg[len(RECEIPT_DOMAIN) :], RECEIPT.signature)


def test_token_digest_is_little_endian_uint32():
    import hashlib

    assert token_digest([1, 256]) == hashlib.sha256(b"\x01\x00\x00\x00\x00\x01\x00\x00").digest()
    assert token_digest([]) == sha256_digest(b"")
    for bad in ([-1], [2**32], [1.0], [True]):
        with pytest.raises(ValueError, match="token id must be an int"):
            token_digest(bad)


def test_receipt_round_trip_and_size():
    data = encode_receipt(RECEIPT)
    assert decode_receipt(data) == RECEIPT
    assert len(data) < 400 < MAX_RECEIPT_BYTES  # fits the wire's per-receipt allowance with room


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_decoder_raises_only_malformed_for_arbitrary_bytes(data):
    # Bug guarded: a peer crashing the coordinator with bytes that escape the error tree.
    try:
        decode_receipt(data)
    except MalformedError:
        pass


_FIELDS = RECEIPT.signed_fields() + [RECEIPT.signature]


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, len(_FIELDS) - 1),
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.binary(max_size=80), st.text(max_size=20)),
)
def test_decoder_checks_every_field_type_and_length(index, value):
    # Bug guarded: a field accepted with the wrong type (bool as int, str as bytes) or length.
    fields = list(_FIELDS)
    fields[index] = value
    data = msgpack.packb(fields, use_bin_type=True)
    try:
        r = decode_receipt(data)
    except MalformedError:
        return
    # Accepted: only a value of the original field's exact type, held as given, re-encoding
    # to the same bytes (no coercion of bool to int or str to bytes on the way).
    held = (r.signed_fields() + [r.signature])[index]
    assert type(held) is type(_FIELDS[index]) and held == value
    assert encode_receipt(r) == data


def test_non_canonical_encoding_is_rejected():
    # Bug guarded: two byte strings for one receipt (an int padded to 8 bytes), which would
    # make receipt digests and dedup by bytes unreliable.
    fields = list(_FIELDS)
    packer = msgpack.Packer(use_bin_type=True)
    body = b"".join(packer.pack(f) for f in fields[1:])
    padded = b"\x9d" + b"\xcf" + (1).to_bytes(8, "big") + body  # version 1 as uint64
    assert msgpack.unpackb(padded, raw=False) == msgpack.unpackb(encode_receipt(RECEIPT), raw=False)  # same values
    with pytest.raises(MalformedError, match="not in canonical encoding"):
        decode_receipt(padded)


def test_unknown_version_and_oversize_and_trailing_bytes():
    fields = list(_FIELDS)
    fields[0] = 2
    with pytest.raises(UnknownSchemaVersion, match=r"unknown schema version 2 \(supported: \[1\]\)"):
        decode_receipt(msgpack.packb(fields, use_bin_type=True))
    with pytest.raises(MalformedError, match="exceeds the limit of 4096"):
        decode_receipt(b"\x00" * (MAX_RECEIPT_BYTES + 1))
    with pytest.raises(MalformedError, match="not msgpack"):
        decode_receipt(encode_receipt(RECEIPT) + b"\x00")
    with pytest.raises(MalformedError, match="expected an array of 13 fields, got array of 12"):
        decode_receipt(msgpack.packb(_FIELDS[:-1], use_bin_type=True))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("epoch", True, "expected an int, got bool"),
        ("round", -1, "outside"),
        ("nonce", b"short", "expected 16..32 bytes, got 5"),
        ("job_id", "../etc/passwd", "is not 1..64 chars"),
        ("layer_start", 16, "empty or reversed"),
        ("input_digest", b"x" * 31, "expected 32 bytes, got 31"),
    ],
)
def test_construction_validates_fields(field, value, message):
    import dataclasses

    with pytest.raises(MalformedError, match=message):
        dataclasses.replace(RECEIPT, **{field: value})
