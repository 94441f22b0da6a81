"""ReleaseFrames on the wire and at the stage (shard.wire.release_frames, shard.audit_answers).

Guards issue 21's frame-log release: the message a coordinator sends so a stage drops the
frames no audit will ask for. It comes from the network, so every bound is checked at
decode with an exact error (count cap, the receipts' job-id alphabet, one epoch per job id,
ints not bools); and at the stage it drops exactly the (job, epoch) pairs named, while an
AuditRequest still gets the logged bytes of the others.
"""

from __future__ import annotations

import msgpack
import pytest

from shard.audit_answers import answer
from shard.errors import WireError
from shard.frame_log import FrameLog
from shard.wire.codec import decode, encode
from shard.wire.limits import Limits
from shard.wire.messages import PROTOCOL_VERSION, AuditRequest
from shard.wire.release_frames import MAX_RELEASE_JOBS, ReleaseFrames


def _body(job_ids, epochs) -> bytes:
    """A peer's frame body with these fields as given (no checks on our side)."""
    head = msgpack.packb({"v": PROTOCOL_VERSION, "kind": "release_frames", "job_ids": job_ids, "epochs": epochs,
                          "tensors": []},
                         use_bin_type=True)
    return len(head).to_bytes(4, "big") + head


def _refused(job_ids, epochs) -> str:
    with pytest.raises(WireError) as info:
        decode(_body(job_ids, epochs), Limits())
    return str(info.value)


def test_a_full_batch_round_trips():
    msg = ReleaseFrames(job_ids=[f"job-{i}" for i in range(MAX_RELEASE_JOBS)], epochs=list(range(MAX_RELEASE_JOBS)))
    out = decode(encode(msg), Limits())
    assert isinstance(out, ReleaseFrames) and out.job_ids == tuple(msg.job_ids) and out.epochs == tuple(msg.epochs)


def test_bad_peer_input_is_a_one_line_wire_error_naming_the_limit():
    n = MAX_RELEASE_JOBS + 1
    assert _refused(["j"] * n, [1] * n) == f"field 'job_ids' length (limit {MAX_RELEASE_JOBS}, got {n})"
    assert _refused(["j", "k"], [1]) == "field 'epochs' length (one per job id) (limit 2, got 1)"
    assert _refused(["../etc"], [1]).startswith("field 'job_ids'[0] value (limit 1..64 chars of [A-Za-z0-9._-]")
    assert _refused(["j"], [-1]) == f"field 'epochs'[0] range (limit [0, {(1 << 63) - 1}], got -1)"
    assert _refused(["j"], [True]) == "field 'epochs'[0] type (limit int, got bool)"
    assert _refused("j", [1]) == "field 'job_ids' type (limit list, got str)"


def test_the_stage_drops_the_named_pairs_and_still_answers_audits_of_the_rest():
    log = FrameLog()
    log.record("a", 1, 1, b"in-a", b"out-a")
    log.record("b", 1, 1, b"in-b", b"out-b")
    log.record("b", 2, 1, b"in-b2", b"out-b2")
    for job in ("a", "b"):
        log.end_job(job)
    assert answer(log, ReleaseFrames(job_ids=["a", "b"], epochs=[1, 2])) is None
    assert log.frames("a", 1) == [] and log.frames("b", 2) == [] and log.nbytes == len(b"in-b" + b"out-b")
    reply = answer(log, AuditRequest(request_id=1, job_id="b", epoch=1, rounds=[1], sides=["output"], max_bytes=1024))
    assert reply.sizes == (5,) and bytes(reply.frames.numpy()) == b"out-b"
    reply = answer(log, AuditRequest(request_id=2, job_id="a", epoch=1, rounds=[1], sides=["input"], max_bytes=1024))
    assert reply.sizes == (0,) and reply.frames is None
