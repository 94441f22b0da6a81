"""Ed25519 node keys: the same key as the node's libp2p identity, as raw 32-byte values.

A `NodeKey` holds a private key; public keys travel as raw 32 bytes and are checked with
`verify_signature`. Key files hold the raw 32-byte private seed (or the 64-byte
seed||public form libp2p marshals) and must not be readable by group or others.
This module does not know what is signed: callers add their own domain tag.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from receipts.errors import KeyFileError

PUBLIC_KEY_BYTES = 32
PRIVATE_KEY_BYTES = 32
SIGNATURE_BYTES = 64
KEY_FILE_MODE = 0o600

_RAW = serialization.Encoding.Raw


class NodeKey:
    """An Ed25519 private key with the operations a stage or coordinator needs."""

    __slots__ = ("_private", "_public_bytes")

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self._public_bytes = private.public_key().public_bytes(_RAW, serialization.PublicFormat.Raw)

    @classmethod
    def generate(cls) -> "NodeKey":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> "NodeKey":
        """From the 32-byte seed, or libp2p's 64-byte seed||public form (public checked)."""
        raw = bytes(raw)
        if len(raw) == 2 * PRIVATE_KEY_BYTES:
            key = cls(Ed25519PrivateKey.from_private_bytes(raw[:PRIVATE_KEY_BYTES]))
            if key.public_bytes() != raw[PRIVATE_KEY_BYTES:]:
                raise ValueError("64-byte Ed25519 key: public half does not match the seed")
            return key
        if len(raw) != PRIVATE_KEY_BYTES:
            raise ValueError(f"Ed25519 private key must be 32 (or 64) bytes, got {len(raw)}")
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    def private_bytes(self) -> bytes:
        return self._private.private_bytes(_RAW, serialization.PrivateFormat.Raw, serialization.NoEncryption())

    def public_bytes(self) -> bytes:
        return self._public_bytes

    def sign(self, message: bytes) -> bytes:
        """64-byte Ed25519 signature over `message` exactly as given."""
        return self._private.sign(message)

    def __repr__(self) -> str:  # never print the private half
        return f"NodeKey(public={self._public_bytes.hex()[:16]}…)"

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "NodeKey":
        """Read a key file written by `save`.

        Error handling: KeyFileError if the file is missing, unreadable, has group/other
        permission bits, or holds anything but a 32/64-byte Ed25519 key.
        """
        p = Path(path)
        try:
            mode = p.stat().st_mode
            raw = p.read_bytes()
        except OSError as e:
            raise KeyFileError(str(p), e.strerror or str(e)) from e
        if stat.S_IMODE(mode) & 0o077:
            raise KeyFileError(str(p), f"permissions {stat.S_IMODE(mode):o} let others read it; need 600")
        try:
            return cls.from_private_bytes(raw)
        except ValueError as e:
            raise KeyFileError(str(p), str(e)) from e

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the 32-byte seed to `path` with mode 0600, atomically; never overwrite.

        Error handling: KeyFileError if `path` exists or cannot be written.
        Resource handling: the temporary file is removed on failure.
        """
        p = Path(path)
        tmp = p.with_name(f".{p.name}.tmp-{os.urandom(6).hex()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_FILE_MODE)
            try:
                os.fchmod(fd, KEY_FILE_MODE)  # the umask may have cleared bits; it cannot add them
                os.write(fd, self.private_bytes())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.link(tmp, p)  # atomic and refuses to overwrite an existing identity
        except FileExistsError as e:
            raise KeyFileError(str(p), "already exists; refusing to overwrite a node identity") from e
        except OSError as e:
            raise KeyFileError(str(p), e.strerror or str(e)) from e
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass


def verify_signature(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """True iff `signature` is a valid Ed25519 signature of `message` under `public_key`."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes(public_key)).verify(bytes(signature), bytes(message))
    except (InvalidSignature, ValueError):
        return False
    return True
