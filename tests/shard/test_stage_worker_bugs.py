"""StageWorker.process_frames_alone_on_error: a bug in a batch costs only its own frame (issue 20).

Bugs guarded: an exception that is no ShardError (a check we missed, a receipt signer
raising) failing every job of its batch, or, rerun, leaving a job's part-run prefill
chunk or its K/V different from a run without the bug; a commit applied twice. Sound:
the bug is injected into the real stage's forward (or the signer) only when the bad job's
frame is in the call, and every other output is compared bit for bit with the same
frames run alone on a twin worker that never saw the bug.
"""

from __future__ import annotations

import pytest
import torch

from shard.layers import LayerRange
from shard.stage import Stage
from shard.stage_worker import StageWorker, WorkerConfig, _commit_repeats
from shard.wire.messages import Forward, Result


def frame(job_id: str, ids: list[int], ctx: int = 0, round_: int = 1) -> Forward:
    return Forward(job_id=job_id, epoch=1, round=round_, nonce=bytes(16), phase="prefill" if ctx == 0 else "decode",
                   ctx_len=ctx, positions=torch.arange(ctx, ctx + len(ids)), tokens=torch.tensor(ids))


def stage_of(store) -> Stage:
    r = LayerRange(0, store.num_layers)
    return Stage(store.config, r, store.load_layers(r), embedding=store.load_embedding())


def hidden(out) -> torch.Tensor:
    msg, _body = out
    assert isinstance(msg, Result)
    return msg.hidden


def test_a_bug_in_a_batch_fails_its_frame_alone_and_the_others_run_as_if_it_were_not_there(tiny_llama_store):
    stage, twin = stage_of(tiny_llama_store), stage_of(tiny_llama_store)
    honest = stage.forward_batch

    def buggy(frames):
        if any(f.job.job_id == "bad" for f in frames):
            raise RuntimeError("a bug only the bad job meets")
        return honest(frames)

    stage.forward_batch = buggy
    worker, alone = StageWorker(stage, WorkerConfig(is_tail=True)), StageWorker(twin, WorkerConfig(is_tail=True))
    # "p" runs a 12-row prompt in pieces: its first piece before the bug, its last beside it.
    prompt = (frame("p", list(range(3, 15))), b"")
    assert worker.process_frames_alone_on_error([prompt], [(0, 5)]) == [None]
    batch = [(frame("a", [5, 9, 7]), b""), (frame("bad", [4, 4]), b""), prompt, (frame("b", [8]), b"")]
    outs = worker.process_frames_alone_on_error(batch, [None, None, (5, 12), None])
    assert isinstance(outs[1], RuntimeError) and str(outs[1]) == "a bug only the bad job meets"
    assert alone.process_frames_alone_on_error([prompt], [(0, 5)]) == [None]  # the twin runs p's pieces as well
    want = {"a": alone.process(batch[0][0]).hidden, "b": alone.process(batch[3][0]).hidden,
            "p": hidden(alone.process_frames([prompt], [(5, 12)])[0])}
    for (fwd, _), out in zip(batch[:1] + batch[2:], outs[:1] + outs[2:]):
        assert torch.equal(hidden(out), want[fwd.job_id]), fwd.job_id
    assert "bad" not in worker.pieces and set(worker.cache.jobs) >= {"a", "b", "p"}
    # The K/V the rerun left is what a run without the bug leaves: the next rows agree too.
    for job, ids, ctx in (("a", [11], 3), ("p", [2], 12)):
        nxt = frame(job, ids, ctx, round_=2)
        [out] = worker.process_frames_alone_on_error([(nxt, b"")])
        assert torch.equal(hidden(out), alone.process(nxt).hidden), job


def test_a_receipt_signer_raising_costs_its_frame_alone(tiny_llama_store):
    stage = stage_of(tiny_llama_store)

    def signer(fwd, received, body):
        if fwd.job_id == "bad":
            raise ValueError("nonce too short to sign")
        return b"r"

    worker = StageWorker(stage, WorkerConfig(is_tail=True), signer)
    outs = worker.process_frames_alone_on_error([(frame("a", [5, 9]), b""), (frame("bad", [5, 9]), b"")])
    assert isinstance(outs[1], ValueError)
    assert isinstance(outs[0][0], Result) and outs[0][0].receipts == (b"r",)


def test_a_frame_whose_commit_cannot_be_applied_twice_is_not_rerun(tiny_llama_store):
    stage = stage_of(tiny_llama_store)
    worker = StageWorker(stage, WorkerConfig(is_tail=True))
    for job in ("s", "ok"):
        worker.process_frame(frame(job, list(range(3, 13))), b"")
    honest, calls = stage.forward_batch, []

    def buggy(frames):
        calls.append(len(frames))
        if len(calls) == 1:
            raise RuntimeError("once")
        return honest(frames)

    stage.forward_batch = buggy
    swap = Forward(job_id="s", epoch=1, round=2, nonce=bytes(16), phase="decode", ctx_len=8, positions=torch.tensor([8]),
                   tokens=torch.tensor([4]), commit_src=(7, 6), commit_dst=6)
    outs = worker.process_frames_alone_on_error([(swap, b""), (frame("ok", [4], 10, 2), b"")])
    assert isinstance(outs[0], RuntimeError) and isinstance(outs[1][0], Result)
    assert calls == [2, 1]  # the batch, then "ok" alone: the swap was not applied again


@pytest.mark.parametrize(("src", "dst", "repeats"), [
    ((), 0, True), ((5, 7), 5, True), ((9, 10), 5, True), ((5, 6, 9), 5, True),
    ((6, 8), 5, False), ((6, 5), 5, False), ((7, 6), 6, False),
])
def test_a_commit_repeats_unless_it_reads_a_slot_it_writes_first(src, dst, repeats):
    fwd = Forward(job_id="j", epoch=1, round=1, nonce=bytes(16), phase="decode", ctx_len=12, positions=torch.tensor([12]),
                  tokens=torch.tensor([1]), commit_src=src, commit_dst=dst)
    assert _commit_repeats(fwd) is repeats
