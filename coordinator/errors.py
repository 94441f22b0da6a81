"""The coordinator's exception tree: one root, subclassed by cause, with fields.

Callers branch on the type, never on message text; the gateway maps each cause to an
HTTP status in one table (coordinator.gateway.api.STATUS_OF). It does not know HTTP.
"""

from __future__ import annotations

from typing import Any

from ring import PeerId


class CoordinatorError(Exception):
    """Root of every error the coordinator package raises on purpose."""


class NotReadyError(CoordinatorError):
    """The engine cannot take jobs now (no ring formed, ring re-forming, model loading)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"engine not ready: {reason}")


class RingWaitTimeout(NotReadyError):
    """A job waited `waited_s` for a ring to (re-)form and none did."""

    def __init__(self, waited_s: float) -> None:
        self.waited_s = waited_s
        super().__init__(f"no ring formed within {waited_s:g} s (nodes left or cannot reach each other); "
                         "retry once nodes have joined")


class PromptTooLongError(CoordinatorError):
    """The prompt leaves no room in the context for even one generated token."""

    def __init__(self, prompt_tokens: int, max_context_tokens: int) -> None:
        self.prompt_tokens, self.max_context_tokens = prompt_tokens, max_context_tokens
        super().__init__(
            f"prompt is {prompt_tokens} tokens but the model's context is {max_context_tokens} tokens, "
            "which leaves no room for a completion"
        )


class EmptyPromptError(CoordinatorError):
    """The prompt has no tokens: there is no last token to generate after."""

    def __init__(self) -> None:
        super().__init__("the prompt is empty: send at least one token of text to continue")


class PromptFormatError(CoordinatorError):
    """The chat messages cannot be rendered by the model's chat template."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"cannot apply the chat template: {reason}")


class JobFailedError(CoordinatorError):
    """A job died mid-generation and the engine could not resume it."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"generation failed: {reason}")


class KVRefused(JobFailedError):
    """A stage refused a round for K/V room (its CacheFullError): the job waits for room
    and resumes, losing nothing, rather than spending a resume meant for failures."""

    def __init__(self, stage: str, message: str) -> None:
        self.stage = stage
        super().__init__(f"stage {stage} has no K/V room: {message}")


class UnverifiedNewcomers(CoordinatorError):
    """`--unverified-newcomers refuse`: a round of a ring with a stage on probation that no
    trusted party (the gateway, a node off probation, an operator-listed key) could check
    is not released. Fields: newcomers (peer ids), reason (one line: who, what would verify)."""

    def __init__(self, newcomers: tuple[PeerId, ...], reason: str) -> None:
        self.newcomers, self.reason = newcomers, reason
        super().__init__(f"tokens withheld (--unverified-newcomers refuse): {reason}")


class ReceiptRejected(CoordinatorError):
    """A round's receipt chain failed: the job is failed closed. Fields: job_id, round,
    check (the receipts check name), stage (index in the chain or None), peer_id (the
    peer assigned the blamed receipt's layers, or None). Not a JobFailedError: a job
    resumes after those, and a rejected chain must end the request, not be retried."""

    def __init__(self, job_id: str, round: int, error: Any, peer_id: PeerId | None) -> None:
        self.job_id, self.round, self.check, self.stage, self.peer_id = job_id, round, error.check, error.stage, peer_id
        who = f" (peer {peer_id})" if peer_id else ""
        CoordinatorError.__init__(self, f"receipt check failed for job {job_id}: {error}{who}")
        self.reason = str(self)


class RingLost(CoordinatorError):
    """The ring this job's K/V lives on is gone (a node left or the ring re-formed)."""


class RequestError(CoordinatorError):
    """A request the API refuses, with the HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        super().__init__(message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class KVRoomTimeout(RequestError):
    """429: no ring's stages had K/V room for this job within `waited_s`."""

    def __init__(self, waited_s: float, retry_after_s: int) -> None:
        super().__init__(429, f"No ring has K/V room for this request: it waited {waited_s:g} s for running "
                         "generations to finish; retry shortly.", type="rate_limit_error", code="kv_cache_full")
        self.retry_after_s = retry_after_s


class SamplingParamError(CoordinatorError, ValueError):
    """A sampling parameter is out of range or of the wrong type. Fields name which and why."""

    def __init__(self, param: str, value: object, reason: str) -> None:
        self.param, self.value, self.reason = param, value, reason
        super().__init__(f"invalid {param!r}: {reason} (got {value!r})")


class DraftShapeError(CoordinatorError, ValueError):
    """A draft or a verification input has an inconsistent shape or structure."""

    def __init__(self, what: str, expected: object, actual: object) -> None:
        self.what, self.expected, self.actual = what, expected, actual
        super().__init__(f"bad {what}: expected {expected}, got {actual}")


class EagleHeadError(CoordinatorError):
    """A head directory is missing, inconsistent, or does not belong to the target
    (path, what, expected, actual)."""

    def __init__(self, path: object, what: str, expected: object, actual: object) -> None:
        self.path, self.what, self.expected, self.actual = path, what, expected, actual
        super().__init__(f"{path}: {what}: expected {expected}, got {actual}")
