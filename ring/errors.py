"""The ring package's exception tree: one root, subclassed by cause, with fields."""

from __future__ import annotations


class RingError(Exception):
    """Root of every error raised by the ring package."""


class InvalidInputError(RingError, ValueError):
    """A node, model, workload or constraint description is inconsistent or out of range."""

    def __init__(self, what: str, value: object) -> None:
        self.what, self.value = what, value
        super().__init__(f"invalid {what}: {value!r}")


class InfeasibleError(RingError):
    """No ring satisfies the constraints (memory, subnets, pinning, trust)."""

    def __init__(self, reason: str, candidates: int) -> None:
        self.reason, self.candidates = reason, candidates
        super().__init__(f"no feasible ring among {candidates} candidate nodes: {reason}")


class UnknownPeerError(RingError, KeyError):
    """A plan or latency query names a peer the network does not contain."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        super().__init__(f"unknown peer {peer!r}")


class AssignError(RingError):
    """No ring can be formed from these nodes by the capacity split (too few, or not
    enough memory)."""
