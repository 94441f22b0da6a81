"""The receipts package's exception tree: one root, subclassed by cause, with fields.

Callers branch on the class, never on message text. Every message is one line that names
the failed check, the stage (index in the chain) and the layers involved, so the CLI can
print it as is. This module does not know how receipts are encoded or checked.
"""

from __future__ import annotations


class ReceiptError(Exception):
    """Root of every error raised by the receipts package."""


# --- bytes and files that cannot be read as what they claim to be -------------------------


class MalformedError(ReceiptError):
    """Bytes or a value that cannot be a receipt/bundle/evidence record: `what` is wrong, `why`."""

    def __init__(self, what: str, why: str) -> None:
        self.what, self.why = what, why
        super().__init__(f"malformed {what}: {why}")


class UnknownSchemaVersion(MalformedError):
    """A record names a schema version this code does not implement."""

    def __init__(self, what: str, version: object, supported: tuple[int, ...]) -> None:
        self.version, self.supported = version, supported
        super().__init__(what, f"unknown schema version {version!r} (supported: {list(supported)})")


class KeyFileError(ReceiptError):
    """A node key file is missing, unreadable, the wrong size or readable by others."""

    def __init__(self, path: str, why: str) -> None:
        self.path, self.why = path, why
        super().__init__(f"key file {path}: {why}")


class StoreError(ReceiptError):
    """The on-disk bundle store cannot do what was asked."""


class BundleExistsError(StoreError):
    """The store is append-only: a bundle for this job is already recorded."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        super().__init__(f"bundle for job {job_id!r} already stored (the store is append-only)")


class BundleNotFoundError(StoreError):
    """No bundle is stored for this job."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        super().__init__(f"no bundle stored for job {job_id!r}")


class SpotCheckError(ReceiptError):
    """Two outputs cannot be compared (different element counts, unknown dtype, bad tolerance)."""

    def __init__(self, what: str, expected: object, actual: object) -> None:
        self.what, self.expected, self.actual = what, expected, actual
        super().__init__(f"cannot compare outputs: {what} (expected {expected}, got {actual})")


# --- verification failures: well-formed records that do not prove what they must ----------


class VerificationError(ReceiptError):
    """A receipt chain, bundle or evidence record does not verify.

    Fields: `check` (a short stable name, e.g. "chain_of_custody"), `stage` (index in the
    chain, None when the failure is not about one stage), `layers` ((start, end) or None),
    `round` (the round number when known, filled in by bundle verification), `detail`.
    """

    check = "verification"

    def __init__(
        self,
        detail: str,
        *,
        stage: int | None = None,
        layers: tuple[int, int] | None = None,
        round: int | None = None,
    ) -> None:
        self.detail, self.stage, self.layers, self.round = detail, stage, layers, round
        super().__init__(self._line())

    def _line(self) -> str:
        where = []
        if self.round is not None:
            where.append(f"round {self.round}")
        if self.stage is not None:
            where.append(f"stage {self.stage}")
        if self.layers is not None:
            where.append(f"layers [{self.layers[0]}, {self.layers[1]})")
        return f"{self.check}: " + (", ".join(where) + ": " if where else "") + self.detail

    def in_round(self, round: int) -> "VerificationError":
        """Record which round this failure belongs to (bundle verification); returns self."""
        self.round = round
        self.args = (self._line(),)
        return self


class MalformedReceipt(VerificationError):
    """A receipt in the chain could not be decoded."""

    check = "malformed_receipt"


class BadSignature(VerificationError):
    """A signature does not verify under the key the record names."""

    check = "signature"


class WrongManifest(VerificationError):
    """A record was made for a different model manifest."""

    check = "manifest"


class Replayed(VerificationError):
    """A receipt was signed for another job, nonce or round: replayed from elsewhere."""

    check = "replay"


class StaleReceipt(Replayed):
    """A receipt was signed in another ring epoch."""

    check = "stale_epoch"


class WrongSigner(VerificationError):
    """The signer is not assigned, or was assigned a different range than it claims."""

    check = "signer"


class WrongWeights(WrongSigner):
    """The signer claims weights other than those its assignment recorded."""

    check = "weights"


class DuplicateReceipt(VerificationError):
    """The same stage appears twice in one chain."""

    check = "duplicate"


class LayerOutOfRange(VerificationError):
    """A receipt claims layers outside [0, num_layers) of the model manifest."""

    check = "layer_range"


class OutOfOrder(VerificationError):
    """Receipts are all present but not in ring order."""

    check = "order"


class CoverageGap(VerificationError):
    """Some layers were computed by nobody."""

    check = "coverage_gap"


class CoverageOverlap(VerificationError):
    """Some layers were claimed twice."""

    check = "coverage_overlap"


class Truncated(VerificationError):
    """The chain stops before the model's last layer (or is empty)."""

    check = "truncated"


class ChainBroken(VerificationError):
    """A stage's input is not what the previous hop (or the coordinator) sent it."""

    check = "chain_of_custody"


class LayerCountMismatch(VerificationError):
    """A bundle records a layer count other than the model manifest's."""

    check = "layer_count"


class WrongCoordinator(VerificationError):
    """A bundle or evidence record is signed by a coordinator key other than the expected one."""

    check = "coordinator"


__all__ = [name for name, obj in list(globals().items()) if isinstance(obj, type) and issubclass(obj, ReceiptError)]
