"""Verify messages past one control frame (shard.verify_parts, shard.verifier.receive).

Guards: a long prompt's frames of one stage (past one control frame) used to go out
unverified and unaudited; cut into VerifyParts they must reach the verifier byte for byte
and its answer, in parts too, must equal the one it gives the same request whole (else
an honest stage would be judged on a different recomputation). The uploads a receiver
holds are the memory a sender pins, so every rule is pinned with its exact error: a part
out of order, of an upload never started, past the cap or the deadline, or more uploads
open than allowed drops the upload and costs only that request.
"""

from __future__ import annotations

import pytest
import torch
import trio
from hypothesis import given, settings, strategies as st

from coordinator.trust.compare import logged_frames, split_reply
from shard.errors import ShardError, WireError
from shard.layers import LayerRange
from shard.stage import Stage
from shard.verifier import Verifier
from shard.verify_parts import Uploads, assemble, split, upload_cap, whole_limits
from shard.wire.codec import decode, encode
from shard.wire.limits import Limits
from shard.wire.verify import MIN_PART_BYTES, VerifyPart, VerifyReply, VerifyRequest, control_limits
from tests.shard.test_verifier import logged_job, request_for

LIMITS = Limits(hidden_size=8, max_context_tokens=64)


def request(nbytes: int, request_id: int = 3) -> VerifyRequest:
    data = bytes(range(256)) * (nbytes // 256 + 1)
    return VerifyRequest(request_id=request_id, layer_start=0, layer_end=1, wire_dtype="f32", frame_bytes=(nbytes,),
                         frames=torch.frombuffer(bytearray(data[:nbytes]), dtype=torch.uint8))


@pytest.fixture(scope="module")
def middle(tiny_llama_store):
    r = LayerRange(1, tiny_llama_store.config.num_layers)
    return tiny_llama_store, Stage(tiny_llama_store.config, r, tiny_llama_store.load_layers(r))


def on_the_wire(msgs, limits=LIMITS):
    """Each message as a control stream carries it: encoded, then decoded under control_limits."""
    return [decode(encode(m, control_limits(limits)), control_limits(limits)) for m in msgs]


@settings(max_examples=40, deadline=None)
@given(nbytes=st.integers(1, 60_000), part_bytes=st.integers(MIN_PART_BYTES, 20_000))
def test_parts_put_back_together_are_the_message(nbytes, part_bytes):
    req = request(nbytes)
    cap = upload_cap(LIMITS)
    msgs = on_the_wire(split(req, part_bytes, whole_limits(LIMITS, cap)))
    whole = encode(req)
    if len(whole) <= part_bytes:
        assert len(msgs) == 1 and isinstance(msgs[0], VerifyRequest)
        return
    assert all(isinstance(m, VerifyPart) and len(encode(m)) <= part_bytes for m in msgs)
    uploads, got = Uploads(cap), None
    for m in msgs:
        assert got is None
        got = uploads.add("c", m)
    assert got == whole and uploads.open_bytes == 0
    back = assemble(got, LIMITS, cap, VerifyRequest, 3)
    assert back.frame_bytes == req.frame_bytes and torch.equal(back.frames, req.frames)


@settings(max_examples=60, deadline=None)
@given(order=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 7)), max_size=40), cap=st.integers(1, 30_000))
def test_parts_in_any_order_only_raise_shard_errors_and_hold_at_most_the_cap(order, cap):
    """Any sequence of parts of three uploads (repeats, gaps, interleaving): each add puts
    back exactly its upload's bytes or raises ShardError, and what stays open is bounded."""
    msgs = {rid: parts_of(9_000 + 4_000 * rid, rid) for rid in range(3)}
    uploads = Uploads(cap, max_open=2)
    for rid, k in order:
        part = msgs[rid][k % len(msgs[rid])]
        try:
            got = uploads.add("c", part)
        except ShardError:
            continue
        assert got is None or got == encode(request(9_000 + 4_000 * rid, rid))
        assert uploads.open_bytes <= 2 * cap


def parts_of(nbytes: int, request_id: int = 3, part_bytes: int = MIN_PART_BYTES) -> list[VerifyPart]:
    return split(request(nbytes, request_id), part_bytes, whole_limits(LIMITS, upload_cap(LIMITS)))


def test_a_part_out_of_order_or_of_no_upload_drops_it():
    p = parts_of(20_000)
    assert len(p) >= 4
    uploads = Uploads(upload_cap(LIMITS))
    with pytest.raises(ShardError, match=r"^verify upload 3: part 1 of an upload not open \(never started, dropped, "
                                         r"or past its 60 s deadline\)$"):
        uploads.add("c", p[1])
    uploads.add("c", p[0])
    with pytest.raises(ShardError, match=rf"^verify upload 3: part 2 of {len(p)} \(\d+ bytes\) where part 1 of "
                                         rf"{len(p)} \(\d+ bytes\) was due$"):
        uploads.add("c", p[2])
    assert uploads.open_bytes == 0  # dropped: the rest of it finds nothing
    with pytest.raises(ShardError, match="part 1 of an upload not open"):
        uploads.add("c", p[1])
    uploads.add("c", p[0])
    with pytest.raises(ShardError, match="^verify upload 3: part 0 again while the upload was open$"):
        uploads.add("c", p[0])


