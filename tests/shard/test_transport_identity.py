"""The node identity file: created private, refused when unsafe, one key for libp2p and receipts."""

from __future__ import annotations

import os

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shard.identity import (
    IdentityError,
    identity_public_key,
    identity_signing_key,
    load_or_create_identity,
    peer_id_from_public_key,
    peer_id_of,
)


def test_created_with_mode_0600_and_reloaded_as_the_same_peer(tmp_path):
    # Guards: a node that gets a new peer id on every restart (key not persisted), and a
    # seed written world-readable even for an instant (mode set after write).
    path = tmp_path / "keys" / "node.key"
    first = load_or_create_identity(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert path.read_bytes() == identity_signing_key(first)  # documented format: raw seed
    again = load_or_create_identity(path)
    assert peer_id_of(again) == peer_id_of(first)
    assert peer_id_of(first).startswith("12D3KooW")  # identity-multihash Ed25519 peer id


def test_two_fresh_identities_differ(tmp_path):
    # Guards: a constant or unseeded key generator (every node the same peer).
    a = load_or_create_identity(tmp_path / "a.key")
    b = load_or_create_identity(tmp_path / "b.key")
    assert peer_id_of(a) != peer_id_of(b)


def test_group_readable_key_file_is_refused_with_exact_message(tmp_path):
    # Guards: silently using a private key other users can read.
    path = tmp_path / "node.key"
    load_or_create_identity(path)
    os.chmod(path, 0o640)
    with pytest.raises(IdentityError) as info:
        load_or_create_identity(path)
    assert str(info.value) == (
        f"identity key file {path}: permissions 0640 let group/other access the private key; "
        "expected 0600 (chmod 600)"
    )
    assert info.value.path == str(path)


@pytest.mark.parametrize("content", [b"", b"\x01" * 31, b"\x01" * 33, b"\x08\x01\x12\x40" + b"\x00" * 64])
def test_wrong_length_key_file_is_refused(tmp_path, content):
    # Guards: truncating/padding a corrupt or foreign-format file into some other key,
    # which would give the node a new identity without anyone noticing.
    path = tmp_path / "node.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, content)
    os.close(fd)
    with pytest.raises(IdentityError, match="expected a raw 32-byte Ed25519 seed"):
        load_or_create_identity(path)
    assert path.read_bytes() == content  # never rewritten


def test_a_directory_is_not_a_key_file(tmp_path):
    path = tmp_path / "node.key"
    path.mkdir(mode=0o700)
    with pytest.raises(IdentityError, match="not a regular file"):
        load_or_create_identity(path)


def test_cryptography_signs_with_the_same_key_libp2p_uses(tmp_path):
    # Guards: receipts signed by a key other than the one Noise authenticates, which would
    # let the coordinator match receipts to the wrong peer. Both libraries are the oracle
    # for each other: each verifies the other's signature over the same bytes.
    keypair = load_or_create_identity(tmp_path / "node.key")
    signer = Ed25519PrivateKey.from_private_bytes(identity_signing_key(keypair))
    message = b"receipt bytes"
    assert keypair.public_key.verify(message, signer.sign(message))
    public = Ed25519PublicKey.from_public_bytes(identity_public_key(keypair))
    public.verify(keypair.private_key.sign(message), message)  # raises if invalid
    assert peer_id_from_public_key(identity_public_key(keypair)) == peer_id_of(keypair)
