"""Audit replay and audit planning.

The replay (shard.replay) recomputes a stage's whole epoch of frames as one
tree-masked forward; these tests guard that it reproduces exactly what the stage sent
when it ran the frames one by one with commits (a wrong mask, a commit followed wrongly
or a slot mapped to the wrong row would make honest stages look faulty, or let a stage
pass on frames that were never compared), and that planning selects (epoch, stage) pairs
at the configured rate with plans reaching the last verified round.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch
import trio

from coordinator.trust.audit import plan_audits
from shard.replay import ReplayStats, plan_replay, replay
from coordinator.trust.receipt_check import EpochView, FinishedJob, VerifiedRound
from coordinator.swarm.swarm import RingState
from shard.activations import from_wire
from shard.layers import LayerRange
from shard.stage import Stage
from shard.stage_worker import StageWorker, WorkerConfig
from shard.wire.messages import Forward

NONCE = bytes(16)


def frame(round, ctx_len, positions, *, tokens=None, hidden=None, parents=None, src=(), dst=0, want=()):
    return Forward(job_id="j", epoch=1, round=round, nonce=NONCE, phase="verify" if parents is not None else "prefill",
                   ctx_len=ctx_len, positions=torch.tensor(positions), commit_src=tuple(src), commit_dst=dst,
                   tree_parents=None if parents is None else torch.tensor(parents, dtype=torch.int32),
                   tokens=None if tokens is None else torch.tensor(tokens), hidden=hidden, want_aux_layers=tuple(want))


def engine_like_frames(head: bool, hidden_size: int) -> list[Forward]:
    """What a speculative engine sends one stage: two prefill chunks, a draft tree whose
    accepted nodes are not contiguous (so the next frame carries a commit), a chain draft
    accepted in place, then two plain decode frames."""
    gen = torch.Generator().manual_seed(0)
    shapes = [  # (ctx_len, positions, parents, commit_src, commit_dst)
        (0, [0, 1, 2, 3, 4], None, (), 0),
        (5, [5, 6, 7], None, (), 0),
        (8, [8, 9, 9, 10, 10], [-1, 0, 0, 1, 2], (), 0),  # root at slot 8; nodes 2, 4 accepted
        (11, [11, 12, 13], [-1, 0, 1], (10, 12), 9),  # ...moved to slots 9, 10; root at 11
        (13, [13], None, (), 0),
        (14, [14], None, (), 0),
    ]
    out = []
    for i, (ctx, pos, parents, src, dst) in enumerate(shapes):
        t = len(pos)
        x = dict(tokens=torch.randint(0, 60, (t,), generator=gen).tolist()) if head else \
            dict(hidden=torch.randn(t, hidden_size, generator=gen))
        out.append(frame(i + 1, ctx, pos, parents=parents, src=src, dst=dst, **x))
    return out


def stage_outputs(stage: Stage, frames: list[Forward], wire_dtype: str) -> list[torch.Tensor]:
    """What the stage itself sent: one forward per frame on its own cache."""
    worker = StageWorker(stage, WorkerConfig(wire_dtype=wire_dtype))
    return [from_wire(out.hidden, out.hidden_scale, torch.float32) for out in map(worker.process, frames)]


@pytest.fixture(scope="module")
def stages(tiny_llama_store):
    store = tiny_llama_store
    cfg = store.config
    head = Stage(cfg, LayerRange(0, 1), store.load_layers(LayerRange(0, 1)), embedding=store.load_embedding())
    rest = LayerRange(1, cfg.num_layers)
    return {"head": head, "middle": Stage(cfg, rest, store.load_layers(rest))}


@pytest.mark.parametrize("which", ["head", "middle"])
@pytest.mark.parametrize("max_rows", [1024, 4])
def test_tree_replay_equals_frame_by_frame(stages, which, max_rows):
    """Guards the one-forward replay: every row that a token or later K/V depends on
    equals what the stage sent, in one forward, or in several segments re-based on the
    committed context when rows are capped; rejected draft nodes (nothing read them) are
    the only rows left out."""
    stage = stages[which]
    frames = engine_like_frames(which == "head", stage.cfg.hidden_size)
    segments = plan_replay(frames, max_rows)
    assert segments is not None
    groups = [(0, 1, 2, 3, 4, 5)] if max_rows == 1024 else [(0,), (1,), (2,), (3, 4, 5)]
    assert [s.frames for s in segments] == groups
    # Tree frame: root and accepted nodes 2, 4; chain draft: root and node 1 (slot 13 is
    # rewritten by the next frame); the last frame keeps everything.
    kept = [(0, 1, 2, 3, 4), (0, 1, 2), (0, 2, 4), (0, 1), (0,), (0,)]
    assert [k for s in segments for k in s.keep] == kept
    stats = ReplayStats()
    got = replay(stage, "f32", frames, max_rows, stats)
    assert stats.forwards == len(segments) and stats.rows == sum(map(len, kept))
    for i, (want, (keep, hidden, aux)) in enumerate(zip(stage_outputs(stage, frames, "f32"), got)):
        assert keep.tolist() == list(kept[i]) and aux is None
        torch.testing.assert_close(hidden, want[keep], atol=2e-5, rtol=1e-4, msg=f"frame {i}")


def test_tree_replay_on_fp8_wire_matches_within_one_step(stages):
    """Guards replay after the wire codec: per-row fp8 scales do not depend on batching."""
    stage = stages["middle"]
    frames = engine_like_frames(False, stage.cfg.hidden_size)
    got = replay(stage, "f8_e4m3fn", frames)
    for want, (keep, hidden, _) in zip(stage_outputs(stage, frames, "f8_e4m3fn"), got):
        close = torch.isclose(hidden, want[keep], atol=1e-3, rtol=0.13)  # one e4m3 step
        assert close.float().mean() > 0.999


def test_aux_rides_in_its_own_dtype_and_replays_in_it(stages):
    """Guards the aux dtype (Assignment.aux_dtype): a stage on a bf16 wire sends the aux
    features it captures in fp8 with per-row scales while the hidden states stay bf16,
    and the audit replay, told the same dtypes, reproduces both within one step."""
    stage = stages["middle"]
    layer = stage.layers.start
    frames = [dataclasses.replace(f, want_aux_layers=(layer,)) for f in engine_like_frames(False, stage.cfg.hidden_size)]
    worker = StageWorker(stage, WorkerConfig(wire_dtype="bf16", aux_dtype="f8_e4m3fn"))
    sent = [worker.process(f) for f in frames]
    assert all(out.hidden.dtype == torch.bfloat16 and out.hidden_scale is None for out in sent)
    assert all(out.aux.dtype == torch.float8_e4m3fn and out.aux_scale.shape == (out.aux.shape[0],) for out in sent)
    got = replay(stage, "bf16", frames, aux_dtype="f8_e4m3fn")
    for out, (keep, hidden, aux) in zip(sent, got):
        want_aux = from_wire(out.aux, out.aux_scale, torch.float32)[keep]
        assert torch.isclose(aux, want_aux, atol=1e-3, rtol=0.13).float().mean() > 0.999
        assert torch.isclose(hidden, from_wire(out.hidden, None, torch.float32)[keep], atol=1e-3, rtol=1.6e-2).all()


def test_context_that_is_not_one_root_path_falls_back_to_frame_by_frame(stages):
    """Guards exactness for any frame sequence: here slot 3 is rewritten while slot 4 keeps
    K/V that attended to the old slot 3, so no single tree reproduces the third frame;
    replay must notice and run the frames as the stage did."""
    stage = stages["head"]
    frames = [frame(1, 0, [0, 1, 2, 3, 4], tokens=[5, 6, 7, 8, 9]),
              frame(2, 3, [3], tokens=[11]),
              frame(3, 5, [5], tokens=[12])]
    assert plan_replay(frames, 1024) is None
    assert plan_replay(frames[:2], 1024) is not None  # a rewritten tail alone is still a tree
    got = replay(stage, "f32", frames)
    for want, (keep, hidden, _) in zip(stage_outputs(stage, frames, "f32"), got):
        assert keep.tolist() == list(range(want.shape[0]))
        torch.testing.assert_close(hidden, want, atol=2e-5, rtol=1e-4)


def test_reading_an_unwritten_slot_falls_back():
    """Guards: a frame attending to slots nothing wrote (their K/V is whatever the cache
    held) cannot be expressed as a tree."""
    assert plan_replay([frame(1, 2, [2], tokens=[5])], 1024) is None


def finished_job(stages: int, sent: dict[int, list[int]], verified: dict[int, int]) -> FinishedJob:
    epochs = {}
    for epoch in sent:
        ring = RingState(epoch, tuple((f"peer{i}", LayerRange(i, i + 1)) for i in range(stages)),
                         tuple(SimpleNamespace(wire_dtype="bf16", aux_dtype=None) for _ in range(stages)))
        epochs[epoch] = EpochView(ring, {}, (), {})
    rounds = {r: VerifiedRound(e, [f"receipt{r}.{i}" for i in range(stages)]) for r, e in verified.items()}
    return FinishedJob("job", sent, rounds, epochs)


def test_plan_covers_every_round_up_to_the_last_verified():
    """Guards the detection argument: a selected stage is compared on every verified round
    of the epoch (a cheat on any one is caught), and never on another epoch's receipts."""
    job = finished_job(3, {1: [1, 2, 3, 4], 2: [5, 6]}, {1: 1, 2: 1, 4: 1, 5: 2})  # round 3 failed, 6 unverified
    plans = plan_audits(job, 1.0, random.Random(0))
    assert [(p.epoch, p.peer_id, p.rounds, sorted(p.receipts)) for p in plans] == [
        (1, f"peer{i}", (1, 2, 3, 4), [1, 2, 4]) for i in range(3)] + [
        (2, f"peer{i}", (5,), [5]) for i in range(3)]
    assert plans[1].receipts[4] == "receipt4.1" and plans[2].is_tail and not plans[1].is_tail
    assert plan_audits(job, 0.0, random.Random(0)) == []


