"""Ranged audit fetches on the wire and at the stage (shard.wire.audit_frames, shard.audit_answers).

Guards issue 21's audit cost: one AuditRequest names many (round, side) items and the stage
answers as many as fit the request's byte budget, never none, so an audit of a long job
takes a few round trips instead of two per round. Both messages come from the network:
every bound is checked at decode with an exact one-line error, and a reply that covers no
item or more than were asked is refused by the coordinator's reader.
"""

from __future__ import annotations

import threading

import msgpack
import pytest
import torch
import trio

from shard.audit_answers import answer, reply
from shard.errors import WireError
from shard.frame_log import FrameLog
from shard.wire.audit_frames import MAX_AUDIT_ITEMS, AuditReply, AuditRequest, items, read_reply
from shard.wire.codec import decode, encode
from shard.wire.limits import Limits
from shard.wire.messages import PROTOCOL_VERSION


def _request(rounds, sides=None, max_bytes=1024, job_id="job", request_id=1) -> AuditRequest:
    return AuditRequest(request_id=request_id, job_id=job_id, epoch=1, rounds=tuple(rounds),
                        sides=tuple(sides or ["input"] * len(rounds)), max_bytes=max_bytes)


def _refused(kind: str, **fields) -> str:
    head = msgpack.packb({"v": PROTOCOL_VERSION, "kind": kind, "tensors": [], **fields}, use_bin_type=True)
    with pytest.raises(WireError) as info:
        decode(len(head).to_bytes(4, "big") + head, Limits())
    return str(info.value)


def _log() -> FrameLog:
    log = FrameLog()
    for r in range(1, 6):
        log.record("job", 1, r, bytes([r]) * 300, bytes([100 + r]) * 500)
    return log


def test_a_full_request_and_a_reply_round_trip():
    req = _request(range(MAX_AUDIT_ITEMS), ["output"] * MAX_AUDIT_ITEMS, max_bytes=1 << 20)
    assert decode(encode(req), Limits()) == req
    reply = AuditReply(request_id=9, sizes=(3, 0, 2), frames=torch.arange(5, dtype=torch.uint8))
    out = decode(encode(reply), Limits())
    assert out.request_id == 9 and out.sizes == (3, 0, 2) and out.frames.tolist() == [0, 1, 2, 3, 4]
    empty = decode(encode(AuditReply(request_id=9, sizes=(0,))), Limits())
    assert empty.sizes == (0,) and empty.frames is None


def test_bad_peer_input_is_a_one_line_wire_error_naming_the_limit():
    ok = dict(request_id=1, job_id="j", epoch=1, rounds=[1], sides=["input"], max_bytes=1024)
    assert _refused("audit_request", **{**ok, "rounds": []}) == f"field 'rounds' length (limit 1..{MAX_AUDIT_ITEMS}, got 0)"
    n = MAX_AUDIT_ITEMS + 1
    assert _refused("audit_request", **{**ok, "rounds": [1] * n, "sides": ["input"] * n}) == (  # msgpack's own cap
        f"header msgpack (limit None, got ValueError: {n} exceeds max_array_len({MAX_AUDIT_ITEMS}))")
    assert _refused("audit_request", **{**ok, "rounds": [1, 2]}) == "field 'sides' length (one per round) (limit 2, got 1)"
    assert _refused("audit_request", **{**ok, "sides": ["both"]}) == (
        "field 'sides'[0] value (limit ['input', 'output'], got both)")
    assert _refused("audit_request", **{**ok, "max_bytes": 10}) == (
        "field 'max_bytes' range (limit [1024, 9223372036854775807], got 10)")
    assert _refused("audit_request", **{**ok, "rounds": [True]}) == "field 'rounds'[0] type (limit int, got bool)"
    assert _refused("audit_reply", request_id=1, sizes=[4]) == (
        "tensor 'frames' (the sizes' sum of bytes) (limit 4, got none)")
    with pytest.raises(WireError, match=r"tensor 'frames' length \(the sizes' sum\) \(limit 4, got 3\)"):
        decode(encode(AuditReply(request_id=1, sizes=(4,), frames=torch.zeros(3, dtype=torch.uint8))), Limits())


def test_the_stage_answers_a_prefix_that_fits_the_budget_and_never_none():
    log, wanted = _log(), items(range(1, 6))  # 10 items: 300-byte inputs, 500-byte outputs
    req = _request([r for r, _ in wanted], [s for _, s in wanted], max_bytes=1700)
    reply = answer(log, req)
    assert reply.sizes == (300, 500, 300, 500)  # 1600 bytes; the fifth item would pass 1700
    assert read_reply(req, reply) == [b"\x01" * 300, b"\x65" * 500, b"\x02" * 300, b"\x66" * 500]
    # One item always, however large: a frame is within the frame cap already.
    assert answer(log, _request([3, 4], ["output", "input"], max_bytes=1024)).sizes == (500, 300)
    big = FrameLog()
    big.record("job", 1, 1, b"i" * 5000, b"o" * 5000)
    assert answer(big, _request([1, 1], ["input", "output"], max_bytes=1024)).sizes == (5000,)


def test_records_not_kept_are_size_zero_and_read_as_none():
    log = _log()
    req = _request([2, 9, 3], ["output", "input", "input"], max_bytes=1 << 20)
    reply = answer(log, req)
    assert reply.sizes == (500, 0, 300)
    assert read_reply(req, reply) == [b"\x66" * 500, None, b"\x03" * 300]
    gone = answer(log, _request([1], job_id="other"))
    assert gone.sizes == (0,) and gone.frames is None


def test_a_round_logged_twice_is_answered_with_its_last_record():
    log = _log()
    log.record("job", 1, 3, b"again" * 60, b"AGAIN" * 100)  # a round run again on the epoch: the last counts
    got = answer(log, _request([3, 3, 4], ["input", "output", "input"], max_bytes=1 << 20))
    assert got.sizes == (300, 500, 300)
    assert bytes(got.frames.numpy()) == b"again" * 60 + b"AGAIN" * 100 + b"\x04" * 300


def test_the_reply_is_built_off_the_trio_thread_and_sent_as_answer_encodes_it():
    log, sent, threads = _log(), [], set()
    record = log.frames  # the node's log is read in a worker thread (and, for a release, its heap trimmed)

    def frames(*args):
        threads.add(threading.current_thread() is threading.main_thread())
        return record(*args)

    log.frames = frames
    req = _request([1, 2], ["input", "output"], max_bytes=1 << 20)

    async def send(body: bytes) -> None:
        sent.append(body)

    trio.run(reply, log, req, send)
    assert threads == {False}  # read only off the trio thread
    assert sent == [encode(answer(log, req))]
    trio.run(reply, log, _request([9]), send)  # nothing kept: still one reply, of size 0
    assert decode(sent[-1], Limits()).sizes == (0,)


def test_a_reply_covering_no_item_or_more_than_asked_is_refused():
    req = _request([1, 2])
    with pytest.raises(WireError, match=r"audit reply items \(a prefix of the request's\) \(limit 1..2, got 0\)"):
        read_reply(req, AuditReply(request_id=1, sizes=()))
    with pytest.raises(WireError, match=r"\(limit 1..2, got 3\)"):
        read_reply(req, AuditReply(request_id=1, sizes=(0, 0, 0)))
