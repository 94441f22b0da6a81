"""A node's persistent Ed25519 identity: one key file, one libp2p peer id, one signing key.

The key file holds exactly the raw 32-byte Ed25519 seed (RFC 8032 private key), nothing
else: no protobuf envelope, no PEM. It is created with mode 0600 and refused if it is
group- or other-accessible or is not exactly 32 bytes. The same seed is the libp2p host
key (so the peer id authenticated by Noise) and the key `receipts` signs with through
the `cryptography` package, so a receipt's signer and a stream's remote peer are one fact.

This module does not know about hosts, streams or receipts; it only turns a file into a
key pair and a key pair into the bytes and ids the other modules need.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
from pathlib import Path

from libp2p.crypto.ed25519 import Ed25519PublicKey, create_new_key_pair
from libp2p.crypto.keys import KeyPair, KeyType
from libp2p.peer.id import ID

from shard.errors import ShardError

ED25519_SEED_BYTES = 32
ED25519_PUBLIC_KEY_BYTES = 32
KEY_FILE_MODE = 0o600


class IdentityError(ShardError):
    """The identity key file cannot be used. Fields: the file's path and why."""

    def __init__(self, path: str, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"identity key file {path}: {reason}")


def keypair_from_seed(seed: bytes) -> KeyPair:
    """The libp2p Ed25519 key pair whose private key is `seed` (32 bytes)."""
    if len(seed) != ED25519_SEED_BYTES:
        raise ValueError(f"an Ed25519 seed is {ED25519_SEED_BYTES} bytes, got {len(seed)}")
    return create_new_key_pair(seed)


def load_or_create_identity(path: str | os.PathLike[str]) -> KeyPair:
    """Load the node's key pair from `path`, creating a fresh one (mode 0600) if absent.

    Error handling: raises `IdentityError` if the file is not a regular file, is readable
    or writable by group/other, or does not hold exactly 32 bytes. An existing file is
    never rewritten.

    Resource handling: creation uses O_CREAT|O_EXCL with mode 0600 so the seed is never
    on disk with wider permissions, and two processes racing to create the file end up
    with one key (the loser reads the winner's file). Missing parent folders are created
    with mode 0700.
    """
    key_path = Path(path)
    try:
        return _load(key_path)
    except FileNotFoundError:
        pass
    key_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    seed = secrets.token_bytes(ED25519_SEED_BYTES)
    try:
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_FILE_MODE)
    except FileExistsError:
        return _load(key_path)
    try:
        os.write(fd, seed)
        os.fsync(fd)
    finally:
        os.close(fd)
    return keypair_from_seed(seed)


def claim_key_path(directory: str | os.PathLike[str], stem: str, max_keys: int = 64) -> tuple[Path, int]:
    """The first of `<stem>.key`, `<stem>-1.key`, ... in `directory` that no running
    process holds, and the descriptor of its lock file (`<name>.lock`, flock'd): the claim
    lasts as long as that descriptor stays open (the process, normally). So nodes started
    on one machine without --key-path get distinct identities, and each keeps its own
    across restarts when they are started in the same order.

    Error handling: IdentityError when `max_keys` keys are all held. Resource handling:
    the caller owns the returned descriptor; the kernel drops the lock when it closes.
    """
    folder = Path(directory)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for i in range(max_keys):
        path = folder / (f"{stem}.key" if i == 0 else f"{stem}-{i}.key")
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, KEY_FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return path, fd
    raise IdentityError(str(folder / f"{stem}.key"), f"all {max_keys} keys are held by running nodes; pass --key-path")


def _load(key_path: Path) -> KeyPair:
    info = os.stat(key_path)  # FileNotFoundError propagates to the caller
    if not stat.S_ISREG(info.st_mode):
        raise IdentityError(str(key_path), "not a regular file")
    if info.st_mode & 0o077:
        raise IdentityError(
            str(key_path),
            f"permissions {stat.S_IMODE(info.st_mode):04o} let group/other access the "
            f"private key; expected {KEY_FILE_MODE:04o} (chmod 600)",
        )
    with open(key_path, "rb") as f:
        seed = f.read(ED25519_SEED_BYTES + 1)
    if len(seed) != ED25519_SEED_BYTES:
        raise IdentityError(
            str(key_path),
            f"expected a raw {ED25519_SEED_BYTES}-byte Ed25519 seed, found "
            f"{len(seed) if len(seed) <= ED25519_SEED_BYTES else 'more than 32'} bytes",
        )
    return keypair_from_seed(seed)


def identity_signing_key(keypair: KeyPair) -> bytes:
    """The 32-byte Ed25519 seed, as `cryptography`'s Ed25519PrivateKey.from_private_bytes takes it."""
    if keypair.private_key.get_type() != KeyType.Ed25519:
        raise ValueError(f"identity keys are Ed25519, got {keypair.private_key.get_type()}")
    seed = keypair.private_key.to_bytes()  # PyNaCl SigningKey bytes are the seed
    if len(seed) != ED25519_SEED_BYTES:
        raise ValueError(f"Ed25519 private key is {len(seed)} bytes, expected a 32-byte seed")
    return seed


def identity_public_key(keypair: KeyPair) -> bytes:
    """The 32-byte raw Ed25519 public key (what receipts record as the signer)."""
    public = keypair.public_key.to_bytes()
    if len(public) != ED25519_PUBLIC_KEY_BYTES:
        raise ValueError(f"Ed25519 public key is {len(public)} bytes, expected 32")
    return public


def peer_id_of(keypair: KeyPair) -> str:
    """The base58 libp2p peer id ("12D3KooW…") derived from the public key."""
    return ID.from_pubkey(keypair.public_key).to_base58()


def peer_id_from_public_key(public_key: bytes) -> str:
    """The peer id a raw 32-byte Ed25519 public key has, to match receipts to streams."""
    if len(public_key) != ED25519_PUBLIC_KEY_BYTES:
        raise ValueError(f"Ed25519 public key is {len(public_key)} bytes, expected 32")
    return ID.from_pubkey(Ed25519PublicKey.from_bytes(public_key)).to_base58()