def test_selection_rate_is_per_stage_and_independent_of_length():
    """Guards the documented rate: each (job, epoch, stage) is selected with probability
    `rate` whatever the number of rounds (4000 draws: 3 sigma is about +-0.02)."""
    rng = random.Random(1)
    for rounds in (1, 40):
        job = finished_job(4, {1: list(range(1, rounds + 1))}, {r: 1 for r in range(1, rounds + 1)})
        picked = sum(len(plan_audits(job, 0.25, rng)) for _ in range(1000))
        assert abs(picked / 4000 - 0.25) < 0.025


def test_jobs_older_than_the_frame_log_grace_are_not_audited():
    """Guards against accusing honest stages: a job whose audit waited past the nodes'
    frame-log grace would read as missing records; it is skipped and counted instead.
    (The swarm here sends nothing but releases of the job's frames: any fetch fails the test.)"""
    from coordinator.trust.audit import AuditConfig, Auditor
    from shard.wire.release_frames import ReleaseFrames

    async def send_control(peer, msg):
        assert isinstance(msg, ReleaseFrames), msg

    swarm = SimpleNamespace(send_control=send_control)
    job = finished_job(3, {1: [1, 2]}, {1: 1, 2: 1})

    async def main():
        finished_in, finished = trio.open_memory_channel(1)
        _, replies = trio.open_memory_channel(0)
        auditor = Auditor(swarm, None, bytes(32), AuditConfig(rate=1.0, max_job_age_s=-1.0), rng=random.Random(0),
                          finished=finished, audit_replies=replies)
        async with trio.open_nursery() as nursery:
            await nursery.start(auditor.serve)
            finished_in.send_nowait(job)
            await auditor.wait_idle()
            nursery.cancel_scope.cancel()
        return auditor

    auditor = trio.run(main)
    assert auditor.stats.skipped_stale == 1 and auditor.stats.audits == 0 and auditor.evidence == []