def test_an_upload_past_the_cap_the_open_count_or_its_deadline_is_refused():
    p = parts_of(20_000)
    with pytest.raises(ShardError, match=rf"^verify upload 3: {p[0].total_bytes} bytes, over the cap of 10000$"):
        Uploads(10_000).add("c", p[0])
    now = [0.0]
    uploads = Uploads(upload_cap(LIMITS), max_open=2, deadline_s=5.0, clock=lambda: now[0])
    uploads.add("c", parts_of(20_000, 1)[0]), uploads.add("c", parts_of(20_000, 2)[0])
    uploads.add("other", parts_of(20_000, 3)[0])  # the cap is per sender
    with pytest.raises(ShardError, match="^verify upload 3: 2 uploads from this sender are open already$"):
        uploads.add("c", p[0])
    now[0] = 6.0  # both of c's are past their deadline: dropped as the next part arrives
    uploads.add("c", p[0])
    with pytest.raises(ShardError, match="part 1 of an upload not open"):
        uploads.add("c", parts_of(20_000, 1)[1])
    assert uploads.open_bytes == len(p[0].data.numpy().tobytes())  # "other"'s expired too
    uploads.drop("c", 3)  # the asker gave up: its bytes are freed at once
    assert uploads.open_bytes == 0


def test_parts_that_lie_about_their_total_or_kind_are_refused():
    p = parts_of(20_000)
    short = VerifyPart(request_id=3, part=0, parts=2, total_bytes=10, data=torch.zeros(5, dtype=torch.uint8))
    uploads = Uploads(upload_cap(LIMITS))
    uploads.add("c", short)
    with pytest.raises(ShardError, match="^verify upload 3: parts past its total of 10 bytes$"):
        uploads.add("c", VerifyPart(request_id=3, part=1, parts=2, total_bytes=10, data=torch.zeros(6, dtype=torch.uint8)))
    got = None
    for m in p:
        got = uploads.add("c", m)
    with pytest.raises(ShardError, match="^verify upload 4: its parts make a VerifyRequest 3, not a VerifyReply 4$"):
        assemble(got, LIMITS, uploads.cap, VerifyReply, 4)


@pytest.mark.parametrize("fields, what", [
    (dict(part=2, parts=2), "field 'part'"),
    (dict(data=torch.zeros(0, dtype=torch.uint8)), "tensor 'data' shape"),
    (dict(data=torch.zeros(11, dtype=torch.uint8)), "tensor 'data' shape"),
    (dict(parts=1, part=0), "field 'parts' range"),
])
def test_verify_part_fields_are_checked_at_decode(fields, what):
    base = dict(request_id=1, part=0, parts=2, total_bytes=10, data=torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(WireError, match=what):
        encode(VerifyPart(**(base | fields)))


def test_the_upload_cap_follows_the_model():
    """SmolLM2-135M's shape: a full context of f32 hidden + 3 aux rows, plus frame headers."""
    limits = Limits(max_frame_bytes=7 << 20, hidden_size=576, max_context_tokens=8192)
    assert upload_cap(limits) == 8192 * 576 * 16 + 4096 * 4096
    assert upload_cap(Limits()) == min(16 * Limits().max_frame_bytes, (1 << 32) - 1)  # no model: 16 frames
    assert upload_cap(Limits(hidden_size=8, max_context_tokens=4)) == Limits().max_frame_bytes  # never below a frame


def test_a_verifier_answers_a_request_in_parts_as_it_answers_it_whole(middle):
    """Request and reply both cut into 2 KiB parts: the rows are the whole request's."""
    store, stage = middle
    plan, records = logged_job(stage)
    limits = Limits.for_model(store.config, max_tokens_per_frame=2048)
    logged = logged_frames(plan, records, Limits.for_model(store.config))
    req = request_for(plan, logged, max_part_bytes=MIN_PART_BYTES)
    cap = upload_cap(limits)
    parts = on_the_wire(split(req, MIN_PART_BYTES, whole_limits(limits, cap)), limits)
    assert len(parts) > 2
    sent: list = []

    async def main():
        verifier = Verifier(store, "cpu", trio.CapacityLimiter(1))

        async def send(msg):
            sent.append(msg)

        async with trio.open_nursery() as nursery:
            for m in parts:
                verifier.receive(m, limits, None, nursery, send)
        return await verifier.answer(req, limits)

    whole = trio.run(main)
    replies = on_the_wire(sent, limits)
    assert len(replies) > 1 and all(isinstance(m, VerifyPart) and len(encode(m)) <= MIN_PART_BYTES for m in replies)
    uploads, got = Uploads(cap), None
    for m in replies:
        got = uploads.add("verifier", m)
    reply = assemble(got, limits, cap, VerifyReply, req.request_id)
    assert reply.error is None and whole.error is None and reply.frame_rows == whole.frame_rows
    assert torch.equal(reply.keep, whole.keep) and torch.equal(reply.hidden, whole.hidden)
    assert split_reply(reply, logged) is not None


def test_a_broken_upload_costs_the_verifier_one_error_reply(middle):
    store, _ = middle
    limits = Limits.for_model(store.config, max_tokens_per_frame=2048)
    p = parts_of(20_000, request_id=9)
    sent: list = []

    async def main():
        verifier = Verifier(store, "cpu", trio.CapacityLimiter(1))

        async def send(msg):
            sent.append(msg)

        async with trio.open_nursery() as nursery:
            verifier.receive(p[1], limits, None, nursery, send)
        return verifier

    verifier = trio.run(main)
    assert len(sent) == 1 and sent[0].request_id == 9 and "part 1 of an upload not open" in sent[0].error
    assert verifier.refused == 1 and verifier.uploads.open_bytes == 0
