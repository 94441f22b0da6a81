"""Which of a source job's frames a forked job's audit replays first, and when it cannot
(coordinator.trust.prefix_audit), pure.

Bugs guarded: a lead that stops before the frame whose commit moves accepted draft rows
into the prefix (the replayed prefix would hold rejected nodes' K/V: an honest stage
accused); a lead padded with frames that write nothing below the prefix (cost only, but it
hides the rule); a source whose logged frames leave a prefix slot unwritten replayed anyway
(its K/V would be a fresh cache's zeros: a verdict on K/V nobody computed); a fork frame
that names another source than the gateway sent, or that is not the job's first frame on
the stage, replayed as if it were the fork. Sound: the property compares the slots [0, L)
that the lead leaves with those the whole source leaves, each slot named by the (frame,
row) that wrote it, followed through commits by a simulation written here, not by the
module's own slot arithmetic.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.trust.audit_plan import AuditPlan
from coordinator.trust.compare import Finding, Logged
from coordinator.trust.prefix_audit import lead_frames, with_source
from shard.layers import LayerRange
from shard.wire.codec import encode_body
from shard.wire.limits import Limits
from shard.wire.messages import Forward


def _frame(ctx: int, t: int, *, job: str = "src", round_: int = 1, parents=None, src=(), dst=0,
           prefix: str | None = None) -> Forward:
    return Forward(job_id=job, epoch=1, round=round_, nonce=bytes(16), phase="verify" if parents else "prefill",
                   ctx_len=ctx, positions=torch.arange(ctx, ctx + t), tokens=torch.arange(t) + 3,
                   commit_src=tuple(src), commit_dst=dst,
                   tree_parents=None if parents is None else torch.tensor(parents, dtype=torch.int32),
                   prefix_job=prefix, prefix_len=ctx if prefix else 0)


def _logged(frames: list[Forward]) -> Logged:
    return Logged(tuple(range(1, len(frames) + 1)), tuple(frames), tuple(frames), tuple(b"" for _ in frames))


def _slots(frames: list[Forward]) -> dict[int, tuple[int, int]]:
    """slot -> (frame index, row) whose K/V is there after `frames`: a commit gathers its
    sources first, then writes them; then the frame's rows go to ctx_len + row."""
    held: dict[int, tuple[int, int]] = {}
    for i, f in enumerate(frames):
        moved = [held.get(s) for s in f.commit_src]
        for k, who in enumerate(moved):
            held.pop(f.commit_dst + k, None) if who is None else held.__setitem__(f.commit_dst + k, who)
        for j in range(f.positions.shape[0]):
            held[f.ctx_len + j] = (i, j)
    return held


@st.composite
def _engine_frames(draw) -> tuple[list[Forward], int]:
    """A speculative engine's frames of one job on one stage, and its committed length:
    prefill chunks, plain decodes, and draft trees whose accepted nodes (root first) the
    next frame commits to the slots after the context."""
    frames, ctx, tree = [], 0, None
    for _ in range(draw(st.integers(1, 8))):
        src, dst = (), 0
        if tree is not None:
            base, size = tree
            accepted = [base] + sorted(draw(st.sets(st.integers(base + 1, base + size - 1), max_size=size - 1))
                                       if size > 1 else [])
            src, dst, ctx = tuple(accepted), base, base + len(accepted)
        kind = draw(st.sampled_from(["chunk", "decode", "tree"]))
        t = draw(st.integers(2, 5)) if kind != "decode" else 1
        parents = None
        if kind == "tree":
            parents = [-1] + [draw(st.integers(0, j - 1)) for j in range(1, t)]
        frames.append(_frame(ctx, t, parents=parents, src=src, dst=dst))
        tree = (ctx, t) if kind == "tree" else None
        ctx += 0 if kind == "tree" else t
    return frames, ctx


