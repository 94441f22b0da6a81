"""StageWorker.process_frames: frames of several jobs in one forward, each output its own.

Bugs guarded: an output sent for the wrong job or round, a receipt signed over another
frame's bytes, a bad frame failing the whole batch. Sound: the signer sees each frame's
own received bytes and the body returned for it; each output's hidden states equal the same
frame run alone on a twin worker; the bad frame's error is its own and the others succeed.
"""

from __future__ import annotations

import torch

from shard.errors import ShardError
from shard.layers import LayerRange
from shard.stage import Stage, StageInputError
from shard.stage_worker import StageWorker, WorkerConfig
from shard.wire.codec import decode_frame, encode_body
from shard.wire.limits import Limits
from shard.wire.messages import Forward, Result


def frame(job_id: str, ids: list[int], ctx: int = 0, round_: int = 1) -> Forward:
    return Forward(job_id=job_id, epoch=1, round=round_, nonce=bytes(16), phase="prefill" if ctx == 0 else "decode",
                   ctx_len=ctx, positions=torch.arange(ctx, ctx + len(ids)), tokens=torch.tensor(ids))


def test_batched_frames_are_signed_and_sent_each_on_its_own(tiny_llama_store):
    store = tiny_llama_store
    r = LayerRange(0, store.num_layers)
    stage = Stage(store.config, r, store.load_layers(r), embedding=store.load_embedding())
    signed: list[tuple[str, bytes, bytes]] = []

    def signer(fwd, received, body):
        signed.append((fwd.job_id, bytes(received), body))
        return b"receipt-" + fwd.job_id.encode()

    batched = StageWorker(stage, WorkerConfig(is_tail=True), signer)
    alone = StageWorker(stage, WorkerConfig(is_tail=True))
    for w in (batched, alone):
        w.process_frame(frame("b", [5, 9, 7, 4]), b"")
    signed.clear()  # the warm-up's receipt
    frames = [frame("a", [5, 9, 7]), frame("b", [11], ctx=4, round_=2), frame("bad", [store.config.vocab_size])]
    received = [encode_body(f) for f in frames]
    outs = batched.process_frames(list(zip(frames, received)))
    assert isinstance(outs[2], StageInputError) and isinstance(outs[2], ShardError)
    assert [job for job, _, _ in signed] == ["a", "b"]
    for (fwd, got, raw), (job, signed_in, signed_body) in zip(zip(frames, outs, received), signed):
        msg, body = got
        assert isinstance(msg, Result) and (msg.job_id, msg.round) == (fwd.job_id, fwd.round)
        assert msg.receipts == (b"receipt-" + fwd.job_id.encode(),)
        assert signed_in == raw and body.startswith(signed_body)  # its own bytes in, its own body out
        decoded, canonical_len = decode_frame(body, Limits())
        assert decoded.job_id == fwd.job_id and torch.equal(decoded.hidden, msg.hidden) and canonical_len == len(signed_body)
        want = alone.process(fwd)
        assert (msg.hidden.float() - want.hidden.float()).abs().max().item() <= 1e-4


def test_outputs_of_one_forward_leave_as_one_burst(tiny_llama_store):
    # Bug guarded (issue 21): a forward's outputs reaching the next hop as unrelated frames
    # (it then runs the first alone); a failed frame or, at the tail, a prefill Result (the
    # gateway asks its head for no chunk but a prompt's last) counted in the burst, so the
    # receiver waits for a frame that never comes; a lone output marked as a burst.
    store = tiny_llama_store
    r = LayerRange(0, store.num_layers)
    stage = Stage(store.config, r, store.load_layers(r), embedding=store.load_embedding())
    for is_tail in (False, True):
        worker = StageWorker(stage, WorkerConfig(is_tail=is_tail))
        for job in "abc":
            worker.process_frame(frame(job, [5, 9, 7, 4]), b"")
        frames = [frame("a", [11], ctx=4, round_=2), frame("b", [12], ctx=4, round_=2), frame("c", [13], ctx=4, round_=2),
                  frame("bad", [store.config.vocab_size]), frame("d", [5, 9])]
        outs = worker.process_frames([(f, encode_body(f)) for f in frames])
        bursts = [None if isinstance(o, ShardError) else decode_frame(o[1], Limits())[0].burst for o in outs]
        assert bursts[3] is None and bursts[0] == bursts[1] == bursts[2] and bursts[0][1] == (3 if is_tail else 4)
        assert bursts[4] == (() if is_tail else bursts[0])
        [(_, lone)] = worker.process_frames([(frames[0], encode_body(frames[0]))])  # a lone output: no burst
        assert decode_frame(lone, Limits())[0].burst == ()