@settings(max_examples=300, deadline=None)
@given(_engine_frames(), st.data())
def test_the_lead_leaves_the_prefix_slots_as_the_whole_source_did(case, data):
    frames, committed = case
    if committed == 0:
        return  # a source whose only frame is a draft tree has no committed context to share
    prefix_len = data.draw(st.integers(1, committed))
    lead = lead_frames(_logged(frames), prefix_len)
    assert lead is not None
    n = len(lead.inputs)
    whole, led = _slots(frames), _slots(frames[:n])
    assert all(led[s] == whole[s] for s in range(prefix_len))
    assert lead.rounds == tuple(range(1, n + 1))
    # The lead's last frame writes below the prefix (rows or commit), and no frame past it does.
    last = frames[n - 1]
    assert last.ctx_len < prefix_len or (last.commit_src and last.commit_dst < prefix_len)
    later = frames[n:]
    assert all(f.commit_dst >= prefix_len or not f.commit_src for f in later)
    assert all(f.ctx_len >= prefix_len for f in later)


def test_the_frame_committing_accepted_nodes_into_the_prefix_is_in_the_lead():
    frames = [_frame(0, 5), _frame(5, 3, parents=[-1, 0, 0]),  # a tree at slots 5-7; node 2 accepted
              _frame(7, 1, src=(5, 7), dst=5),  # ...moved to slot 6; context 7 from here
              _frame(8, 1)]
    assert len(lead_frames(_logged(frames), 7).inputs) == 3  # the commit writes slot 6
    assert len(lead_frames(_logged(frames), 5).inputs) == 1  # the tree wrote slots 5-7, all past it
    assert len(lead_frames(_logged(frames), 8).inputs) == 3  # the frame at context 7 writes slot 7
    assert len(lead_frames(_logged(frames), 9).inputs) == 4


def test_a_source_that_leaves_a_prefix_slot_unwritten_cannot_lead():
    assert lead_frames(_logged([_frame(0, 4), _frame(5, 1)]), 6) is None  # slot 4 never logged
    assert lead_frames(_logged([_frame(0, 4)]), 5) is None


def _plan(job: str, rounds, prefix=None, prefix_len=0) -> AuditPlan:
    return AuditPlan(job, 1, "stage", LayerRange(0, 1), False, "f32", None, tuple(rounds), {}, prefix=prefix,
                     prefix_len=prefix_len)


def _records(frames: list[Forward]) -> dict[int, tuple[bytes, bytes]]:
    return {f.round: (encode_body(f), encode_body(f)) for f in frames}


SOURCE = [_frame(0, 4, round_=1), _frame(4, 1, round_=2), _frame(5, 1, round_=3)]


def test_the_fork_frame_decides_what_leads():
    source = _plan("src", (1, 2, 3))
    fork = [_frame(5, 2, job="j", round_=1, prefix="src"), _frame(7, 1, job="j", round_=2)]
    plan = _plan("j", (1, 2), source, 5)
    got = with_source(plan, _records(fork), _records(SOURCE), Limits())
    assert isinstance(got, Logged) and got.rounds == (1, 2) and got.lead.rounds == (1, 2)
    assert [f.job_id for f in got.replayed_inputs] == ["src", "src", "j", "j"]
    # A stage that never ran the fork (it refused it; the job started again from 0) replays alone.
    again = [_frame(0, 7, job="j", round_=2)]
    got = with_source(_plan("j", (1, 2), source, 5), _records(again), _records(SOURCE), Limits())
    assert isinstance(got, Logged) and got.lead is None
    # A fork frame naming another source than the gateway sent is the stage's record, not ours.
    other = [_frame(5, 2, job="j", round_=1, prefix="elsewhere"), fork[1]]
    got = with_source(plan, _records(other), _records(SOURCE), Limits())
    assert isinstance(got, Finding) and got.check == "structure" and got.round == 1 and "'elsewhere'" in got.detail
    # A fork that is not the job's first frame here cannot be replayed after the source's: skipped.
    late = [_frame(0, 2, job="j", round_=1), _frame(5, 2, job="j", round_=2, prefix="src")]
    assert with_source(_plan("j", (1, 2), source, 5), _records(late), _records(SOURCE), Limits()) is None
    # Source frames that do not reach the prefix: skipped, nobody accused.
    assert with_source(plan, _records(fork), _records(SOURCE[:1]), Limits()) is None
